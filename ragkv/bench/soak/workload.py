"""The soak's workload (pure, seeded): two tenants, each with a marker string only its documents hold,
synthetic passages about towns, and the fixed probes re-sent throughout."""

from __future__ import annotations

import random

TENANTS = ("tenantA", "tenantB")
# A string only each tenant's documents (text, title, id) hold; seen in another tenant's response = a leak.
MARKERS = {"tenantA": "ZORVATHIUM", "tenantB": "KELMIRANDE"}

TOWNS = ("Lintwick", "Harrowmere", "Ostbridge", "Calderby", "Wenfold", "Marrowgate", "Tessaly", "Brackwater",
         "Ellinport", "Dunmoor", "Fayhollow", "Quenby")
THINGS = ("lighthouse", "granary", "clock tower", "bridge", "library", "mill", "observatory", "chapel")
PEOPLE = ("Ada Rennick", "Tomas Vell", "Irene Castow", "Piet Morrow", "Lena Aubert", "Oskar Hale", "Mira Sollen")
ITEMS = ("lanterns", "ledgers", "bells", "maps", "barrels", "telescopes")
MONTHS = ("March", "May", "July", "September", "November")


def make_passage(seed: int, tenant: str, n: int, kind: str) -> tuple[dict, list[str]]:
    """A synthetic passage holding its tenant's marker (text and title), and questions it answers."""
    rng = random.Random(f"{seed}-{tenant}-{kind}-{n}")
    m = MARKERS[tenant]
    town, town2 = rng.sample(TOWNS, 2)
    thing, person = rng.choice(THINGS), rng.choice(PEOPLE)
    year, height, count = rng.randrange(1620, 1950), rng.randrange(9, 80), rng.randrange(3, 400)
    text = (f"{m} {kind} note {n}. The {thing} of {town} was built in {year} by {person}, a mason from {town2}. "
            f"It is {height} metres tall and keeps {count} {rng.choice(ITEMS)} in its cellar. Every "
            f"{rng.choice(MONTHS)} the people of {town} hold a fair beside it. The road from {town2} to the {thing} "
            f"takes {rng.randrange(2, 30)} hours on foot. Archive code {m}-{kind}-{n}.")
    questions = [f"When was the {thing} of {town} built?", f"Who built the {thing} of {town}?",
                 f"How tall is the {thing} of {town}?"]
    return {"title": f"{town} {thing} ({m})", "text": text}, questions


def document_id(tenant: str, n: int) -> str:
    return f"{MARKERS[tenant].lower()}-doc-{n:03d}"


def make_probes(seed: int, modes: tuple[str, ...], inline_pool: int = 6) -> list[dict]:
    """The fixed probes: per tenant and mode, two inline-document pairs with a question about the first."""
    rng = random.Random(seed)
    probes = []
    for tenant in TENANTS:
        pool = [make_passage(seed, tenant, i, "inline") for i in range(inline_pool)]
        for mode in modes:
            for j in range(2):
                a, b = rng.sample(range(inline_pool), 2)
                probes.append({"id": f"{tenant}/{mode}/{j}", "tenant": tenant, "mode": mode,
                               "documents": [pool[a][0], pool[b][0]], "question": rng.choice(pool[a][1])})
    return probes
