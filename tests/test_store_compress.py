"""Compressed KV in the store (`?kv=int8|int4|fp8`, ragkv.store.compress): the quantizer's error bounds, the spec
option, tiers returning working-dtype tensors, the engine's logits against an uncompressed store, the bytes kept,
the loading controller's pricing, and corrupt compressed entries recomputed."""

import math
import os

import pytest
import torch
from store_helpers import H, L, make_key, make_kv
from tiny import make_segs

from ragkv.engine.blocks.loading import schedule_loads
from ragkv.engine.kv.state import decode_step
from ragkv.engine.options import FusionOptions
from ragkv.eval.metrics import first_token_kl
from ragkv.store import compress, serde, spec
from ragkv.store.base import BlockKV
from ragkv.store.compress import CODECS, codec_named
from ragkv.store.disk import DiskStore
from ragkv.store.errors import StoreSpecError
from ragkv.store.memory import MemoryStore
from ragkv.store.probe import tier_layer_nbytes
from ragkv.store.redis_store import RedisStore
from ragkv.store.spec import DiskTierSpec, MemoryTierSpec, open_store, parse_spec


def _kv(tokens=200, dim=64, seed=0, dtype=torch.float32):
    """Keys with two outlier channels (as real pre-RoPE keys have), values per token of very different size."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, tokens, dim, generator=g)
    keys[..., 5] *= 40
    keys[..., 17] += 25
    values = torch.randn(3, 2, tokens, dim, generator=g) * torch.rand(3, 2, tokens, 1, generator=g).mul(8)
    return BlockKV(keys.to(dtype), values.to(dtype))


def _scales(c, name):
    """The scale each stored element was quantized with, [L, H, T, D]: keys one per channel per group of tokens,
    values one per token per group of channels."""
    T, D = c.shape[2], c.shape[3]
    s = c.parts[f"{name}_scale"].float()
    if name == "k":
        return s.repeat_interleave(c.codec.key_group, dim=-2)[..., :T, :]
    return s.repeat_interleave(D // s.shape[-1], dim=-1)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_integer_round_trip_error_is_at_most_half_a_scale(codec, tokens):
    kv = _kv(tokens)
    c = CODECS[codec].compress(kv)
    out = c.decompress()
    for name, x, y in (("k", kv.keys, out.keys), ("v", kv.values, out.values)):
        s = _scales(c, name)
        err = (x - y).abs()
        # no element clipped (scales are rounded outward); fp32's own rounding of q * s and of x - min on top
        assert (err <= s / 2 + x.abs() * 2 ** -22 + 1e-7).all()
        if tokens > 1:  # the bound is tight: some element is that far off (a 1-token key group is nearly exact)
            assert (err / s.clamp_min(1e-12)).max() > 0.4


@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_fp8_round_trip_error_is_relative(tokens):
    kv = _kv(tokens)
    c = CODECS["fp8"].compress(kv)
    out = c.decompress()
    for name, x, y in (("k", kv.keys, out.keys), ("v", kv.values, out.values)):
        s = _scales(c, name)
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the magnitude, 2^-10 of the scale below 2^-6
        bound = torch.maximum(x.abs() / 16, s / 1024)
        assert ((x - y).abs() <= bound * (1 + 1e-5) + 1e-7).all()


def test_keys_are_quantized_per_channel_and_values_per_token():
    """KIVI's layout: an outlier key channel does not coarsen the other channels, a large value token does not
    coarsen the other tokens."""
    kv = _kv(128)
    c = CODECS["int8"].compress(kv)
    out = c.decompress()
    k_err = (kv.keys - out.keys).abs().amax(dim=(0, 1, 2))       # per channel
    assert k_err[5] > 10 * k_err[[i for i in range(64) if i not in (5, 17)]].max()
    v_scale = c.parts["v_scale"].float()                          # [L, H, T, 1]: one scale per token and head
    assert v_scale.shape == (3, 2, 128, 1)
    want = kv.values.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(v_scale, want, rtol=2 ** -7)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_compression_stays_on_the_tensors_device(codec):
    """Quantizing runs where the KV is: on the meta device every op would fail to reach the host."""
    kv = BlockKV(torch.empty(2, 2, 40, 64, device="meta"), torch.empty(2, 2, 40, 64, device="meta"))
    parts = CODECS[codec].compress(kv).parts
    assert {t.device.type for t in parts.values()} == {"meta"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_cuda_blocks_compress_on_the_gpu_and_load_back(codec, tmp_path):
    kv = _kv(64)
    gpu = BlockKV(kv.keys.cuda(), kv.values.cuda())
    assert {t.device.type for t in CODECS[codec].compress(gpu).parts.values()} == {"cuda"}
    store = DiskStore(tmp_path, 1 << 30, kv=codec)
    store.put(make_key(tokens=64), gpu)
    got = store.get(make_key(tokens=64))
    assert torch.allclose(got.keys, CODECS[codec].compress(kv).decompress().keys, rtol=1e-6, atol=1e-6)


# --- the spec option ---------------------------------------------------------------------------------------

def test_spec_parses_kv_per_tier():
    spec = parse_spec("memory:1GiB?kv=int8,disk:/tmp/kv:20GiB?cost=0.02&kv=INT4,redis://h:6379/0?ttl=60&kv=fp8")
    assert spec.tiers[0] == MemoryTierSpec(1 << 30, None, "int8")
    assert spec.tiers[1] == DiskTierSpec(parse_spec("disk:/tmp/kv").tiers[0].path, 20 << 30, 0.02, "int4")
    assert spec.tiers[2].kv == "fp8" and spec.tiers[2].url == "redis://h:6379/0"  # not handed to redis-py
    assert parse_spec("disk:/tmp/kv?kv=none").tiers[0].kv is None
    assert parse_spec("disk:/tmp/kv").tiers[0].kv is None


@pytest.mark.parametrize("text", ["disk:/tmp/kv?kv=int3", "memory:1GiB?kv=", "redis://h:6379/0?kv=zstd"])
def test_spec_refuses_unknown_kv_naming_the_choices(text):
    with pytest.raises(StoreSpecError, match=r"kv .* choose one of none, int8, int4, fp8"):
        parse_spec(text)


def test_spec_choices_are_the_codecs():
    assert spec.KV_CHOICES == compress.KV_CHOICES  # the spec parses without importing torch, so it repeats them


def test_open_store_builds_compressed_tiers(tmp_path):
    store = open_store(f"memory:1GiB,disk:{tmp_path}:1GiB?kv=int8")
    assert store.tiers[0].kv_codec is None and store.tiers[1].kv_codec is CODECS["int8"]
    assert store.tiers[1].describe().endswith("?kv=int8") and store.stats()["tiers"][1]["kv"] == "int8"
    with pytest.raises(ValueError, match="unknown KV codec 'int3'"):
        codec_named("int3")


# --- tiers return the working dtype and shape ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_tiered_store_with_compressed_disk_returns_working_tensors(tmp_path, dtype, codec):
    store = open_store(f"memory:1GiB,disk:{tmp_path}:1GiB?kv={codec}")
    key, kv = make_key(), make_kv(dtype=dtype)
    store.put(key, kv)
    disk = store.tiers[1]
    want = CODECS[codec].compress(kv).decompress()
    for got in (disk.get(key), BlockKV(*[torch.stack(x) for x in zip(*(disk.get_layer(key, i) for i in range(L)))])):
        assert got.dtype == dtype and got.keys.shape == kv.keys.shape
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    store.tiers[0].clear()  # read through the tiered store from disk
    layers = list(store.iter_layers([key], L))
    assert all(k.dtype == dtype and torch.equal(k, want.keys[i]) for i, [(k, v)] in enumerate(layers))
    assert torch.equal(store.get(key).values, want.values)  # and promoted into the exact memory tier
    assert torch.equal(store.tiers[0].get(key).values, want.values)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_compressed_memory_tier_counts_compressed_bytes(codec):
    store = MemoryStore(kv=codec)
    key, kv = make_key(), make_kv(dtype=torch.bfloat16)
    store.put(key, kv)
    assert store.stats()["bytes"] == CODECS[codec].compress(kv).nbytes < kv.nbytes
    with store.open_layers(key) as reader:
        k, v = reader.read(2)
    assert k.dtype == torch.bfloat16 and torch.equal(v, CODECS[codec].compress(kv).decompress().values[2])


def test_redis_tier_stores_compressed_entries(redis_url):
    store = RedisStore(redis_url, kv="int8")
    key, kv = make_key(), make_kv()
    store.put(key, kv)
    assert store.describe().endswith("?kv=int8")
    assert len(store.client.get(store._name(key))) == len(serde.encode(key, kv, CODECS["int8"]))
    assert torch.equal(store.get_layer(key, 1)[0], CODECS["int8"].compress(kv).decompress().keys[1])
    assert torch.equal(RedisStore(redis_url).get(key).values, store.get(key).values)  # any reader decodes it


# --- bytes ---------------------------------------------------------------------------------------------------

def test_stored_bytes_against_bf16():
    """A 200-token block of SmolLM2-shaped layers (3 KV heads of 64 channels): int4 at <= 0.5x bf16's bytes;
    int8 and fp8 at 0.5x plus their scales (one per key channel per 128 tokens, one per value token and head)."""
    g = torch.Generator().manual_seed(0)
    kv = BlockKV(torch.randn(4, 3, 200, 64, generator=g).bfloat16(), torch.randn(4, 3, 200, 64, generator=g).bfloat16())
    key = make_key(tokens=200)
    bf16 = len(serde.encode(key, kv))
    sizes = {name: len(serde.encode(key, kv, c)) for name, c in CODECS.items()}
    assert sizes["int4"] <= 0.5 * bf16
    # int8 alone is exactly half; the scales add 2 bytes per key channel per 128 tokens (2 groups here) and 2 per
    # value token and head, i.e. (2 * 2 * 64 / 200 + 2) / (2 * 2 * 64) of bf16's bytes = 1.3% at 200 tokens
    overhead = (2 * math.ceil(200 / 128) * 64 / 200 + 2) / (2 * 2 * 64)
    assert 0.5 * bf16 < sizes["int8"] == sizes["fp8"] <= (0.5 + overhead) * bf16 + 512  # + the header
    assert len(serde.encode(key, BlockKV(kv.keys.float(), kv.values.float()), CODECS["int8"])) == sizes["int8"]


# --- the loading controller prices what a tier loads ---------------------------------------------------------

@pytest.mark.parametrize("codec", [None, "int8", "int4", "fp8"])
def test_tier_layer_nbytes_is_what_the_tier_stores(tmp_path, codec):
    disk = DiskStore(tmp_path, 1 << 30, kv=codec)
    key, kv = make_key(), make_kv()
    disk.put(key, kv)
    h = serde.parse_header((tmp_path / f"{key.digest()}.kv").read_bytes())
    assert tier_layer_nbytes(disk, H, kv.num_tokens, kv.keys.shape[-1], kv.dtype) == h.layer_nbytes


def test_schedule_loads_prices_each_holders_own_size():
    """Equal bandwidth: the compressed holder loads half the bytes, so it is chosen and the load time halves."""
    holders = {"disk": 1e9, "disk?kv=int8": 1e9}
    plan = schedule_loads([(100, {"disk": 2e6, "disk?kv=int8": 1e6}, holders)], s_per_token_layer=1e-6)
    assert plan.tiers == ("disk?kv=int8",) and plan.load_ms_per_layer == pytest.approx(1.0)
    slower = schedule_loads([(100, {"disk": 2e6, "disk?kv=int8": 1e6}, {"disk": 1e9, "disk?kv=int8": 0.4e9})], 1e-6)
    assert slower.tiers == ("disk",)
    assert schedule_loads([(100, 2e6, holders)], 1e-6).load_ms_per_layer == pytest.approx(2.0)  # one size for all


# --- the engine -------------------------------------------------------------------------------------------

def _decode(engine, segs, fusion, tokens: list[int], n: int = 8):
    """First-token logits, then the logits after each of `n` tokens (`tokens`, or the greedy ones, appended to
    it): the later ones check the KV the store gave, left in the cache."""
    state, stats = engine.prefill(segs, fusion, max_new_tokens=n)
    out = [state.logits]
    for i in range(n):
        if len(tokens) <= i:
            tokens.append(int(out[-1].argmax()))
        out.append(decode_step(engine.model, state, tokens[i]))
    return torch.stack(out), stats


@pytest.mark.parametrize("mode", ["reuse", "blend"])
def test_engine_with_int8_store_is_close_to_the_uncompressed_store(tiny_engine, tmp_path, mode):
    """Tolerance: the int8 store may move the first-token distribution by at most 1% of what the mode itself
    moves it from `full` (KL), and any logit by 0.02 (logits span ~1 on the tiny model; measured ~5e-3)."""
    segs, fusion = make_segs(), FusionOptions(mode=mode)
    full, _ = tiny_engine().prefill(segs, FusionOptions(mode="full"))
    exact = tiny_engine(store=open_store(f"disk:{tmp_path / 'exact'}:1GiB"))
    squeezed = tiny_engine(store=open_store(f"disk:{tmp_path / 'int8'}:1GiB?kv=int8"))
    squeezed.warm(segs)
    tokens = []  # the uncompressed store's greedy continuation, then fed to the int8 one
    a, _ = _decode(exact, segs, fusion, tokens)
    b, stats = _decode(squeezed, segs, fusion, tokens)
    assert stats.cache_hits == len(segs.blocks) + 1  # read back from the compressed disk tier
    assert not torch.equal(a, b)                     # compression really changed the KV
    assert (a - b).abs().max() <= 0.02
    assert first_token_kl(a[0], b[0]) <= 0.01 * first_token_kl(full.logits, a[0])
    assert (a.argmax(-1) == b.argmax(-1)).all()      # the same greedy tokens all along


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_compressed_entry_is_recomputed(tiny_engine, tmp_path, where):
    store = open_store(f"disk:{tmp_path}:1GiB?kv=int8")
    engine, segs, fusion = tiny_engine(store=store), make_segs(), FusionOptions(mode="reuse")
    good, _ = engine.prefill(segs, fusion)
    disk = store.tiers[0]
    path = sorted(disk.root.glob("*.kv"), key=os.path.getsize)[-1]
    _flip(path, os.path.getsize(path) - 7 if where == "payload" else 40)
    state, stats = engine.prefill(segs, fusion)  # never fails: the block is computed again
    assert disk.counters["corrupt"] == 1
    if where == "payload":  # found mid-read: the request starts over, the dropped entry a miss, the others hits
        assert "store_fault" in stats.extra
    assert stats.cache_misses == 1 and torch.equal(state.logits, good.logits)
    assert engine.prefill(segs, fusion)[1].cache_hits == len(segs.blocks) + 1


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_head_by_head_decompression_equals_one_pass(codec, monkeypatch):
    """Big CPU blocks are decompressed head by head (below torch's parallel grain): the same numbers."""
    c = CODECS[codec].compress(_kv(300))
    split = c.decompress()
    monkeypatch.setattr(compress, "INLINE_ELEMENTS", 1 << 40)
    whole = c.decompress()
    assert torch.equal(split.keys, whole.keys) and torch.equal(split.values, whole.values)


@pytest.mark.parametrize("kv", [("int3",), ("int8", "int8"), ("none",)])
def test_store_bench_refuses_unknown_or_repeated_codecs(kv):
    from ragkv.bench.store import StoreBenchConfig
    from ragkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="compare_kv .* choose among int8, int4, fp8"):
        StoreBenchConfig(compare_kv=kv)
