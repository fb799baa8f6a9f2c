"""Architecture hyper-parameters read from a Hugging Face config.json (Llama, Mistral, Qwen2 families)."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import UnsupportedModelError
from ragkv.ops.rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool
    tie_embeddings: bool
    rope: RopeConfig
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Raises UnsupportedModelError naming the field for anything missing, mistyped or out of range."""
        if not isinstance(cfg, dict):
            raise UnsupportedModelError(f"config.json holds a {type(cfg).__name__}, not an object")
        try:
            args = cls._from_hf_config(cfg)
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise UnsupportedModelError(f"config.json has a value of the wrong type or range ({e})") from None
        args.check()
        return args

    def check(self) -> None:
        """Sizes that are positive integers and fit together, before anything is allocated."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UnsupportedModelError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                                        f"num_key_value_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0:
            raise UnsupportedModelError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @classmethod
    def _from_hf_config(cls, cfg: dict) -> "ModelArgs":
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mtype!r} is not supported; ragkv runs {', '.join(SUPPORTED_MODEL_TYPES)} models")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers 5.x keeps theta and scaling in rope_parameters; 4.x in rope_theta + rope_scaling.
        rp = dict(cfg.get("rope_parameters") or {})
        rs = dict(cfg.get("rope_scaling") or {})
        params = {**rs, **rp}
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
        rope = RopeConfig(
            head_dim=head_dim, theta=theta, scaling=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
        )
        window = cfg.get("sliding_window") if (mtype == "mistral" or cfg.get("use_sliding_window")) else None
        return cls(
            model_type=mtype, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or mtype == "qwen2",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=rope, sliding_window=window,
        )
