"""`ragkv bench soak`: N clients for M minutes against a real `ragkv serve` while faults are injected.

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

The parts: `config` (SoakConfig), `workload` (tenants, their marked passages, the probes), `checks` (what is
counted: leaks, the document ledger, probe answers, the server's metrics, request figures), `processes` (Redis and
the server under test, restartable), `clients` (the HTTP clients), `injector` (the faults), `run` (the phases and
the summary) and `report` (soak.md).
"""

from ragkv.bench.soak.config import SoakConfig
from ragkv.bench.soak.run import run_soak

__all__ = ["SoakConfig", "run_soak"]
