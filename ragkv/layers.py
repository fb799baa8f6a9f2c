"""The layer order of the package, in one place: a module may import its own package and any lower layer, never
a higher one nor a sibling on its own layer. `tests/test_layers.py` walks every module's imports and enforces it.

A request flows down through these layers: cli (flags) -> serve (HTTP) / bench -> rag / eval -> engine
(segments -> cache keys -> re-rotation -> fusion -> decode) -> store (tensors and bytes) / models -> ops.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "net", "layers", "__init__"),  # leaf helpers: errors, free ports
    ("config", "figures"),  # paths, device and dtype from the environment; headless plots
    ("settings",),         # the defaults every command and the server share, and the settings file
    ("ops",),              # attention, RoPE, the decode kernel: tensors only
    ("models", "store"),   # the model runner; the KV store (knows tensors and bytes, not requests)
    ("engine",),           # a request's segments -> cache keys -> store -> fusion -> decode
    ("rag", "eval"),       # documents and retrieval; evaluation harness and datasets
    ("train", "serve"),    # block fine-tuning; the HTTP server (knows HTTP, not flags)
    ("bench",),            # every benchmark and results report (config dataclasses, never argparse)
    ("cli", "integrations"),  # every subcommand (the only place flags and the settings file become configs);
                              # LangChain and LlamaIndex adapters (HTTP clients of `ragkv serve`)
)

RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str:
    """`ragkv.engine.fusion.context` -> "engine"; `ragkv.config` -> "config"; `ragkv` -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return a == b or RANK[b] < RANK[a]


# Inside the engine, the same rule one level down, along a request's path: its sub-packages (and top modules)
# from the bottom. An import under `if TYPE_CHECKING:` (annotations only) is exempt.
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("measure",),              # per-request counters, FLOPs, risk signals, fidelity estimates
    ("request", "kv"),         # segments, option specs, registries; the KV cache, decode state, prefill
    ("blocks",),               # block keys and encoding, the prefix cache, chat history, the block pool, loading
    ("fusion",),               # layouts and re-rotation, APE, shared block attention, reuse's query
    ("decode", "recompute"),   # sampling, constrained decoding, the batched step; selective recompute (one
                               # module per selection, the rows they share, the Recompute record)
    ("modes",),                # one object per fusion mode
    ("options",),              # a request's options (their choices: the modes')
    ("engine",),               # the Engine: a request's whole path
)

ENGINE_RANK = {name: rank for rank, names in enumerate(ENGINE_LAYERS) for name in names}


def engine_part(module: str) -> str | None:
    """`ragkv.engine.fusion.context` -> "fusion"; `ragkv.engine.engine` -> "engine"; outside the engine: None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["ragkv", "engine"] else None


def engine_allowed(importer: str, imported: str) -> bool:
    a, b = engine_part(importer), engine_part(imported)
    return a is None or b is None or a == b or ENGINE_RANK[b] < ENGINE_RANK[a]
