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
    """`ragkv.engine.fusion` -> "engine"; `ragkv.config` -> "config"; `ragkv` -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return a == b or RANK[b] < RANK[a]
