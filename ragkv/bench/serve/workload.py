"""The workload (CacheBlend's "Musique extended"): a pool of real MuSiQue passages, seeded requests of a
question and k passages from it, the warm-up requests, and what ragkv is sent for each."""

from __future__ import annotations

import random

from ragkv.bench.serve.config import BenchRequest, ServeBenchConfig
from ragkv.errors import InvalidRequestError

POOL_PER_QUESTION = 2  # passages each MuSiQue example adds to the pool: 40 passages -> 20 questions
QUESTION_DOCS = 1  # passages of the question's own example among its k (the rest: anywhere in the pool)


def build_pool(pool_size: int, passage_words: int) -> tuple[list[dict], list[str], list[list[int]]]:
    """Pool passages (`POOL_PER_QUESTION` per MuSiQue example, first `passage_words` words, no duplicates), the
    questions of those examples, and for each question the indices of its own passages in the pool."""
    from ragkv.eval.datasets import load_dataset

    pool, questions, owned, seen = [], [], [], set()
    for ex in load_dataset("musique"):
        mine = []
        for p in ex.passages:
            text = " ".join(p.text.split()[:passage_words])
            if text in seen or len(pool) == pool_size or len(mine) == POOL_PER_QUESTION:
                continue
            seen.add(text)
            mine.append(len(pool))
            pool.append({"title": p.title, "text": text})
        if mine:
            questions.append(ex.question)
            owned.append(mine)
        if len(pool) == pool_size:
            return pool, questions, owned
    raise InvalidRequestError(f"MuSiQue holds only {len(pool)} distinct passages; lower --pool-size")


def draw_requests(pool: list[dict], questions: list[str], owned: list[list[int]], n: int, k: int,
                  seed: int) -> list[BenchRequest]:
    """n requests: a question, `QUESTION_DOCS` of its own passages and k - 1 others from the pool, shuffled."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = rng.randrange(len(questions))
        picked = rng.sample(owned[q], min(QUESTION_DOCS, k, len(owned[q])))
        rest = [i for i in range(len(pool)) if i not in picked]
        picked += rng.sample(rest, k - len(picked))
        rng.shuffle(picked)
        out.append(BenchRequest(questions[q], tuple(pool[i] for i in picked)))
    return out


def warmup_requests(pool: list[dict], questions: list[str], owned: list[list[int]]) -> list[BenchRequest]:
    """One request per pool passage, alone: caches its block (reuse, blend) or its chain after the prefix (prefix)."""
    owner = {i: q for q, idx in enumerate(owned) for i in idx}
    return [BenchRequest(questions[owner[i]], (p,)) for i, p in enumerate(pool)]


def system_prompt() -> str:
    """The system prompt ragkv uses for passages by default; both servers are sent it explicitly."""
    from ragkv.engine.request.segments import PromptFormat

    return PromptFormat().system


def ragkv_payload(req: BenchRequest, mode: str, system: str) -> tuple[list[dict], dict]:
    """ragkv: the question as the user message, the passages as blocks in the `ragkv.documents` extra; `mode` is a
    mode or a mode key with parameters (ragkv.eval.modes)."""
    from ragkv.eval.modes import request_fields

    return ([{"role": "system", "content": system}, {"role": "user", "content": req.question}],
            {"ragkv": {**request_fields(mode), "documents": list(req.documents)}})


def build_workload(cfg: ServeBenchConfig) -> dict:
    pool, questions, owned = build_pool(cfg.pool_size, cfg.passage_words)
    plans = [draw_requests(pool, questions, owned, cfg.requests_at(value) if kind == "concurrency" else cfg.requests,
                           cfg.passages_per_request, cfg.seed * 1000 + i)
             for i, (kind, value) in enumerate(cfg.levels())]  # fresh requests per level, the same for every system
    # The peer's warm-up request is none of the measured ones: llama.cpp reuses the longest common prefix with the
    # prompt it ran last, so warming up on the first measured request would make that one nearly free.
    peer_warmup = draw_requests(pool, questions, owned, 1, cfg.passages_per_request, cfg.seed * 1000 + 999)[0]
    return {"pool": pool, "questions": questions, "owned": owned, "plans": plans, "system": system_prompt(),
            "peer_warmup": peer_warmup}
