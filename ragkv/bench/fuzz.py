"""`ragkv bench fuzz`: property-based requests against `ragkv serve` (the target: no 5xx from any input). schemathesis
generates bodies, valid and not, from the server's own OpenAPI document (serve/openapi.py publishes each route's
request model); every answer must be a 2xx or a 4xx with an OpenAI-style error body, never a 5xx or a hang.
Large but valid token counts are made small so that a valid request answers in a moment (the point is the input,
not long generations). A server is started here (loopback) unless `url` names one."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import save_json

ROUTES = (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/tokenize", "POST"),
          ("/detokenize", "POST"), ("/v1/embeddings", "POST"), ("/v1/documents", "POST"))
CHEAP = {"max_tokens": 2, "max_completion_tokens": 2, "min_tokens": 0, "n": 2}


@dataclass(frozen=True)
class FuzzConfig:
    examples: int = 500    # per route (the suite's test runs 60)
    url: str | None = None
    model: str = "smollm2"
    seed: int | None = 0   # None: a new draw each run (the suite's run is the same every time)


def cheap(body):
    """Large but valid token counts made small; every other value, and every invalid one, goes as generated."""
    if isinstance(body, dict):
        for key, small in CHEAP.items():
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and small < v <= 1_000_000:
                body[key] = small
    return body


def fuzz(base: str, cfg: FuzzConfig, say=print, headers: dict | None = None, timeout_s: float = 120,
         deadline: float | None = None) -> dict:
    """Send `cfg.examples` generated requests to each route of the server at `base` (with `headers`, e.g. an API
    key); counts per status and the failures (a 5xx, a 4xx without an error body, or no answer: "timeout" is a
    hang, "connection" a dropped connection). A `deadline` (time.monotonic()) ends the round early: the rest of its
    draws are skipped, not sent."""
    try:
        import httpx
        import schemathesis
        from hypothesis import HealthCheck, given, seed, settings
    except ImportError as e:
        raise RuntimeError("`ragkv bench fuzz` needs schemathesis: pip install -e '.[test]'") from e

    # the schema read with the same headers (a server with keys wants one for every route)
    schema = schemathesis.openapi.from_dict(httpx.get(f"{base}/openapi.json", headers=headers or {}, timeout=timeout_s,
                                                      trust_env=False).raise_for_status().json())
    seen: dict[int, int] = {}
    bad: list = []
    t0 = time.perf_counter()
    with httpx.Client(base_url=base, timeout=timeout_s, trust_env=False) as client:
        for path, method in ROUTES:
            @settings(max_examples=cfg.examples, deadline=None, database=None, derandomize=cfg.seed is not None,
                      suppress_health_check=list(HealthCheck))
            @given(case=schema[path][method].as_strategy())
            def send(case):
                if deadline is not None and time.monotonic() > deadline:
                    return
                body = cheap(case.body)
                kw = {"json": body} if not isinstance(body, (bytes, str)) else {"content": body}
                try:
                    r = client.request(method, path, headers={"content-type": "application/json", **(headers or {})},
                                       **kw)
                except httpx.TransportError as e:  # no answer: a failure like a 5xx, and the run goes on
                    status = "timeout" if isinstance(e, httpx.TimeoutException) else "connection"
                    seen[status] = seen.get(status, 0) + 1
                    bad.append({"path": path, "body": str(body)[:4000], "status": status, "reply": repr(e)[:300]})
                    return
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
                    bad.append({"path": path, "body": str(body)[:4000], "status": r.status_code, "reply": r.text[:300]})

            if cfg.seed is not None:
                send = seed(cfg.seed)(send)
            send()
            say(f"[fuzz] {path}: {sum(seen.values())} requests so far, statuses {_sorted(seen)}")
    return {"requests": sum(seen.values()), "statuses": _sorted(seen), "failures": bad,
            "seconds": round(time.perf_counter() - t0, 1)}


def _sorted(seen: dict) -> dict:
    return dict(sorted(seen.items(), key=lambda kv: str(kv[0])))


def run_fuzz_bench(cfg: FuzzConfig, out_dir: Path, say=print) -> dict:
    if cfg.url:
        result = fuzz(cfg.url.rstrip("/"), cfg, say)
    else:
        from ragkv.bench.serve.servers import ServerProcess

        with ServerProcess(model=cfg.model, dtype="float32", store="memory:512MiB",
                           extra=("--timeout", "120", "--no-startup-profile", "--max-batch", "4")) as server:
            result = fuzz(f"http://127.0.0.1:{server.port}", cfg, say)
    result = {"config": asdict(cfg), **result}
    save_json(out_dir / "fuzz.json", result)
    (out_dir / "fuzz.md").write_text(f"| requests | statuses | 5xx or bodiless 4xx | seconds |\n|---|---|---|---|\n"
                                     f"| {result['requests']} | {result['statuses']} | {len(result['failures'])} | "
                                     f"{result['seconds']} |\n")
    return result


def main(argv=None) -> int:
    """One round in a process of its own (`python -m ragkv.bench.fuzz URL EXAMPLES DEADLINE_S TIMEOUT_S [KEY]`), its
    result as JSON on stdout: hypothesis is not thread-safe, and the soak's fuzzers run side by side."""
    import json
    import sys

    url, examples, seconds, timeout_s, *key = (argv if argv is not None else sys.argv[1:])
    headers = {"Authorization": f"Bearer {key[0]}"} if key else None
    deadline = time.monotonic() + float(seconds)
    result = fuzz(url, FuzzConfig(examples=int(examples), seed=None), say=lambda _: None, headers=headers,
                  timeout_s=float(timeout_s), deadline=deadline)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
