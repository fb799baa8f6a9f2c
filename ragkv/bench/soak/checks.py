"""What the soak counts (pure): another tenant's marker in a response, the ledger of acknowledged documents,
probe answers against their fault-free baseline, the server's fault counters and the request figures."""

from __future__ import annotations

import re
import threading

from ragkv.bench.serve.clients import percentile
from ragkv.bench.soak.workload import MARKERS


def leaked_marker(tenant: str, text: str) -> str | None:
    """Another tenant's marker found in `text` (a response or a listing of `tenant`), or None."""
    low = text.lower()
    return next((m for t, m in MARKERS.items() if t != tenant and m.lower() in low), None)


class DocLedger:
    """Every document the injector added and deleted, per tenant: acknowledged (200) and not deleted since means
    it must be listed. A call without a clear answer (5xx, timeout) makes the document uncertain (not counted)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.state: dict[tuple[str, str], str] = {}  # (tenant, id) -> acked | deleted | uncertain | failed
        self.notes: list[str] = []

    def added(self, tenant: str, doc_id: str, status) -> None:
        with self.lock:
            self.state[(tenant, doc_id)] = "acked" if status == 200 else (
                "uncertain" if not isinstance(status, int) or status >= 500 else "failed")

    def deleted(self, tenant: str, doc_id: str, status) -> None:
        with self.lock:
            if status == 200:
                self.state[(tenant, doc_id)] = "deleted"
            elif status == 404:  # stays acked: the end check counts it lost unless it is listed again
                self.notes.append(f"DELETE of acknowledged {tenant}/{doc_id} answered 404")
            else:
                self.state[(tenant, doc_id)] = "uncertain"

    def live(self, tenant: str) -> list[str]:
        with self.lock:
            return sorted(d for (t, d), s in self.state.items() if t == tenant and s == "acked")

    def check(self, listed: dict[str, set[str]]) -> dict:
        """lost: acknowledged, not deleted, not listed; resurrected: deleted with 200 but listed."""
        with self.lock:
            lost = sorted(f"{t}/{d}" for (t, d), s in self.state.items() if s == "acked" and d not in listed[t])
            back = sorted(f"{t}/{d}" for (t, d), s in self.state.items() if s == "deleted" and d in listed[t])
            counts = {s: sum(v == s for v in self.state.values()) for s in ("acked", "deleted", "uncertain",
                                                                             "failed")}
        return {"lost": lost, "resurrected": back, "ledger": counts}


def compare_probes(baseline: dict[str, str | None], answers: list[dict]) -> dict:
    """Per phase: probes re-sent and how many answers differ from their baseline (probes without a baseline answer
    are left out); the first differences."""
    baseline = {k: v for k, v in baseline.items() if v is not None}
    phases: dict[str, dict] = {}
    examples = []
    for a in answers:
        if a["probe"] not in baseline or a.get("text") is None:
            continue
        p = phases.setdefault(a["phase"], {"sent": 0, "differ": 0})
        p["sent"] += 1
        if a["text"] != baseline[a["probe"]]:
            p["differ"] += 1
            if len(examples) < 12:
                examples.append({"probe": a["probe"], "phase": a["phase"], "baseline": baseline[a["probe"]],
                                 "got": a["text"], "store_fault": a.get("store_fault"),
                                 "uncached_blocks": a.get("uncached_blocks"), "cache_misses": a.get("cache_misses")})
    return {"phases": phases, "examples": examples}


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict:
    """The fault counters and the requests by status from the server's Prometheus text."""
    out = {"tier_faults": {}, "fault_requests": None, "uncached_blocks": None, "requests_by_status": {}}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if name == "ragkv_store_tier_faults_total":
            out["tier_faults"][labels.get("tier", "?")] = int(value)
        elif name == "ragkv_store_fault_requests_total":
            out["fault_requests"] = int(value)
        elif name == "ragkv_uncached_blocks_total":
            out["uncached_blocks"] = int(value)
        elif name == "ragkv_requests_total":
            key = str(labels.get("status"))
            out["requests_by_status"][key] = out["requests_by_status"].get(key, 0) + int(value)
    return out


CHAT_KINDS = ("inline", "retrieval", "probe")


def summarize_requests(records: list[dict], walls: dict[str, float]) -> dict:
    """Status counts over every request (chat and documents); per phase the chat requests' latency, and in the
    load phases (`walls`: phase -> seconds) their throughput."""
    five = [r for r in records if isinstance(r["status"], int) and r["status"] >= 500]
    other: dict[str, int] = {}
    transport: dict[str, int] = {}
    for r in records:
        s = r["status"]
        if isinstance(s, int) and not 200 <= s < 300 and s < 500:
            if not _refused_abuse(r):
                other[str(s)] = other.get(str(s), 0) + 1
        elif not isinstance(s, int):
            transport[s] = transport.get(s, 0) + 1
    phases = {}
    for phase in dict.fromkeys([*walls, *(r["phase"] for r in records if r["kind"] in CHAT_KINDS)]):
        chat = [r for r in records if r["phase"] == phase and r["kind"] in CHAT_KINDS]
        ok = [r["latency_s"] for r in chat if r["status"] == 200 and not r.get("stream_error")]
        wall = walls.get(phase)  # the load phases; the others are quiet probes, one at a time
        phases[phase] = {"chat_requests": len(chat), "ok": len(ok), "wall_s": None if wall is None else round(wall, 1),
                         "requests_per_s": round(len(ok) / wall, 3) if wall else None,
                         "latency_p50_ms": _ms(percentile(ok, 50)), "latency_p99_ms": _ms(percentile(ok, 99))}
    errors = sorted({f"{r['status']} {r['kind']}: {r.get('error') or ''}"[:300] for r in records
                     if (r["status"] != 200 and not _refused_abuse(r)) or r.get("stream_error")})
    chat = [r for r in records if r["kind"] in CHAT_KINDS and r["status"] == 200]
    return {"requests": len(records), "http_5xx": len(five), "other_non_2xx": other, "transport_errors": transport,
            "stream_errors": sum(bool(r.get("stream_error")) for r in records), "error_samples": errors[:15],
            "client_store_fault_answers": sum(bool(r.get("store_fault")) for r in chat),
            "client_uncached_blocks": sum(r.get("uncached_blocks") or 0 for r in chat), "phases": phases}


def _refused_abuse(r: dict) -> bool:
    """A 4xx or 429 answering the abuse phase: a right answer (counted apart, in the phase's own figures)."""
    return r["kind"].startswith("abuse") and isinstance(r["status"], int) and 400 <= r["status"] < 500


def _ms(x):
    return None if x is None else round(1000 * x, 1)
