"""`ragkv bench soak --replicas N`: replicas killed under load (the replicas' soak), on 127.0.0.1 only.

`ragkv serve --replicas N` (a local Ray) takes chat requests from C closed-loop clients (passage sets drawn from a
pool, half of them streamed, long enough answers that some are in flight at any time) and documents from a
writer that keeps a ledger of every document acknowledged with 200. At evenly spaced moments one EngineReplica
process (a descendant of the server under test, never anything else) is killed with SIGKILL; Ray Serve starts
another.

Counted: requests answered whole; requests that failed, each classified as in flight at a kill (started before it,
ended after) or not; acknowledged documents missing from the listing at the end. Targets: 0 failures that were not
in flight at a kill, 0 lost documents; the failures in flight are the killed replica's (the survivor's answers in
flight at the same moment complete)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.serve.servers import ServerProcess


@dataclass(frozen=True)
class ReplicaSoakConfig:
    replicas: int = 2
    clients: int = 3
    minutes: float = 3.0
    kills: int = 2
    max_tokens: int = 48
    sets: int = 12
    model: str = "smollm2"
    dtype: str = "float32"
    memory: str = "memory:512MiB"
    seed: int = 0
    request_timeout_s: float = 180.0


def descendants_named(root: int, marker: str) -> list[int]:
    """Pids of processes under `root` whose command line holds `marker`."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue

    def under(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == root:
                return True
            if pid <= 1:
                return False
        return False
    found = []
    for pid in parents:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and under(pid):
            found.append(pid)
    return found


def chat_once(url: str, body: dict, stream: bool, timeout_s: float) -> dict:
    """One request: ok, or how it failed (status, error event, transport error); its replica and times."""
    import httpx

    t0 = time.time()
    out = {"start": t0, "stream": stream, "replica": None}
    try:
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=timeout_s) as r:
                out["replica"], out["status"] = r.headers.get("x-ragkv-replica"), r.status_code
                finish = None
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            out["error"] = event["error"].get("code") or "error event"
                        elif event.get("choices"):
                            finish = event["choices"][0].get("finish_reason") or finish
                if r.status_code == 200 and finish is None and "error" not in out:
                    out["error"] = "stream ended without a finish"
        else:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout_s)
            out["replica"], out["status"] = r.headers.get("x-ragkv-replica"), r.status_code
        if out["status"] != 200:
            out["error"] = f"HTTP {out['status']}"
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__
    out["end"] = time.time()
    return out


def run_replica_soak(cfg: ReplicaSoakConfig, out_dir: Path, say) -> dict:
    import httpx

    from ragkv.bench.serve.workload import build_pool, draw_requests

    pool, questions, owned = build_pool(40, 120)
    sets = draw_requests(pool, questions, owned, cfg.sets, 3, cfg.seed)
    stop_at = time.time() + 60 * cfg.minutes + 3600  # replaced once the server is up
    results, ledger, kills, lock = [], [], [], threading.Lock()
    extra = ("--replicas", str(cfg.replicas), "--replica-threads", "1", "--no-startup-profile",
             "--timeout", str(int(cfg.request_timeout_s)))
    with ServerProcess(cfg.model, cfg.dtype, "cpu", cfg.memory, startup_s=600, extra=extra) as server:
        url = server.url
        stop_at = time.time() + 60 * cfg.minutes

        def client(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            while time.time() < stop_at:
                s = sets[rng.randrange(len(sets))]
                docs = list(s.documents)
                rng.shuffle(docs)
                body = {"model": cfg.model, "max_tokens": cfg.max_tokens, "min_tokens": cfg.max_tokens // 2,
                        "temperature": 0, "messages": [{"role": "user", "content": s.question}], "documents": docs}
                r = chat_once(url, body, stream=rng.random() < 0.5, timeout_s=cfg.request_timeout_s)
                with lock:
                    results.append(r)

        def writer() -> None:
            n = 0
            while time.time() < stop_at:
                doc = {"id": f"soak-doc-{n}", "text": f"Soak document {n}: gauge {n} reads {n * 7 % 13} bars."}
                try:
                    r = httpx.post(url + "/v1/documents", json={"documents": [doc]}, timeout=cfg.request_timeout_s)
                    if r.status_code == 200:
                        with lock:
                            ledger.append(doc["id"])
                except httpx.HTTPError:
                    pass  # not acknowledged: not in the ledger
                n += 1
                time.sleep(2)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(cfg.clients)]
        threads.append(threading.Thread(target=writer, daemon=True))
        for t in threads:
            t.start()
        span = 60 * cfg.minutes
        for k in range(cfg.kills):
            time.sleep(max(0.0, stop_at - span + span * (k + 1) / (cfg.kills + 1) - time.time()))
            pids = descendants_named(server.proc.pid, "ServeReplica:ragkv:EngineReplica")
            if pids:
                victim = pids[k % len(pids)]
                os.kill(victim, signal.SIGKILL)
                kills.append({"time": time.time(), "pid": victim})
                say(f"[replica soak] killed replica pid {victim} ({len(results)} requests so far)")
        for t in threads:
            t.join(timeout=cfg.request_timeout_s + 60)
        listed = httpx.get(url + "/v1/documents", timeout=120).json().get("data", [])
        replicas_at_end = len(descendants_named(server.proc.pid, "ServeReplica:ragkv:EngineReplica"))
    result = summarize(cfg, results, kills, ledger, {d["doc_id"] for d in listed}, replicas_at_end)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "replica_soak.json").write_text(json.dumps(result, indent=2))
    return result


def summarize(cfg: ReplicaSoakConfig, results: list[dict], kills: list[dict], ledger: list[str],
              listed: set[str], replicas_at_end: int) -> dict:
    failed = [r for r in results if "error" in r]
    in_flight = [r for r in failed if any(r["start"] <= k["time"] <= r["end"] for k in kills)]
    survivors = [r for r in results if "error" not in r and any(r["start"] <= k["time"] <= r["end"] for k in kills)]
    lost = sorted(set(ledger) - listed)
    return {"config": asdict(cfg), "requests": len(results), "answered": len(results) - len(failed),
            "kills": len(kills), "failed_in_flight_at_a_kill": len(in_flight),
            "failed_otherwise": len(failed) - len(in_flight),
            "answered_though_in_flight_at_a_kill": len(survivors),
            "failure_kinds": sorted({str(r["error"]) for r in failed}),
            "failed_replicas": sorted({str(r["replica"]) for r in in_flight}),
            "acknowledged_documents": len(ledger), "lost_documents": len(lost), "lost_sample": lost[:5],
            "replicas_at_end": replicas_at_end}


def render(result: dict) -> str:
    c = result["config"]
    return "\n".join([
        f"# Replica soak ({c['model']}, {c['dtype']}, {c['replicas']} replicas of 1 thread)", "",
        f"{c['clients']} clients for {c['minutes']} min, {result['kills']} replica(s) killed with SIGKILL, a writer "
        "adding a document every 2 s.", "",
        "| requests | answered | failed in flight at a kill | failed otherwise | in flight at a kill, answered | "
        "documents acknowledged | lost | replicas at the end |", "|---|---|---|---|---|---|---|---|",
        f"| {result['requests']} | {result['answered']} | {result['failed_in_flight_at_a_kill']} | "
        f"{result['failed_otherwise']} | {result['answered_though_in_flight_at_a_kill']} | "
        f"{result['acknowledged_documents']} | {result['lost_documents']} | {result['replicas_at_end']} |", "",
        f"Failure kinds: {', '.join(result['failure_kinds']) or 'none'}", ""])
