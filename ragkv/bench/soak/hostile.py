"""The soak's hostile traffic during its faults: property-based fuzzing against the server's own OpenAPI
schema (ragkv.bench.fuzz) from a tenant of its own, and one long `ape` request per interval from tenant A (several
documents of thousands of words: a prefill of tens of thousands of tokens), while the ordinary clients go on. A
fuzzed request must get a 2xx or a 4xx with an error body, never a 5xx or no answer; a long `ape` request must be
answered or refused with a 4xx (its cost over the server's limit), never a 5xx or a hang."""

from __future__ import annotations

import random
import threading
import time

from ragkv.bench.soak.workload import MARKERS, TENANTS

FUZZ_TENANT = "Fuzz"  # its own key and tenant: the documents it adds stay out of the ledger's tenants


class HostileClients:
    """Fuzzers and the long `ape` sender of a SoakRun (its state: cfg, keys, sup, phase, lock, stop, ...)."""

    def hostile_threads(self, deadline: float) -> list[threading.Thread]:
        cfg = self.cfg
        self.fuzzed = {"requests": 0, "rounds": 0, "rounds_failed": 0, "statuses": {}, "5xx": 0, "bodiless_4xx": 0,
                       "no_answer": 0, "failures": []}
        threads = [threading.Thread(target=self.fuzzer, args=(i, deadline), daemon=True, name=f"soak-fuzz-{i}")
                   for i in range(cfg.fuzz_clients)]
        if cfg.long_ape_every_s > 0:
            threads.append(threading.Thread(target=self.long_ape, args=(deadline,), daemon=True,
                                            name="soak-long-ape"))
        return threads

    def fuzzer(self, i: int, deadline: float) -> None:
        """Rounds of generated requests (a new draw each round) until the deadline, each round in a process of its
        own (hypothesis is not thread-safe: rounds run in threads failed inside it)."""
        import json
        import subprocess
        import sys

        while time.monotonic() < deadline and not self.stop.is_set():
            left = deadline - time.monotonic()
            cmd = [sys.executable, "-m", "ragkv.bench.fuzz", self.sup.url, str(self.cfg.fuzz_examples), f"{left:.1f}",
                   str(self.cfg.fuzz_timeout_s), self.keys[FUZZ_TENANT]]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=left + 6 * self.cfg.fuzz_timeout_s + 60)
                if done.returncode != 0:
                    raise RuntimeError(f"exit {done.returncode}: {done.stderr[-300:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
            except Exception as e:  # noqa: BLE001 (a round that could not run, e.g. the schema unreachable)
                with self.lock:
                    self.fuzzed["rounds_failed"] += 1
                    self.fuzzed["failures"].append({"status": "round", "reply": repr(e)[:300]})
                self.stop.wait(5)
                continue
            with self.lock:
                f = self.fuzzed
                f["rounds"] += 1
                for bad in got["failures"]:
                    status = bad["status"]
                    f["no_answer" if not isinstance(status, int) else "5xx" if status >= 500 else "bodiless_4xx"] += 1
                f["requests"] += got["requests"]
                for status, n in got["statuses"].items():
                    f["statuses"][str(status)] = f["statuses"].get(str(status), 0) + n
                f["failures"].extend(got["failures"][:max(0, 50 - len(f["failures"]))])

    def long_ape_body(self, rng: random.Random) -> dict:
        cfg, marker = self.cfg, MARKERS[TENANTS[0]]
        words = [''.join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
                 for _ in range(cfg.long_ape_words)]
        docs = [{"title": f"{marker} report {j}", "text": " ".join(rng.sample(words, len(words)))}
                for j in range(cfg.long_ape_documents)]
        return {"model": cfg.model, "messages": [{"role": "user", "content": "Which report is the longest?"}],
                "max_tokens": 8, "temperature": 0, "ragkv": {"mode": "ape", "documents": docs}}

    def long_ape(self, deadline: float) -> None:
        """One long `ape` request per interval (each on a thread of its own: they may overlap), recorded as an
        abuse request: a 4xx refusal is a right answer, a 5xx or no answer is not."""
        import httpx

        rng = random.Random(self.cfg.seed * 7919 + 3)
        sent: list[threading.Thread] = []

        def one(body: dict) -> None:
            with httpx.Client(timeout=self.cfg.long_ape_timeout_s, trust_env=False) as http:
                self._abuse_send(http, "abuse_long_ape", TENANTS[0], body)

        while time.monotonic() < deadline and not self.stop.is_set():
            th = threading.Thread(target=one, args=(self.long_ape_body(rng),), daemon=True)
            th.start()
            sent.append(th)
            self.stop.wait(min(self.cfg.long_ape_every_s, max(0.0, deadline - time.monotonic())))
        for th in sent:
            th.join(self.cfg.long_ape_timeout_s + 10)
