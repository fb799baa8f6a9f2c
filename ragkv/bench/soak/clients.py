"""The soak's HTTP side: documents-API calls and chat requests (streamed or not), each recorded with what it
leaked; the client threads' loop."""

from __future__ import annotations

import json
import random
import time

from ragkv.bench.soak.checks import leaked_marker
from ragkv.bench.soak.workload import MARKERS, TENANTS, document_id, make_passage


class SoakClients:
    """The requests of a SoakRun (its state: cfg, keys, sup, phase, lock, records, answers, leaks, ledger, ...)."""

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
