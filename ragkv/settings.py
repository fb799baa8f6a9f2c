"""One set of defaults for every command and the server, and the optional settings file that overrides them.

The settings file is TOML (`$RAGKV_SETTINGS`, default `~/.config/ragkv/settings.toml`). Top-level keys are flag
names (`store`, `dtype`, `model`, ...; dashes or underscores) and apply to every command that has the flag; a
table named after a command (`[serve]`, `[ask]`, `[bench.ttft]`) applies to that command only. Flags given on
the command line override both. Unknown keys are an error, so a typo never goes unnoticed.

    dtype = "float32"
    store = "memory:4GiB,disk:/data/ragkv/kv:200GiB"

    [serve]
    port = 8080
    max_batch = 8
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ragkv.config import cache_dir
from ragkv.errors import RagkvError

DEFAULT_MODEL = "smollm2"
DEFAULT_DTYPE = "auto"     # bf16 where the hardware runs it fast, else fp32 (ragkv.config.resolve_dtype)
DEFAULT_NAMESPACE = "default"
DEFAULT_TENANT = "default"  # the tenant of every request to a server without API keys, and of `ingest`/`ask`
DEFAULT_BLOCK_POOL_BYTES = 512 << 20  # --block-pool: blocks read in place (kv_layout=shared), kept on the device
# --mode of `ask` and `serve`: how a request with documents that names no mode is answered. ProphetKV's query-aware
# selection at r=0.14 (within a fifth of `full`'s work on the 1.5B too), ranked by the second half of the layers: the
# same task scores as the uniform ranking at n=60 and a first token closer to `full`'s on every set measured (README
# "Choosing a mode"); `--mode reuse` is the lowest latency
DEFAULT_DOCUMENTS_MODE = "blend:sel=query,r=0.14,sfrom=0.5"
DEFAULT_PASSAGE_ORDER = "best-last"  # retrieved passages in ascending relevance, the best next to the question


@dataclass(frozen=True)
class ServeDefaults:
    """`ragkv serve`'s defaults, written here only: its flags, the Server, its Limits and the scheduler read them."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64                # --max-queue: waiting requests before answering 429
    timeout_s: float = 300.0           # --timeout: seconds a request may wait and run
    max_batch: int = 16                # --max-batch: sequences decoded together in one batched step
    prefill_chunk: int = 512           # --prefill-chunk: tokens of a prefill unit (any mode, a block's encoding)
    # --prefill-stall-ms: how long newcomers' prefill units may run between two decode steps (at least one unit):
    # more newcomers join each batched step, raising output tokens/s under load, at the running answers'
    # inter-token time (0: one unit per step, the lowest stall)
    prefill_stall_ms: float = 0.0
    # --max-num-batched-tokens (vLLM's name and meaning): rows of one forward, decode rows and prefill chunks
    # together; prefill units of several requests join the decode step while they fit (at least one always does)
    max_num_batched_tokens: int = 2048
    # --max-prefills-per-tenant: a tenant's next request starts prefilling while every one of its prefills in
    # flight has its forward staged for the next step (so it delays none of them) and the step has room; this caps
    # how many (0: as many as the token budget holds; 1: one at a time, first come first served)
    max_prefills_per_tenant: int = 0
    # --no-mixed-steps: prefill units run alone between decode steps (the measurement's other side)
    mixed_steps: bool = True
    # --batch-invariant: an answer never depends on what runs beside it (every decode step at max_batch rows,
    # prefills always chunked): costs the small batches their speed (docs/results/batch_invariance.md)
    batch_invariant: bool = False
    # --startup-profile: measure the loading controller's profile (tier speeds, the model's recompute cost) at
    # start-up where none is saved: ~14 s of forwards for SmolLM2 on 2 cores, run while the server is idle
    startup_profile: bool = True
    # --keep-alive: seconds an idle connection stays open. Longer than clients' own idle expiry (httpx's 5 s), so a
    # client never sends on a connection the server is closing that instant (uvicorn's 5 s raced httpx's: a request
    # now and then met "Server disconnected without sending a response")
    keep_alive_s: float = 75.0
    max_body_bytes: int = 8 << 20      # --max-body: larger bodies get 413 before being read
    max_documents: int = 64            # --max-documents: inline documents per request, or per POST /v1/documents
    max_document_chars: int = 1_000_000  # --max-document-chars: characters of one document
    max_prompt_tokens: int | None = None  # --max-prompt-tokens: prompt tokens (None: the model's positions)
    ingest_timeout_s: float = 1800.0   # --ingest-timeout: deadline of a document ingestion job
    kv_memory_bytes: int = 4 << 30     # --kv-memory: KV the running generations may reserve (prompt + n x max_tokens)
    # --max-request-cost: token-layers one request's prefill may cost on a cold cache (None: this many windows of
    # the model, positions x layers; 0: no limit). 4 windows admit `auto` over a full window (~2.2x) and `ape` over
    # documents of up to ~4 windows (the hostile probe's 32K tokens on SmolLM2's 8K window, 0.98 of the limit), and
    # refuse its 2 MB request (~400K tokens), which grew the server's RSS by 1.2 GB and never answered
    max_request_windows: float = 4.0
    # --tenant-budget: token-layers a tenant's admitted requests may cost per minute (None: no budget; 429 above)
    tenant_budget: int | None = None
    # --tenant-in-flight-cost: token-layers a tenant's admitted, unfinished requests may cost together (None: this
    # many windows of the model; 0: no limit). 5 windows hold one request at the per-request limit and a window of
    # others: a tenant sending one ~29K-token `ape` request a minute (each minutes on 2 cores) got 504s after 300 s
    # in the queue and held the KV memory; now its second is a 429 at once
    tenant_in_flight_windows: float = 5.0
    # --history-mode: the mode of a chat whose earlier turns are blocks, when the request names none (exact while
    # the conversation is only extended; after an edit the turns behind it are fused by this mode). blend: at an
    # edit 0.34-0.47x full's TTFT at a first-token KL of 0.02-0.32 (docs/results/blocks_beyond_rag.md); auto
    # escalated both edits there to more than full's cost on an uncalibrated model
    history_mode: str = "blend"
    # --shadow-fraction: share of approximate answers re-run with `full` while the server is idle, their closeness
    # exported per mode in /metrics (serve/shadow.py); never delays a request. --shadow-max-pending bounds the
    # checks waiting at once (each keeps a prompt and one first-token distribution)
    shadow_fraction: float = 0.02
    shadow_max_pending: int = 4


SERVE = ServeDefaults()


def default_store_spec() -> str:
    """Memory in front of a disk tier every process on this machine shares (under $RAGKV_CACHE_DIR)."""
    return f"memory:2GiB,disk:{cache_dir() / 'kv'}:20GiB"


def default_index_dir() -> Path:
    """The document index `ingest`, `ask` and `serve` share."""
    return cache_dir() / "index"


def settings_path() -> Path:
    if os.environ.get("RAGKV_SETTINGS"):
        return Path(os.environ["RAGKV_SETTINGS"]).expanduser()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME", "~/.config")).expanduser()
    return config_home / "ragkv" / "settings.toml"


class SettingsError(RagkvError):
    pass


def load_settings(path: Path | None = None) -> dict:
    """The settings file as a dict ({} when there is none); a clear error when it is not valid TOML."""
    path = path or settings_path()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SettingsError(f"settings file {path} is not valid TOML: {e}") from e


def normalize_key(key: str) -> str:
    return key.replace("-", "_")
