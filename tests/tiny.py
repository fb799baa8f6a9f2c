"""Tiny random Hugging Face checkpoints (Llama, Llama-3 RoPE scaling, Mistral, Qwen2) for the fast suite."""

from __future__ import annotations

from pathlib import Path

import torch

from ragkv.models.registry import converted_path, is_converted

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def make_tiny(arch: str, root: Path, seed: int = 0) -> Path:
    """Save a random tiny model of `arch` with the default model's tokenizer (if converted) or none."""
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    # Larger-than-init weights make attention patterns sharp, so equivalence tests can fail for real.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    out = root / arch
    model.save_pretrained(str(out))
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def default_model_available() -> bool:
    return is_converted(converted_path("smollm2"))


def rand_ids(n: int, seed: int) -> list[int]:
    """Token ids inside the tiny vocabulary, reproducible per seed."""
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class IdText:
    """A tokenizer's decode for tiny models, which carry none: each token's text is "<id>"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def make_segs(prefix=12, blocks=(20, 17, 25), query=9, seed=0):
    """Random prefix / blocks / query segments of the given lengths."""
    from ragkv.engine.request.segments import Segments

    return Segments(prefix=rand_ids(prefix, seed) if prefix else [],
                    blocks=[rand_ids(n, seed + 10 + i) for i, n in enumerate(blocks)],
                    query=rand_ids(query, seed + 99))


def make_tiny_served(root: Path, seed: int = 0) -> Path:
    """A tiny random Llama that `ragkv serve --model PATH` can serve: a byte-level tokenizer (one token per byte,
    no merges) with a chat template, 8K positions, and KV large enough (8 KiB per token in fp32) for memory to
    show in the server's RSS."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192,
                                   eos_token_id=256)
    out = root / "tiny-served"
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(str(out))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(out))
    return out
