"""What `ragkv bench soak` runs: clients, minutes, faults, the server and its store."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import InvalidRequestError
from ragkv.settings import SERVE


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
    max_batch: int = 8                 # the server's --max-batch
    kv_memory: str | None = "2GiB"     # the server's --kv-memory (None: its default, flag not passed)
    # the abuse phase (after the faults; abuse_streams 0: none): hostile but fair requests at several clients,
    # bounded in count and time, while the server's RSS is sampled
    abuse_only: bool = False           # setup, then the abuse phase only (no probes, calm, faults or restart)
    abuse_clients: int = 8
    abuse_streams: int = 200           # streams closed after a few events, each with n and max_tokens below
    abuse_n: int = 8
    abuse_max_tokens: int = 2000
    abuse_read_events: int = 3         # data events read before the client closes the stream
    abuse_salts: int = 40              # requests each with a cache_salt of its own (new namespaces, new blocks)
    abuse_long_words: int = 4          # requests whose document is one long word
    abuse_word_chars: int = 6000
    abuse_documents: int = 6           # requests with as many inline documents as the server accepts (and one more)
    abuse_contracts: int = 10          # of each reply with a contract (abuse.CONTRACT_KINDS): broken ones counted
    abuse_max_s: float = 600.0         # the phase stops sending after this long
    # hostile traffic during the faults (0: none): fuzzers against the server's OpenAPI schema, a tenant of their
    # own; one long `ape` request (documents x words) per interval from tenant A
    fuzz_clients: int = 0
    fuzz_examples: int = 25            # per route and round (6 routes); each round is a new draw
    fuzz_timeout_s: float = SERVE.timeout_s + 30  # client side: the server answers every request by its --timeout
                                                  # (a 504 then); none by this is a hang
    long_ape_every_s: float = 0.0
    long_ape_documents: int = 8
    long_ape_words: int = 1000         # of random letters, ~3.6 tokens each: 8 x 1000 is ~29K tokens, within the
                                       # default --max-request-cost (32K rows in `ape`); 4000 is refused (a 400)
    long_ape_timeout_s: float = 900.0  # client side: a long request may run minutes, but not for ever
    # the verdict: RSS may rise over its pre-phase level by the memory tier + the KV limit + rss_slack at most, and
    # must come back within rss_return_pct of that level within rss_return_s of the phase's end
    rss_slack: str = "1GiB"
    rss_return_pct: float = 10.0
    rss_return_s: float = 30.0

    def __post_init__(self):
        from ragkv.engine.modes import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
        if self.clients < 1 or self.max_tokens < 1 or self.max_requests < 1 or self.initial_documents < 1:
            raise InvalidRequestError("--clients, --max-tokens, --max-requests and --initial-documents must be >= 1")
        if not (self.minutes > 0 and self.fault_interval_s > 0 and self.calm_s >= 0 and self.request_timeout_s > 0):
            raise InvalidRequestError("--minutes, --fault-interval and --request-timeout must be > 0, --calm >= 0")
        if not 0 <= self.redis_down_s[0] <= self.redis_down_s[1]:
            raise InvalidRequestError(f"redis_down_s must be (min, max) with 0 <= min <= max, got {self.redis_down_s}")
        if self.abuse_clients < 1 or self.abuse_n < 1 or self.abuse_max_tokens < 1 or self.abuse_read_events < 1 \
                or min(self.abuse_streams, self.abuse_salts, self.abuse_long_words, self.abuse_documents) < 0 \
                or not self.abuse_max_s > 0 or self.max_batch < 1:
            raise InvalidRequestError("--abuse-clients, --abuse-n, --abuse-max-tokens, --abuse-read-events and "
                                      "--max-batch must be >= 1, the abuse counts >= 0, --abuse-seconds > 0")
        if self.fuzz_clients < 0 or self.fuzz_examples < 1 or self.long_ape_every_s < 0 \
                or self.long_ape_documents < 1 or self.long_ape_words < 1 or not self.long_ape_timeout_s > 0:
            raise InvalidRequestError("--fuzz-clients and --long-ape-every must be >= 0; --fuzz-examples, "
                                      "--long-ape-documents, --long-ape-words and --long-ape-timeout > 0")
        from ragkv.store.sizes import parse_size

        for name in ("memory", "rss_slack") + (("kv_memory",) if self.kv_memory else ()):
            parse_size(getattr(self, name))  # a size people write (2GiB): refused here, not mid-run
        if not (self.rss_return_pct >= 0 and self.rss_return_s > 0):
            raise InvalidRequestError("--rss-return-pct must be >= 0 and --rss-return-s > 0")
        for name in ("probe_fraction", "retrieval_fraction", "stream_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be in [0, 1]")
