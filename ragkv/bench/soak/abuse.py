"""The soak's abuse phase: requests a hostile but fair user sends, at several clients, bounded in count
and time, on 127.0.0.1 only, while the server's RSS is watched (memory.py):

- abandoned streams: large `n` and `max_tokens`, the client reading a few events and closing;
- many `cache_salt` values: each a namespace of its own, so every block is computed and stored again;
- long single words: one document that is one word of thousands of letters;
- large document counts: as many inline documents as the server accepts, and one more (a 400);
- replies with a contract (the hostile probe's inputs): a forced tool call whose argument holds `</tool_call>`
  (must come back as a call), a schema no finite value follows (a 400), a constrained answer (its "stop" must
  parse), a tool message answering no call (a 400). A reply that breaks its contract is counted in `broken`.

Every request must be answered 2xx, 4xx or 429, never 5xx; the verdict fails when RSS rises over its pre-phase
level by more than the budget, or does not come back within rss_return_pct of it within rss_return_s."""

from __future__ import annotations

import json
import queue
import random
import string
import threading
import time

from ragkv.bench.soak.memory import MiB, RssWatch, rss_budget, rss_verdict, settle, wait_return
from ragkv.bench.soak.workload import MARKERS, TENANTS
from ragkv.settings import SERVE

CONTRACT_KINDS = ("abuse_tool_tag", "abuse_unfinishable", "abuse_constrained", "abuse_orphan_tool")
ABUSE_KINDS = ("abuse_stream", "abuse_salt", "abuse_long_word", "abuse_documents", "abuse_too_many_documents",
               *CONTRACT_KINDS)
TAG_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"const": "]</tool_call>x"}},
                           "required": ["city"], "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                 "required": ["answer"], "additionalProperties": False}


def contract_broken(kind: str, status, text: str) -> str | None:
    """Why a contract reply breaks its contract (None: it keeps it). Only 200s and the expected 400s are judged;
    transport errors and 429s are counted as statuses."""
    if kind in ("abuse_unfinishable", "abuse_orphan_tool"):
        return None if status in (400, 429) else f"expected a 400, got {status}"
    if status != 200:
        return f"{status}" if isinstance(status, int) and status >= 500 else None
    choice = json.loads(text)["choices"][0]
    if kind == "abuse_tool_tag":
        calls = choice["message"].get("tool_calls") or []
        ok = calls and json.loads(calls[0]["function"]["arguments"]).get("city") == "]</tool_call>x"
        return None if ok else f"a required call came back as text ({choice['finish_reason']})"
    if choice["finish_reason"] == "stop":
        try:
            json.loads(choice["message"]["content"])
        except ValueError:
            return "finish_reason stop with JSON that does not parse"
    return None


class AbuseClients:
    """The abuse phase of a SoakRun (its state: cfg, keys, sup, phase, lock, records, inline, ...)."""

    def _abuse_payload(self, rng: random.Random, tenant: str, **kw) -> dict:
        docs = rng.sample(self.inline[tenant], rng.randint(1, 3))
        body = {"model": self.cfg.model, "messages": [{"role": "user", "content": rng.choice(docs[0][1])}],
                "max_tokens": self.cfg.max_tokens, "temperature": 0,
                "ragkv": {"mode": rng.choice(self.cfg.modes), "documents": [d for d, _ in docs]}}
        for key, value in kw.items():
            if key == "ragkv":
                body["ragkv"].update(value)
            else:
                body[key] = value
        return body

    def _abuse_send(self, http, kind: str, tenant: str, body: dict, read_events: int | None = None) -> dict:
        """One request; a stream is closed after `read_events` data events (abandoned). Recorded like the others."""
        import httpx

        rec = {"phase": self.phase, "t": self.elapsed(), "tenant": tenant, "kind": kind, "status": None,
               "error": None, "stream": read_events is not None}
        t0, text = time.monotonic(), ""
        try:
            if read_events is None:
                r = http.post(self.sup.url + "/v1/chat/completions", headers=self.headers(tenant), json=body)
                rec["status"], text = r.status_code, r.text
            else:
                with http.stream("POST", self.sup.url + "/v1/chat/completions", headers=self.headers(tenant),
                                 json=body) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        text = r.read().decode(errors="replace")
                    else:
                        seen = []
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                seen.append(line)
                                if '"error"' in line and json.loads(line[6:]).get("error"):
                                    rec["stream_error"] = True
                                    rec["error"] = line[6:306]
                            if len(seen) >= read_events:
                                break  # leaving: the connection closes with the answer unfinished
                        text = "\n".join(seen)
            if rec["status"] != 200 and rec["error"] is None:
                rec["error"] = text[:300]
        except httpx.TimeoutException:
            rec["status"] = "timeout"
        except httpx.TransportError as e:
            rec["status"], rec["error"] = "connection", f"{type(e).__name__}: {e}"
        rec["latency_s"] = time.monotonic() - t0
        if kind in CONTRACT_KINDS:
            rec["_text"] = text  # judged by the caller (contract_broken), then dropped
        return self._record(rec, text, tenant)

    def _abuse_task(self, http, rng: random.Random, kind: str, i: int) -> dict:
        cfg, tenant = self.cfg, rng.choice(TENANTS)
        if kind == "abuse_stream":
            body = self._abuse_payload(rng, tenant, n=cfg.abuse_n, max_tokens=cfg.abuse_max_tokens, stream=True)
            return self._abuse_send(http, kind, tenant, body, read_events=cfg.abuse_read_events)
        if kind == "abuse_salt":
            body = self._abuse_payload(rng, tenant, cache_salt=f"abuse-{cfg.seed}-{i}-{rng.getrandbits(32):08x}")
            return self._abuse_send(http, kind, tenant, body)
        if kind == "abuse_long_word":
            word = "".join(rng.choices(string.ascii_letters, k=cfg.abuse_word_chars))
            body = self._abuse_payload(rng, tenant, messages=[{"role": "user", "content": "What does the word say?"}],
                                       ragkv={"mode": "reuse", "documents": [{"title": MARKERS[tenant],
                                                                              "text": word}]})
            return self._abuse_send(http, kind, tenant, body)
        if kind in CONTRACT_KINDS:
            return self._contract_task(http, rng, kind, tenant)
        count = SERVE.max_documents + (kind == "abuse_too_many_documents")
        docs = [{"title": f"{MARKERS[tenant]} note {j}", "text": f"{MARKERS[tenant]} note {j} of request {i}: "
                 f"{rng.randrange(10**6)} lanterns."} for j in range(count)]
        body = self._abuse_payload(rng, tenant, ragkv={"mode": "reuse", "documents": docs})
        return self._abuse_send(http, kind, tenant, body)

    def _contract_task(self, http, rng: random.Random, kind: str, tenant: str) -> dict:
        ask = [{"role": "user", "content": "What is the weather in the city? Answer in JSON."}]
        body = {"model": self.cfg.model, "messages": ask, "max_tokens": 64, "temperature": rng.choice([0, 1.0])}
        if kind == "abuse_tool_tag":
            body.update(tools=[TAG_TOOL], tool_choice="required")
        elif kind == "abuse_unfinishable":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}
        elif kind == "abuse_constrained":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
        else:
            body["messages"] = [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}] + ask
        body["stream"] = False
        rec = self._abuse_send(http, kind, tenant, body)
        with self.lock:
            rec["broken"] = contract_broken(kind, rec["status"], rec.pop("_text", "") or "{}")
        return rec

    def _abuse_tasks(self, rng: random.Random) -> list[str]:
        cfg = self.cfg
        docs = ["abuse_documents", "abuse_too_many_documents"] * (cfg.abuse_documents // 2) \
            + ["abuse_documents"] * (cfg.abuse_documents % 2)
        tasks = (["abuse_stream"] * cfg.abuse_streams + ["abuse_salt"] * cfg.abuse_salts
                 + ["abuse_long_word"] * cfg.abuse_long_words + docs
                 + [k for k in CONTRACT_KINDS for _ in range(cfg.abuse_contracts)])
        rng.shuffle(tasks)
        return tasks

    def abuse_phase(self, watch: RssWatch) -> dict:
        """Run the phase; returns its counts and the RSS verdict."""
        import httpx

        cfg = self.cfg
        rng = random.Random(cfg.seed * 104729 + 17)
        todo: queue.Queue = queue.Queue()
        for i, kind in enumerate(self._abuse_tasks(rng)):
            todo.put((i, kind))
        sent = todo.qsize()
        pre = settle(watch)
        budget = rss_budget(cfg)
        self.progress(f"[soak] {self.elapsed():.0f} s: abuse phase: {sent} requests at {cfg.abuse_clients} clients "
                      f"(n={cfg.abuse_n}, max_tokens {cfg.abuse_max_tokens}); RSS {pre / MiB:.0f} MiB, may rise by "
                      f"{budget['total'] / MiB:.0f} MiB")
        deadline = time.monotonic() + cfg.abuse_max_s
        start_records = len(self.records)

        def worker(c: int) -> None:
            local = random.Random(cfg.seed * 31 + c)
            with httpx.Client(timeout=cfg.request_timeout_s, trust_env=False) as http:
                while time.monotonic() < deadline:
                    try:
                        i, kind = todo.get_nowait()
                    except queue.Empty:
                        return
                    self._abuse_task(http, local, kind, i)

        self.phase = "abuse"
        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(c,), daemon=True, name=f"soak-abuse-{c}")
                   for c in range(cfg.abuse_clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(1.0, deadline - time.monotonic()) + cfg.request_timeout_s + 10)
        wall = time.monotonic() - t0
        self.phase = "abuse_after"
        returned = wait_return(watch, int(pre * (1 + cfg.rss_return_pct / 100)), cfg.rss_return_s)
        end = watch.now()
        with self.lock:
            recs = self.records[start_records:]
        counts: dict[str, dict] = {}
        for r in recs:
            by = counts.setdefault(r["kind"], {})
            by[str(r["status"])] = by.get(str(r["status"]), 0) + 1
        verdict = rss_verdict(watch.samples, pre, budget, cfg, returned, end)
        broken = [{"kind": r["kind"], "why": r["broken"]} for r in recs if r.get("broken")]
        self.progress(f"[soak] {self.elapsed():.0f} s: abuse phase over in {wall:.0f} s: RSS {verdict['pre_phase_mib']}"
                      f" -> peak {verdict['peak_mib']} (allowed {verdict['allowed_peak_mib']}) -> "
                      f"{verdict['after_phase_mib']} MiB, back within {cfg.rss_return_pct:.0f}% after "
                      f"{returned} s; answers {counts}")
        return {"requests": sent, "sent": len(recs), "unsent": todo.qsize(), "wall_s": round(wall, 1),
                "answers": counts, "rss": verdict, "broken": broken,
                "contracts": sum(r["kind"] in CONTRACT_KINDS for r in recs)}
