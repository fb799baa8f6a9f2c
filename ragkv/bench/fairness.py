"""`ragkv bench fairness`: another tenant's latency beside one tenant's long request (issue: one `ape` request over
~32K tokens held the only model worker for minutes while another tenant's "hi" timed out).

A `ragkv serve` started here with two tenants' keys; tenant A sends one long request (`docs` documents of `words`
words, in `mode`, streamed), and while it runs tenant B sends small streamed requests one after another ("hi",
`max_tokens` 1), each B's TTFT measured client-side. Reported: B's TTFT p50 / p95 / max while A's request was in
flight, B's TTFT alone before it, A's TTFT and end-to-end latency, and whether it completed."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import save_json
from ragkv.bench.serve.clients import percentile
from ragkv.bench.serve.servers import ServerProcess

KEY_A, KEY_B = "bench-fairness-key-a", "bench-fairness-key-b"
# ordinary English words (about one token each), cycled: documents a retriever might return
WORDS = ("the river city council voted to build a new bridge after years of debate about traffic and cost while "
         "local farmers asked for better roads to the market in spring when the old road floods").split()


@dataclass(frozen=True)
class FairnessConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    mode: str = "ape"          # the long request's mode (`ape` takes documents longer than the window)
    docs: int = 8
    words: int = 1500          # per document
    small_before: int = 3      # B's requests alone, before A's
    gap_s: float = 0.25        # between two of B's requests
    server_args: tuple[str, ...] = ()


def _stream(base: str, key: str, body: dict) -> dict:
    import httpx

    t0, ttft = time.perf_counter(), None
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=900,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "error": r.read().decode()[:300]}
            for line in r.iter_lines():
                if ttft is None and '"content": "' in line and '"content": ""' not in line:
                    ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"status": None, "error": f"{type(e).__name__}: {e}"}
    return {"status": 200, "ttft_s": ttft, "latency_s": time.perf_counter() - t0}


def _long_body(cfg: FairnessConfig) -> dict:
    docs = [{"title": f"doc {d}", "text": " ".join(WORDS[(d + i) % len(WORDS)] for i in range(cfg.words))}
            for d in range(cfg.docs)]
    return {"model": cfg.model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What did the council vote for?"}],
            "ragkv": {"mode": cfg.mode, "documents": docs}}


def run_fairness_bench(cfg: FairnessConfig, out_dir: Path, say=print) -> dict:
    small = {"model": cfg.model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    extra = ("--api-key", f"{KEY_A}:tenantA", "--api-key", f"{KEY_B}:tenantB", "--timeout", "900",
             "--no-startup-profile", *cfg.server_args)
    with ServerProcess(model=cfg.model, dtype=cfg.dtype, store="memory:2GiB", extra=extra) as server:
        base = f"http://127.0.0.1:{server.port}"
        alone = [_stream(base, KEY_B, small) for _ in range(cfg.small_before)]
        say(f"[fairness] B alone: TTFT {[round(r.get('ttft_s') or -1, 3) for r in alone]} s")
        a_result: dict = {}
        a = threading.Thread(target=lambda: a_result.update(_stream(base, KEY_A, _long_body(cfg))))
        t_a = time.perf_counter()
        a.start()
        time.sleep(0.5)  # A's request is parsed and prefilling
        during = []
        while a.is_alive():
            during.append(_stream(base, KEY_B, small))
            time.sleep(cfg.gap_s)
        a.join()
        a_total = time.perf_counter() - t_a
    ok = [r["ttft_s"] for r in during if r.get("status") == 200 and r.get("ttft_s") is not None]
    ok_alone = [r["ttft_s"] for r in alone if r.get("ttft_s") is not None]
    result = {"config": asdict(cfg),
              "b_alone_ttft_p50_s": round(percentile(ok_alone, 50), 3) if ok_alone else None,
              "b_during_requests": len(during), "b_during_ok": len(ok),
              "b_during_ttft_p50_s": round(percentile(ok, 50), 3) if ok else None,
              "b_during_ttft_p95_s": round(percentile(ok, 95), 3) if ok else None,
              "b_during_ttft_max_s": round(max(ok), 3) if ok else None,
              "b_failures": [r for r in during if r.get("status") != 200][:5],
              "a": {**a_result, "wall_s": round(a_total, 3)}}
    save_json(out_dir / "fairness.json", result)
    (out_dir / "fairness.md").write_text(
        "| B alone TTFT p50 s | B during A: requests | ok | TTFT p50 s | p95 s | max s | A status | A TTFT s | "
        "A latency s |\n|---|---|---|---|---|---|---|---|---|\n"
        f"| {result['b_alone_ttft_p50_s']} | {len(during)} | {len(ok)} | {result['b_during_ttft_p50_s']} | "
        f"{result['b_during_ttft_p95_s']} | {result['b_during_ttft_max_s']} | {a_result.get('status')} | "
        f"{None if a_result.get('ttft_s') is None else round(a_result['ttft_s'], 2)} | "
        f"{None if a_result.get('latency_s') is None else round(a_result['latency_s'], 2)} |\n")
    return result
