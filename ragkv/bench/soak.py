"""`ragkv bench soak`: N clients for M minutes against a real `ragkv serve` while faults are injected (issue 12).

The benchmark starts everything itself, on 127.0.0.1 only: a private redis-server on a free port, and `ragkv serve`
with two tenants' API keys over the store `memory,disk,redis`. Clients send greedy chat requests (modes reuse,
blend, full; inline documents or retrieval; streamed or not) in both tenants. After a fault-free calm period, a
seeded injector, at random intervals, flips bytes in and truncates the disk tier's `*.kv` files, kills Redis and
restarts it on the same port (empty), and adds and deletes documents in both tenants, keeping a ledger of every
document acknowledged with 200 and not deleted since.

Counted (target: all zero): server crashes, 5xx, other non-2xx, errors inside 200 streams, acknowledged documents
missing from their tenant's listing at the end and after a restart on the same cache folder, cross-tenant reads
(another tenant's marker string in a response or a listing), and answers of fixed inline-document probes that
differ from their fault-free greedy answer. Also: requests/s, latency percentiles and the server's fault counters.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.serve import ServerProcess, percentile
from ragkv.errors import InvalidRequestError
from ragkv.net import free_port
from ragkv.store.redis_server import INSTALL_HINT, RedisStartError

TENANTS = ("tenantA", "tenantB")
# A string only each tenant's documents (text, title, id) hold; seen in another tenant's response = a leak.
MARKERS = {"tenantA": "ZORVATHIUM", "tenantB": "KELMIRANDE"}
FAULT_KINDS = ("disk", "redis", "documents")
WORK_MARK = ".ragkv-soak"  # a work folder holding this file is ours to clear

TOWNS = ("Lintwick", "Harrowmere", "Ostbridge", "Calderby", "Wenfold", "Marrowgate", "Tessaly", "Brackwater",
         "Ellinport", "Dunmoor", "Fayhollow", "Quenby")
THINGS = ("lighthouse", "granary", "clock tower", "bridge", "library", "mill", "observatory", "chapel")
PEOPLE = ("Ada Rennick", "Tomas Vell", "Irene Castow", "Piet Morrow", "Lena Aubert", "Oskar Hale", "Mira Sollen")
ITEMS = ("lanterns", "ledgers", "bells", "maps", "barrels", "telescopes")
MONTHS = ("March", "May", "July", "September", "November")


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 4
    minutes: float = 3.0               # of faults, after the calm period
    seed: int = 0
    fault_interval_s: float = 10.0     # mean seconds between two faults (each drawn uniformly in [0.5x, 1.5x])
    redis_down_s: tuple[float, float] = (2.0, 15.0)  # a killed Redis comes back after this long (uniform); other
                                                     # faults and the traffic go on meanwhile
    calm_s: float = 20.0               # load without faults first: the probes' noise floor under batching
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    modes: tuple[str, ...] = ("reuse", "blend", "full")
    max_tokens: int = 16
    probe_fraction: float = 0.25       # of client requests that re-send a probe
    retrieval_fraction: float = 0.35   # of the other client requests that retrieve instead of inline documents
    stream_fraction: float = 0.25
    top_k: int = 3
    initial_documents: int = 3         # per tenant, before the clients start
    memory: str = "48MiB"              # small: blocks fall through to the disk and Redis tiers
    disk_size: str = "512MiB"
    redis_maxmemory: str = "256mb"
    request_timeout_s: float = 180.0   # client side, per request
    startup_s: float = 300.0
    max_requests: int = 20_000         # all clients together
    max_server_restarts: int = 2       # after crashes; then the soak ends early
    work_dir: str | None = None        # default: OUTPUT_DIR/soak-work (logs and index kept, KV files removed)

    def __post_init__(self):
        from ragkv.engine.options import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
        if self.clients < 1 or self.max_tokens < 1 or self.max_requests < 1 or self.initial_documents < 1:
            raise InvalidRequestError("--clients, --max-tokens, --max-requests and --initial-documents must be >= 1")
        if not (self.minutes > 0 and self.fault_interval_s > 0 and self.calm_s >= 0 and self.request_timeout_s > 0):
            raise InvalidRequestError("--minutes, --fault-interval and --request-timeout must be > 0, --calm >= 0")
        if not 0 <= self.redis_down_s[0] <= self.redis_down_s[1]:
            raise InvalidRequestError(f"redis_down_s must be (min, max) with 0 <= min <= max, got {self.redis_down_s}")
        for name in ("probe_fraction", "retrieval_fraction", "stream_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be in [0, 1]")


# -- workload (pure, seeded) ----------------------------------------------------------------------------------
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


# -- what is counted (pure) -----------------------------------------------------------------------------------
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
                     if r["status"] != 200 or r.get("stream_error")})
    chat = [r for r in records if r["kind"] in CHAT_KINDS and r["status"] == 200]
    return {"requests": len(records), "http_5xx": len(five), "other_non_2xx": other, "transport_errors": transport,
            "stream_errors": sum(bool(r.get("stream_error")) for r in records), "error_samples": errors[:15],
            "client_store_fault_answers": sum(bool(r.get("store_fault")) for r in chat),
            "client_uncached_blocks": sum(r.get("uncached_blocks") or 0 for r in chat), "phases": phases}


def _ms(x):
    return None if x is None else round(1000 * x, 1)


# -- processes ------------------------------------------------------------------------------------------------
class _Restartable:
    """A process the soak restarts (`start`, `stop`), as a context manager: started on entry; once exited, no late
    restart may start it again (`closed`, under `lock`)."""

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.closed = True
        self.stop()


class RedisProcess(_Restartable):
    """redis-server on one free 127.0.0.1 port that can be killed and started again on it (no persistence: it
    comes back empty); a context manager that stops it, like `private_redis`."""

    def __init__(self, workdir: Path, maxmemory: str = "256mb", timeout_s: float = 10.0):
        self.workdir, self.maxmemory, self.timeout_s = Path(workdir).resolve(), maxmemory, timeout_s
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.lock, self.closed = threading.Lock(), False  # no start after the exit (a restart thread may be late)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisStartError(f"redis-server is not installed; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        with self.lock:
            if self.closed:
                raise RedisStartError("the soak is over; Redis stays stopped")
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                 str(self.workdir), "--logfile", str(log), "--daemonize", "no", "--maxmemory", self.maxmemory,
                 "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        text = log.read_text()[-2000:] if log.exists() else ""
                        raise RedisStartError(f"redis-server did not start on port {self.port}: {text}") from None
                    time.sleep(0.02)
        finally:
            client.close()
        self.starts += 1

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict:
        """Keys held and hits/misses so far (since this start): whether the server uses the tier at all."""
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=2, socket_timeout=5)
        try:
            info = client.info()
            return {"keys": client.dbsize(), "hits": info.get("keyspace_hits"), "misses": info.get("keyspace_misses"),
                    "used_mb": round(info.get("used_memory", 0) / 2**20, 1)}
        except (redis.exceptions.RedisError, OSError) as e:
            return {"error": str(e)}
        finally:
            client.close()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ServerSupervisor(_Restartable):
    """The `ragkv serve` under test, restartable on its cache folder (a new port each start); a context manager
    that stops whichever one runs."""

    def __init__(self, cfg: SoakConfig, cache_dir: Path, store: str, keys: dict[str, str]):
        self.cfg, self.cache_dir, self.store = cfg, cache_dir, store
        self.extra = tuple(a for t, k in keys.items() for a in ("--api-key", f"{k}:{t}"))
        self.server: ServerProcess | None = None
        self.url = ""  # the last started server's, kept while a restart is under way
        self.logs: list[str] = []
        self.lock, self.closed = threading.Lock(), False  # no server outlives the exit (a restart may be late)

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def start(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        s = ServerProcess(self.cfg.model, self.cfg.dtype, self.cfg.device, self.store, self.cfg.startup_s,
                          self.cache_dir, self.extra)
        s.__enter__()
        with self.lock:
            if not self.closed:
                self.server, self.url = s, s.url
                self.logs.append(str(s.log_path))
                return
        s.__exit__(None, None, None)
        raise RuntimeError("the soak is over; the server stays stopped")

    def stop(self) -> dict:
        """SIGTERM (SIGKILL after 30 s); its exit code and how long it took."""
        if self.server is None:
            return {}
        t0 = time.monotonic()
        self.server.__exit__(None, None, None)
        out = {"exit_code": self.server.proc.returncode, "stop_s": round(time.monotonic() - t0, 2)}
        self.server = None
        return out

    def log_tail(self, chars: int = 3000) -> str:
        if not self.logs:
            return ""
        return Path(self.logs[-1]).read_text(errors="replace")[-chars:]



# -- faults ---------------------------------------------------------------------------------------------------
def corrupt_disk(disk_dir: Path, rng: random.Random, files: int = 3, flips: int = 8) -> dict:
    """Flip `flips` random bytes in each of up to `files` random `*.kv` files; truncate one more."""
    paths = sorted(Path(disk_dir).rglob("*.kv"))
    chosen = rng.sample(paths, min(files + 1, len(paths)))
    out = {"kv_files": len(paths), "flipped": [], "truncated": None}
    for i, p in enumerate(chosen):
        try:
            size = p.stat().st_size
            if size == 0:
                continue
            if i == len(chosen) - 1 and len(chosen) > 1:
                keep = rng.randrange(size)
                with open(p, "r+b") as f:
                    f.truncate(keep)
                out["truncated"] = f"{p.name} {size} -> {keep} bytes"
                continue
            with open(p, "r+b") as f:
                for off in sorted(rng.randrange(size) for _ in range(flips)):
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0xFF]))
            out["flipped"].append(p.name)
        except OSError as e:  # replaced or evicted meanwhile: part of the game
            out.setdefault("skipped", []).append(f"{p.name}: {e}")
    return out


# -- the run --------------------------------------------------------------------------------------------------
class SoakRun:
    """State shared by the client threads, the fault injector and the monitor."""

    def __init__(self, cfg: SoakConfig, progress):
        self.cfg, self.progress = cfg, progress
        self.keys = {t: f"soak-{t.lower()}-{secrets.token_hex(8)}" for t in TENANTS}
        self.probes = make_probes(cfg.seed, cfg.modes)
        self.inline = {t: [make_passage(cfg.seed, t, i, "inline") for i in range(6)] for t in TENANTS}
        self.questions = {t: [] for t in TENANTS}  # about the documents added so far
        self.ledger = DocLedger()
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.answers: list[dict] = []     # probe answers, every phase
        self.leaks: list[dict] = []       # cross-tenant reads
        self.own_marker: dict[str, int] = {}  # responses holding their own tenant's marker, by kind
        self.faults: list[dict] = []
        self.crashes: list[dict] = []
        self.phase = "setup"
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.next_doc = {t: 0 for t in TENANTS}
        self.sup: ServerSupervisor | None = None
        self.redis_back: threading.Thread | None = None  # brings a killed Redis back

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def headers(self, tenant: str) -> dict:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def _record(self, rec: dict, body: str, tenant: str) -> dict:
        marker = leaked_marker(tenant, body)
        with self.lock:
            self.records.append(rec)
            if MARKERS[tenant].lower() in body.lower():  # the detector can see markers in this kind of response
                self.own_marker[rec["kind"]] = self.own_marker.get(rec["kind"], 0) + 1
            if marker:
                self.leaks.append({"tenant": tenant, "marker": marker, "kind": rec["kind"], "phase": rec["phase"],
                                   "excerpt": body[max(0, body.lower().find(marker.lower()) - 200):][:500]})
            if rec.get("probe") is not None:
                self.answers.append(rec)
        return rec

    # -- HTTP ---------------------------------------------------------------------------------------------
    def call(self, http, method: str, path: str, tenant: str, kind: str, body: dict | None = None) -> tuple:
        """One documents-API call: (status or transport error name, parsed JSON or None); recorded."""
        import httpx

        t0, data, text, status = time.monotonic(), None, "", None
        try:
            r = http.request(method, self.sup.url + path, headers=self.headers(tenant), json=body)
            status, text = r.status_code, r.text
            data = r.json() if text else None
        except httpx.TimeoutException:
            status = "timeout"
        except httpx.TransportError as e:
            status = "connection"
            text = f"{type(e).__name__}: {e}"
        except ValueError:
            status = status or "bad_response"
        error = None if status == 200 else text[:300]
        self._record({"phase": self.phase, "t": self.elapsed(), "tenant": tenant, "kind": kind, "status": status,
                      "latency_s": time.monotonic() - t0, "error": error}, text, tenant)
        return status, data

    def chat(self, http, tenant: str, mode: str, kind: str, ragkv: dict, question: str, stream: bool,
             probe: str | None = None) -> dict:
        import httpx

        payload = {"model": self.cfg.model, "messages": [{"role": "user", "content": question}],
                   "max_tokens": self.cfg.max_tokens, "temperature": 0, "stream": stream,
                   "ragkv": {"mode": mode, **ragkv}}
        rec = {"phase": self.phase, "t": self.elapsed(), "tenant": tenant, "kind": kind, "mode": mode,
               "stream": stream, "probe": probe, "status": None, "error": None}
        t0, body = time.monotonic(), ""
        try:
            if stream:
                body = self._stream(http, payload, tenant, rec)
            else:
                r = http.post(self.sup.url + "/v1/chat/completions", headers=self.headers(tenant), json=payload)
                rec["status"], body = r.status_code, r.text
                if r.status_code == 200:
                    data = r.json()
                    rec["text"] = data["choices"][0]["message"]["content"]
                    usage, stats = data.get("usage") or {}, (data.get("ragkv") or {}).get("stats") or {}
                    rec.update(store_fault=usage.get("store_fault"), uncached_blocks=usage.get("uncached_blocks"),
                               cache_misses=stats.get("cache_misses"))
                else:
                    rec["error"] = body[:300]
        except httpx.TimeoutException:
            rec["status"] = "timeout"
        except httpx.TransportError as e:
            rec["status"], rec["error"] = "connection", f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError) as e:
            rec["status"], rec["error"] = "bad_response", f"{type(e).__name__}: {e}: {body[:200]}"
        rec["latency_s"] = time.monotonic() - t0
        return self._record(rec, body, tenant)

    def _stream(self, http, payload: dict, tenant: str, rec: dict) -> str:
        raw, pieces = [], []
        with http.stream("POST", self.sup.url + "/v1/chat/completions", headers=self.headers(tenant),
                         json=payload) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                body = r.read().decode(errors="replace")
                rec["error"] = body[:300]
                return body
            for line in r.iter_lines():
                raw.append(line)
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec["stream_error"] = True
                    rec["error"] = json.dumps(obj["error"])[:300]
                for ch in obj.get("choices") or []:
                    pieces.append((ch.get("delta") or {}).get("content") or "")
                stats = (obj.get("ragkv") or {}).get("stats")
                if stats:
                    extra = stats.get("extra") or {}
                    rec.update(store_fault="store_fault" in extra, uncached_blocks=extra.get("uncached_blocks", 0),
                               cache_misses=stats.get("cache_misses"))
        if not rec.get("stream_error"):
            rec["text"] = "".join(pieces)
        return "\n".join(raw)

    def send_probe(self, http, probe: dict, stream: bool = False) -> dict:
        return self.chat(http, probe["tenant"], probe["mode"], "probe", {"documents": probe["documents"]},
                         probe["question"], stream, probe["id"])

    # -- documents ----------------------------------------------------------------------------------------
    def add_document(self, http, tenant: str) -> dict:
        n = self.next_doc[tenant]
        self.next_doc[tenant] += 1
        passage, questions = make_passage(self.cfg.seed, tenant, n, "library")
        doc_id = document_id(tenant, n)
        status, _ = self.call(http, "POST", "/v1/documents", tenant, "documents_add",
                              {"documents": [{"id": doc_id, **passage}], "wait": True})
        self.ledger.added(tenant, doc_id, status)
        if status == 200:
            with self.lock:
                self.questions[tenant] += questions
        return {"tenant": tenant, "add": doc_id, "status": status}

    def delete_document(self, http, tenant: str, rng: random.Random) -> dict | None:
        live = self.ledger.live(tenant)
        if len(live) <= 1:
            return None
        doc_id = rng.choice(live)
        status, _ = self.call(http, "DELETE", f"/v1/documents/{doc_id}", tenant, "documents_delete")
        self.ledger.deleted(tenant, doc_id, status)
        return {"tenant": tenant, "delete": doc_id, "status": status}

    def listing(self, http) -> dict[str, set[str]]:
        out = {}
        for t in TENANTS:
            status, data = self.call(http, "GET", "/v1/documents", t, "documents_list")
            if status != 200 or not isinstance(data, dict):
                raise RuntimeError(f"GET /v1/documents for {t} answered {status}")
            out[t] = {d["doc_id"] for d in data["data"]}
        return out

    # -- threads ------------------------------------------------------------------------------------------
    def client(self, i: int, deadline: float) -> None:
        import httpx

        cfg = self.cfg
        rng = random.Random(cfg.seed * 7919 + i + 1)
        with httpx.Client(timeout=cfg.request_timeout_s, trust_env=False) as http:
            while not self.stop.is_set() and time.monotonic() < deadline:
                with self.lock:
                    if len(self.records) >= cfg.max_requests:
                        break
                stream = rng.random() < cfg.stream_fraction
                if rng.random() < cfg.probe_fraction:
                    rec = self.send_probe(http, rng.choice(self.probes), stream)
                else:
                    tenant, mode = rng.choice(TENANTS), rng.choice(cfg.modes)
                    with self.lock:  # either tenant's questions: asking about the other's documents must not leak
                        questions = [q for t in TENANTS for q in self.questions[t]]
                    if questions and rng.random() < cfg.retrieval_fraction:
                        rec = self.chat(http, tenant, mode, "retrieval", {"retrieval": {"top_k": cfg.top_k}},
                                        rng.choice(questions), stream)
                    else:
                        docs = rng.sample(self.inline[tenant], rng.randint(1, 3))
                        rec = self.chat(http, tenant, mode, "inline", {"documents": [d for d, _ in docs]},
                                        rng.choice(docs[0][1]), stream)
                if rec["status"] in ("connection", "timeout"):
                    self.stop.wait(1.0)  # the server may be restarting after a crash

    def injector(self, deadline: float, disk_dir: Path, redis: RedisProcess) -> None:
        import httpx

        rng = random.Random(self.cfg.seed)
        kinds: list[str] = []
        with httpx.Client(timeout=self.cfg.request_timeout_s, trust_env=False) as http:
            while True:
                wait = rng.uniform(0.5, 1.5) * self.cfg.fault_interval_s
                if self.stop.wait(min(wait, max(0.0, deadline - time.monotonic()))) or time.monotonic() >= deadline:
                    return
                if not kinds:  # every kind once per round, in a seeded order
                    kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))
                kind = kinds.pop()
                event = {"t": self.elapsed(), "kind": kind}
                try:
                    if kind == "disk":
                        event.update(corrupt_disk(disk_dir, rng))
                    elif kind == "redis":
                        if self.redis_back is not None and self.redis_back.is_alive():
                            event["skipped"] = "Redis is still down"
                        else:
                            event.update(before=redis.stats())
                            redis.kill()
                            down = rng.uniform(*self.cfg.redis_down_s)
                            self.redis_back = threading.Thread(target=self._restart_redis, args=(redis, down),
                                                               daemon=True, name="soak-redis-restart")
                            self.redis_back.start()
                            event.update(down_s=round(down, 2))
                    else:
                        event["documents"] = []
                        for t in TENANTS:
                            event["documents"].append(self.add_document(http, t))
                            if rng.random() < 0.5:
                                event["documents"].append(self.delete_document(http, t, rng))
                            self.call(http, "GET", "/v1/documents", t, "documents_list")  # checked for leaks
                except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
                    event["error"] = f"{type(e).__name__}: {e}"
                with self.lock:
                    self.faults.append(event)
                self.progress(f"[soak] {event['t']:.0f} s: fault {kind}: "
                              f"{json.dumps({k: v for k, v in event.items() if k not in ('t', 'kind')})[:240]}")

    def _restart_redis(self, redis: RedisProcess, down: float) -> None:
        self.stop.wait(down)  # the end of the soak brings it back at once
        try:
            redis.start()
        except Exception as e:  # noqa: BLE001 - the end of the soak tries again
            with self.lock:
                self.faults.append({"t": self.elapsed(), "kind": "redis_restart_failed", "error": str(e)})

    def crashed(self) -> dict:
        """Record the exit of the current server (once per process)."""
        proc = self.sup.server.proc if self.sup.server else None
        pid = proc.pid if proc else None
        known = next((c for c in self.crashes if c["pid"] == pid), None)
        if known is None:
            known = {"t": self.elapsed(), "pid": pid, "exit_code": proc.returncode if proc else None,
                     "log": self.sup.log_tail()}
            self.crashes.append(known)
        return known

    def monitor(self) -> None:
        """A server that exited is a crash: recorded with its log, then restarted (a bounded number of times)."""
        last_report = time.monotonic()
        while not self.stop.wait(1.0):
            if not self.sup.alive():
                crash = self.crashed()
                self.progress(f"[soak] CRASH at {crash['t']} s: server exited with {crash['exit_code']}")
                if len(self.crashes) > self.cfg.max_server_restarts:
                    self.stop.set()
                    return
                try:
                    self.sup.stop()
                    self.sup.start()
                except Exception as e:  # noqa: BLE001
                    crash["restart_error"] = f"{type(e).__name__}: {e}"
                    self.stop.set()
                    return
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                with self.lock:
                    n, bad = len(self.records), sum(r["status"] != 200 for r in self.records)
                self.progress(f"[soak] {self.elapsed():.0f} s ({self.phase}): {n} requests, {bad} not 200")

    # -- phases -------------------------------------------------------------------------------------------
    def quiet_probes(self, http, phase: str) -> None:
        self.phase = phase
        for p in self.probes:
            self.send_probe(http, p)

    def execute(self, redis: RedisProcess, sup: ServerSupervisor, disk_dir: Path, out: dict) -> None:
        import httpx

        cfg = self.cfg
        self.sup = sup
        # the setup waits longer: a server's first job measures the store profile, minutes on a loaded machine
        with httpx.Client(timeout=cfg.request_timeout_s + cfg.startup_s, trust_env=False) as http:
            self.progress(f"[soak] {self.elapsed():.0f} s: server up; adding {cfg.initial_documents} documents per "
                          "tenant")
            for t in TENANTS:
                for _ in range(cfg.initial_documents):
                    self.add_document(http, t)
            self.progress(f"[soak] {self.elapsed():.0f} s: recording the probes' fault-free answers")
            self.quiet_probes(http, "baseline")
            baseline = {a["probe"]: a.get("text") for a in self.answers if a["phase"] == "baseline"}
            out["baseline"] = baseline
            self.quiet_probes(http, "baseline_warm")
            self.progress(f"[soak] {self.elapsed():.0f} s: {len(self.probes)} probes recorded; calm load for "
                          f"{cfg.calm_s:.0f} s, then faults for {cfg.minutes} min")
            walls = {}
            start = time.monotonic()
            deadline = start + cfg.calm_s + 60 * cfg.minutes
            clients = [threading.Thread(target=self.client, args=(i, deadline), daemon=True, name=f"soak-client-{i}")
                       for i in range(cfg.clients)]
            watcher = threading.Thread(target=self.monitor, daemon=True, name="soak-monitor")
            self.phase = "calm"
            for th in clients + [watcher]:
                th.start()
            try:
                self.stop.wait(cfg.calm_s)
                walls["calm"] = time.monotonic() - start
                self.phase = "faults"
                faults_start = time.monotonic()
                self.progress(f"[soak] {self.elapsed():.0f} s: faults begin")
                inj = threading.Thread(target=self.injector, args=(deadline, disk_dir, redis), daemon=True,
                                       name="soak-injector")
                inj.start()
                inj.join(deadline - time.monotonic() + 4 * cfg.request_timeout_s + 30)
                for th in clients:
                    th.join(max(1.0, deadline - time.monotonic()) + cfg.request_timeout_s + 10)
                walls["faults"] = time.monotonic() - faults_start
            finally:
                self.stop.set()
                watcher.join(cfg.startup_s + 60)
            out["walls"] = walls
            if self.redis_back is not None:
                self.redis_back.join(30)
            if not redis.alive():
                redis.start()
            out["redis_at_end"] = redis.stats()
            if not sup.alive():  # crashed at the very end, or the monitor gave up: one start for the checks
                self.crashed()
                sup.stop()
                sup.start()
            self.progress(f"[soak] {self.elapsed():.0f} s: faults over; probes and documents checked")
            self.quiet_probes(http, "after")
            self.progress(f"[soak] {self.elapsed():.0f} s: probes re-sent; restarting the server")
            out["metrics"] = parse_metrics(http.get(sup.url + "/metrics").text)
            out["documents_end"] = self.ledger.check(self.listing(http))
            self.phase = "restart"
            out["shutdown"] = sup.stop()
            sup.start()
            self.progress(f"[soak] {self.elapsed():.0f} s: server restarted on the same cache folder (SIGTERM: "
                          f"{out['shutdown']})")
            out["documents_after_restart"] = self.ledger.check(self.listing(http))
            self.quiet_probes(http, "after_restart")
            out["metrics_after_restart"] = parse_metrics(http.get(sup.url + "/metrics").text)

    def summary(self, out: dict) -> dict:
        walls = out.get("walls", {})
        requests = summarize_requests(self.records, walls)
        probes = compare_probes(out.get("baseline", {}), self.answers)
        ph = probes["phases"]
        end, restart = out.get("documents_end", {}), out.get("documents_after_restart", {})
        faults = {k: sum(f["kind"] == k for f in self.faults) for k in FAULT_KINDS}
        figures = {
            "crashes": len(self.crashes),
            "http_5xx": requests["http_5xx"],
            "other_non_2xx": requests["other_non_2xx"],
            "transport_errors": requests["transport_errors"],
            "stream_errors": requests["stream_errors"],
            "lost_documents": len(end.get("lost", [])),
            "lost_documents_after_restart": len(restart.get("lost", [])),
            "deleted_documents_listed_again": len(set(end.get("resurrected", [])) | set(restart.get("resurrected",
                                                                                                     []))),
            "cross_tenant_reads": len(self.leaks),
            "differing_answers": sum(ph.get(p, {}).get("differ", 0) for p in ("faults", "after", "after_restart")),
            "unclean_shutdown": int(out.get("shutdown", {}).get("exit_code", 0) not in (0, None)),
        }
        zero = all(not v for v in figures.values()) and "error" not in out
        noise = {p: ph[p] for p in ("baseline_warm", "calm") if p in ph}
        return {"figures": figures, "all_zero": zero,
                "fault_free_differences": noise, "probes": probes, "requests": requests,
                "faults_injected": faults, "fault_events": self.faults, "crash_reports": self.crashes,
                "cross_tenant_samples": self.leaks[:10], "own_marker_responses": self.own_marker, "document_notes": self.ledger.notes[:20],
                "server_logs": self.sup.logs if self.sup else []}


def _work_dir(cfg: SoakConfig, out_dir: Path) -> Path:
    work = (Path(cfg.work_dir).expanduser() if cfg.work_dir else out_dir / "soak-work").resolve()
    if work.exists() and any(work.iterdir()):
        if not (work / WORK_MARK).exists():
            raise InvalidRequestError(f"--work-dir {work} is not empty and not a previous soak's; pick another")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).write_text("a ragkv bench soak work folder; removed by the next soak\n")
    return work


def run_soak(cfg: SoakConfig, out_dir: Path = Path("bench_out"), progress=print) -> dict:
    """Run the soak; write soak.json and soak.md under `out_dir`; return the JSON object. Redis and the server
    are stopped on the way out, whatever happens."""
    import os

    from ragkv.bench.common import save_json

    out_dir = Path(out_dir)
    work = _work_dir(cfg, out_dir)
    disk_dir = work / "server" / "kv"
    run = SoakRun(cfg, progress)
    out: dict = {"benchmark": "soak", "config": asdict(cfg), "work_dir": str(work),
                 "machine": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}}
    try:
        with RedisProcess(work / "redis", cfg.redis_maxmemory) as redis:
            store = f"memory:{cfg.memory},disk:{disk_dir}:{cfg.disk_size},{redis.url}"
            out["store"] = store
            progress(f"[soak] redis-server on {redis.url}; starting ragkv serve (store {store})")
            with ServerSupervisor(cfg, work / "server", store, run.keys) as sup:
                run.sup = sup
                out["server_command"] = " ".join(sup.server.cmd)
                run.execute(redis, sup, disk_dir, out)
            out["redis_starts"] = redis.starts
    except BaseException as e:
        out["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        run.stop.set()
        out.update(run.summary(out))
        out["probes"]["baseline"] = out.pop("baseline", {})
        out["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        out["elapsed_s"] = run.elapsed()
        shutil.rmtree(disk_dir, ignore_errors=True)  # the KV files are big; the logs and the index stay
        save_json(out_dir / "soak.json", out)
        with open(out_dir / "soak_requests.jsonl", "w") as f:  # every request, for a closer look
            for r in run.records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        (out_dir / "soak.md").write_text(render_markdown(out) + "\n")
    return out


# -- report ---------------------------------------------------------------------------------------------------
FIGURE_LABELS = {
    "crashes": "crashes (server process exited)",
    "http_5xx": "HTTP 5xx",
    "other_non_2xx": "other non-2xx, by status",
    "transport_errors": "transport errors (timeouts, refused connections)",
    "stream_errors": "errors inside 200 streams",
    "lost_documents": "lost acknowledged documents (end)",
    "lost_documents_after_restart": "lost acknowledged documents (after a restart on the same cache folder)",
    "deleted_documents_listed_again": "deleted documents listed again",
    "cross_tenant_reads": "cross-tenant reads (another tenant's marker in a response or listing)",
    "differing_answers": "probe answers differing from the fault-free greedy run (during faults, after, after "
                         "restart)",
    "unclean_shutdown": "SIGTERM exit code not 0",
}


def render_markdown(out: dict) -> str:
    from ragkv.bench.common import markdown_table

    figs = out.get("figures", {})
    lines = [f"# ragkv bench soak: {'all zero' if out.get('all_zero') else 'NOT all zero'}", ""]
    if out.get("error"):
        lines += [f"**The soak stopped on an error:** {out['error']}", ""]
    lines.append(markdown_table(["figure (target 0)", "value"],
                                [[label, figs.get(k, "-") if not isinstance(figs.get(k), dict) else (
                                    json.dumps(figs[k]) if figs[k] else 0)] for k, label in FIGURE_LABELS.items()]))
    req = out.get("requests", {})
    ph, probe_ph = req.get("phases", {}), out.get("probes", {}).get("phases", {})
    dash = lambda x: "-" if x is None else x  # noqa: E731
    rows = [[p, v["chat_requests"], v["ok"], dash(v["wall_s"]), dash(v["requests_per_s"]), dash(v["latency_p50_ms"]),
             dash(v["latency_p99_ms"]), f"{probe_ph.get(p, {}).get('differ', 0)}/{probe_ph.get(p, {}).get('sent', 0)}"]
            for p, v in ph.items()]  # baseline: the reference itself; the other quiet phases: one probe at a time
    lines += ["", markdown_table(["phase", "chat requests", "ok", "wall s", "req/s", "latency p50 ms",
                                  "latency p99 ms", "probes differing/sent"], rows)]
    m, m2 = out.get("metrics") or {}, out.get("metrics_after_restart") or {}
    cfg = out.get("config", {})
    lines += ["", f"- faults injected: {out.get('faults_injected')}; redis-server starts: {out.get('redis_starts')}; "
                  f"Redis after the last restart: {out.get('redis_at_end')}",
              f"- server /metrics at the end: tier faults {m.get('tier_faults')}, fault requests "
              f"{m.get('fault_requests')}, uncached blocks {m.get('uncached_blocks')}, requests by status "
              f"{m.get('requests_by_status')}",
              f"- after the restart: tier faults {m2.get('tier_faults')}, fault requests {m2.get('fault_requests')}, "
              f"uncached blocks {m2.get('uncached_blocks')}",
              f"- answers the server marked store_fault (client side): {req.get('client_store_fault_answers')}, "
              f"uncached blocks reported in usage: {req.get('client_uncached_blocks')}",
              f"- documents: end {out.get('documents_end', {}).get('ledger')}, SIGTERM {out.get('shutdown')}",
              f"- {cfg.get('clients')} clients, {cfg.get('minutes')} min of faults every ~{cfg.get('fault_interval_s')}"
              f" s after {cfg.get('calm_s')} s calm, seed {cfg.get('seed')}, {cfg.get('model')} {cfg.get('dtype')}; "
              f"store {out.get('store')}; {out.get('machine', {}).get('cpus')} CPUs, load "
              f"{out.get('machine', {}).get('loadavg_at_start')} -> {out.get('machine', {}).get('loadavg_at_end')}",
              f"- server logs: {', '.join(out.get('server_logs', []))}"]
    lines.append(f"- the leak detector's reach: responses holding their own tenant's marker, by kind: "
                 f"{out.get('own_marker_responses')}")
    noise = out.get("fault_free_differences") or {}
    if noise:
        lines.append(f"- fault-free noise floor (not counted above): {noise}")
    for title, items in (("Probe differences", out.get("probes", {}).get("examples")),
                         ("Error samples", req.get("error_samples")),
                         ("Cross-tenant reads", out.get("cross_tenant_samples")),
                         ("Lost documents", (out.get("documents_end", {}).get("lost", [])
                                             + out.get("documents_after_restart", {}).get("lost", []))),
                         ("Document notes", out.get("document_notes")),
                         ("Crashes", [{k: v for k, v in c.items() if k != "log"} for c in out.get("crash_reports", [])])):
        if items:
            lines += ["", f"## {title}", ""] + [f"- `{json.dumps(x, ensure_ascii=False)[:600]}`" for x in items]
    return "\n".join(lines)
