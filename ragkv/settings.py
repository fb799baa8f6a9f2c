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
from pathlib import Path

from ragkv.config import cache_dir
from ragkv.errors import RagkvError

DEFAULT_MODEL = "smollm2"
DEFAULT_DTYPE = "auto"     # bf16 where the hardware runs it fast, else fp32 (ragkv.config.resolve_dtype)
DEFAULT_NAMESPACE = "default"


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
