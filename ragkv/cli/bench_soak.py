"""`ragkv bench` for the server's robustness: soak (clients, faults, abuse), fuzz, shadow, fairness. Flags ->
each benchmark's config (ragkv.bench.*)."""


from __future__ import annotations

from pathlib import Path

from ragkv.cli.bench_replicas import (add_replica_soak_args, run_replica_soak_bench)
from ragkv.cli.common import MODEL_HELP, add_model_args, add_output_args, finish_bench, say
from ragkv.cli.config_args import add_config_args, config_from_args

def register(bsub) -> None:
    for add in (_add_fuzz, _add_shadow, _add_fairness, _add_soak):
        add(bsub)


def _add_fuzz(bsub) -> None:
    from ragkv.bench.fuzz import FuzzConfig

    fz = bsub.add_parser("fuzz", help="property-based requests from the server's own OpenAPI document "
                                      "(schemathesis): counts per status, every 5xx listed")
    add_config_args(fz, FuzzConfig, skip=("seed",), help={
        "examples": "generated requests per route", "url": "a running server (default: start one here)",
        "model": MODEL_HELP})
    fz.add_argument("--new-draw", action="store_true", help="a new random draw (default: seeded, repeatable)")
    add_output_args(fz)
    fz.set_defaults(func=run_fuzz)


def _add_shadow(bsub) -> None:
    from ragkv.bench.shadow_cost import ShadowBenchConfig

    sv = bsub.add_parser("shadow", help="what shadow verification costs live traffic: TTFT and req/s under load with "
                                        "--shadow-fraction F against 0, servers started here in alternating order")
    add_config_args(sv, ShadowBenchConfig, help={
        "model": MODEL_HELP, "dtype": "the servers' dtype", "mode": "the requests' mode (approximate: checked)",
        "fraction": "the checked server's --shadow-fraction", "concurrency": "closed-loop clients",
        "requests": "requests per run", "rounds": "rounds of (without, with), the order flipped each round",
        "max_tokens": "answer length limit (greedy)", "seed": "seeds the workload"})
    add_output_args(sv)
    sv.set_defaults(func=run_shadow)


def _add_fairness(bsub) -> None:
    from ragkv.bench.fairness import FairnessConfig

    fa = bsub.add_parser("fairness", help="another tenant's TTFT while one tenant's long request (ape over many "
                                          "documents) runs, against a `ragkv serve` started here")
    add_config_args(fa, FairnessConfig, skip=("server_args",), flags={"gap_s": "gap"}, help={
        "model": MODEL_HELP, "dtype": "the server's dtype", "mode": "the long request's mode",
        "docs": "documents of the long request", "words": "words per document (about one token each)",
        "small_before": "the other tenant's requests alone, before the long one",
        "gap_s": "seconds between two of the other tenant's requests"})
    fa.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the started server, repeatable")
    add_output_args(fa)
    fa.set_defaults(func=run_fairness)


# `bench soak`'s flags by group (each a SoakConfig field; the others keep their defaults), and the flags whose
# name leaves out the field's unit
SOAK_LOAD = ("clients", "minutes", "calm_s", "fault_interval_s", "seed", "modes", "max_tokens", "memory", "disk_size",
             "request_timeout_s", "max_requests", "work_dir", "max_batch", "kv_memory")
SOAK_ABUSE = ("abuse_only", "abuse_clients", "abuse_streams", "abuse_n", "abuse_max_tokens", "abuse_read_events",
              "abuse_salts", "abuse_long_words", "abuse_word_chars", "abuse_documents", "abuse_contracts",
              "abuse_max_s", "rss_slack", "rss_return_pct", "rss_return_s")
SOAK_HOSTILE = ("fuzz_clients", "fuzz_examples", "long_ape_every_s", "long_ape_documents", "long_ape_words")
SOAK_FLAG_NAMES = {"calm_s": "calm", "fault_interval_s": "fault_interval", "request_timeout_s": "request_timeout",
                   "abuse_max_s": "abuse_seconds", "long_ape_every_s": "long_ape_every"}
SOAK_HELP = {
    "clients": "concurrent client threads", "minutes": "minutes of load with faults (after --calm)",
    "calm_s": "seconds of load without faults first", "fault_interval_s": "mean seconds between two faults",
    "seed": "seeds the workload, the clients and the fault injector", "modes": "modes the clients use",
    "max_tokens": "answer length limit (greedy)",
    "memory": "memory tier of the server's store (small: blocks fall through to disk and Redis)",
    "disk_size": "disk tier capacity", "request_timeout_s": "client-side seconds per request",
    "max_requests": "requests of all clients together, at most",
    "work_dir": "server cache folder, Redis folder and logs (default: OUTPUT_DIR/soak-work; cleared at the start, its "
                "KV files removed at the end)",
    "max_batch": "the server's --max-batch", "kv_memory": "the server's --kv-memory (`default`: not passed)",
    "abuse_only": "set up, then run the abuse phase only", "abuse_clients": "concurrent abusive clients",
    "abuse_streams": "streams closed after a few events", "abuse_n": "choices per abandoned stream",
    "abuse_max_tokens": "max_tokens of an abandoned stream", "abuse_read_events": "events read before closing",
    "abuse_salts": "requests with a cache_salt of their own",
    "abuse_long_words": "requests whose document is one long word", "abuse_word_chars": "letters of that word",
    "abuse_documents": "requests with the most inline documents the server accepts (every other one: one more)",
    "abuse_contracts": "requests of each kind whose reply has a contract (a forced call, a constrained answer, "
                       "refused schemas and tool messages); a broken one is counted",
    "abuse_max_s": "the phase stops sending after this long (seconds)",
    "rss_slack": "RSS may rise by memory tier + KV limit + this",
    "rss_return_pct": "RSS must come back within this %% of its pre-phase level ...",
    "rss_return_s": "... within this many seconds",
    "fuzz_clients": "threads fuzzing the API from its OpenAPI schema",
    "fuzz_examples": "generated requests per route and round",
    "long_ape_every_s": "seconds between two long `ape` requests",
    "long_ape_documents": "documents of a long `ape` request",
    "long_ape_words": "words per document (random letters, ~3.6 tokens a word: 8 x 1000 is ~29K tokens)"}


def _add_soak(bsub) -> None:
    from ragkv.bench.soak.config import SoakConfig

    k = bsub.add_parser("soak", help="N clients for M minutes against `ragkv serve` (two tenants, memory+disk+Redis "
                                     "store) while faults are injected: crashes, 5xx, lost documents, cross-tenant "
                                     "reads, changed greedy answers")
    add_config_args(k, SoakConfig, only=SOAK_LOAD, flags=SOAK_FLAG_NAMES, help=SOAK_HELP)
    ab = k.add_argument_group("abuse phase (after the faults; RSS watched; all counts 0: none)")
    add_config_args(ab, SoakConfig, only=SOAK_ABUSE, flags=SOAK_FLAG_NAMES, help=SOAK_HELP)
    ho = k.add_argument_group("hostile traffic during the faults (0: none)")
    add_config_args(ho, SoakConfig, only=SOAK_HOSTILE, flags=SOAK_FLAG_NAMES, help=SOAK_HELP)
    add_output_args(k)
    add_model_args(k, decode_weights=False)
    add_replica_soak_args(k)
    k.set_defaults(func=run_soak)


def run_fuzz(args) -> int:
    from ragkv.bench.fuzz import FuzzConfig, run_fuzz_bench

    cfg = config_from_args(FuzzConfig, args, seed=None if args.new_draw else 0)
    result = run_fuzz_bench(cfg, Path(args.output_dir), say)
    finish_bench(args, result, "fuzz.md")
    return 1 if result["failures"] else 0


def run_shadow(args) -> int:
    from ragkv.bench.shadow_cost import ShadowBenchConfig, run_shadow_bench

    cfg = config_from_args(ShadowBenchConfig, args)
    return finish_bench(args, run_shadow_bench(cfg, Path(args.output_dir), say), "shadow_bench.md")


def run_fairness(args) -> int:
    from ragkv.bench.fairness import FairnessConfig, run_fairness_bench

    cfg = config_from_args(FairnessConfig, args, server_args=tuple(args.server_arg))
    return finish_bench(args, run_fairness_bench(cfg, Path(args.output_dir), say), "fairness.md")


def soak_config(args):
    """SoakConfig from `bench soak`'s flags: the flagged fields from them, the model's from the model flags."""
    from dataclasses import fields

    from ragkv.bench.soak.config import SoakConfig

    flagged = SOAK_LOAD + SOAK_ABUSE + SOAK_HOSTILE
    return config_from_args(SoakConfig, args, skip=tuple(f.name for f in fields(SoakConfig) if f.name not in flagged),
                            flags=SOAK_FLAG_NAMES, model=args.model, dtype=args.dtype, device=args.device,
                            kv_memory=None if args.kv_memory == "default" else args.kv_memory)


def run_soak(args) -> int:
    if args.replicas > 1:
        return run_replica_soak_bench(args)
    from ragkv.bench.soak import run_soak as run_soak_bench

    return finish_bench(args, run_soak_bench(soak_config(args), Path(args.output_dir), say), "soak.md")
