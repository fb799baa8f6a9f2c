"""The soak run: its shared state, the crash monitor, the phases (setup, baseline, calm, faults, abuse, after,
restart; or setup and abuse only) and the summary, the server's RSS sampled throughout; `run_soak` starts Redis and
the server and writes soak.json, soak_requests.jsonl and soak.md."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ragkv.bench.soak.abuse import AbuseClients
from ragkv.bench.soak.checks import DocLedger, compare_probes, parse_metrics, summarize_requests
from ragkv.bench.soak.clients import SoakClients
from ragkv.bench.soak.config import SoakConfig
from ragkv.bench.soak.hostile import FUZZ_TENANT, HostileClients
from ragkv.bench.soak.injector import FAULT_KINDS, FaultInjector
from ragkv.bench.soak.memory import RssWatch
from ragkv.bench.soak.processes import RedisProcess, ServerSupervisor
from ragkv.bench.soak.report import render_markdown
from ragkv.bench.soak.workload import TENANTS, make_passage, make_probes
from ragkv.errors import InvalidRequestError

WORK_MARK = ".ragkv-soak"  # a work folder holding this file is ours to clear


class SoakRun(SoakClients, FaultInjector, AbuseClients, HostileClients):
    """State shared by the client threads, the fault injector and the monitor."""

    def __init__(self, cfg: SoakConfig, progress):
        self.cfg, self.progress = cfg, progress
        self.keys = {t: f"soak-{t.lower()}-{secrets.token_hex(8)}" for t in TENANTS}
        if cfg.fuzz_clients:
            self.keys[FUZZ_TENANT] = f"soak-fuzz-{secrets.token_hex(8)}"
        self.fuzzed: dict = {}
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
        self.sup = sup
        with RssWatch(self) as watch:
            try:
                self._execute(redis, sup, disk_dir, out, watch)
            finally:
                out["rss_series_mib"] = watch.series()

    def run_abuse(self, watch: RssWatch, out: dict) -> None:
        """The abuse phase, if configured; a server that died during it is a crash."""
        if not self.cfg.abuse_streams + self.cfg.abuse_salts + self.cfg.abuse_long_words + self.cfg.abuse_documents:
            return
        out["abuse"] = self.abuse_phase(watch)
        if not self.sup.alive():
            self.crashed()
            self.sup.stop()
            self.sup.start()

    def _execute(self, redis: RedisProcess, sup: ServerSupervisor, disk_dir: Path, out: dict,
                 watch: RssWatch) -> None:
        import httpx

        cfg = self.cfg
        # the setup waits longer: a server's first job measures the store profile, minutes on a loaded machine
        with httpx.Client(timeout=cfg.request_timeout_s + cfg.startup_s, trust_env=False) as http:
            self.progress(f"[soak] {self.elapsed():.0f} s: server up; adding {cfg.initial_documents} documents per "
                          "tenant")
            for t in TENANTS:
                for _ in range(cfg.initial_documents):
                    self.add_document(http, t)
            if cfg.abuse_only:
                self.run_abuse(watch, out)
                out["metrics"] = parse_metrics(http.get(sup.url + "/metrics").text)
                out["documents_end"] = self.ledger.check(self.listing(http))
                return
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
                hostile = self.hostile_threads(deadline)
                for th in hostile:
                    th.start()
                inj.join(deadline - time.monotonic() + 4 * cfg.request_timeout_s + 30)
                for th in clients:
                    th.join(max(1.0, deadline - time.monotonic()) + cfg.request_timeout_s + 10)
                for th in hostile:
                    th.join(max(1.0, deadline - time.monotonic()) + cfg.long_ape_timeout_s + 20)
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
            self.run_abuse(watch, out)
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
        if self.fuzzed:  # the fuzzers' own figures: a 5xx, a bodiless 4xx or no answer
            for name in ("5xx", "bodiless_4xx", "no_answer", "rounds_failed"):
                figures[f"fuzz_{name}"] = self.fuzzed[name]
        rss = out.get("abuse", {}).get("rss")
        if rss:  # the abuse phase's memory verdict
            figures["rss_over_budget"] = int(rss["over_budget"])
            figures["rss_not_returned"] = int(rss["not_returned"])
        zero = all(not v for v in figures.values()) and "error" not in out
        noise = {p: ph[p] for p in ("baseline_warm", "calm") if p in ph}
        return {"figures": figures, "all_zero": zero,
                "fault_free_differences": noise, "probes": probes, "requests": requests,
                "faults_injected": faults, "fault_events": self.faults, "crash_reports": self.crashes,
                "fuzz": self.fuzzed, "long_ape": _long_ape(self.records, self.sup.logs if self.sup else []),
                "cross_tenant_samples": self.leaks[:10], "own_marker_responses": self.own_marker, "document_notes": self.ledger.notes[:20],
                "server_logs": self.sup.logs if self.sup else []}


def _long_ape(records: list[dict], logs: list[str]) -> dict:
    """The long `ape` requests: answers by status, and the seconds each took; the servers' log lines on long
    prefills (every tenant's: admitted, refused, ended and where its time went), kept here because the work folder
    with the logs is removed by the next soak."""
    mine = [r for r in records if r["kind"] == "abuse_long_ape"]
    statuses: dict[str, int] = {}
    for r in mine:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    lane: list[str] = []
    for path in logs:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            lane += [line.rstrip() for line in f if "long prefill" in line]
    return {"sent": len(mine), "statuses": statuses, "seconds": [round(r["latency_s"], 1) for r in mine],
            "lane_log": lane[-2000:]}


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
