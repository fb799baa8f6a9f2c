import json

import pytest
import torch

from ragkv.store import serde
from ragkv.store.errors import CorruptEntryError, EntryMismatchError
from store_helpers import L, make_key, make_kv, same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    key, kv = make_key(), make_kv(dtype=dtype)
    data = serde.encode(key, kv)
    assert same(serde.decode(bytes(data), key), kv)
    assert same(serde.decode(data), kv)


def test_header_describes_entry_and_payload_is_aligned():
    key, kv = make_key(), make_kv(dtype=torch.bfloat16)
    data = serde.encode(key, kv)
    h = serde.parse_header(data[:serde.HEADER_PROBE])
    assert h.key() == key and h.digest == key.digest()
    assert h.dtype == "bfloat16" and h.shape == tuple(kv.keys.shape) and h.num_tokens == key.num_tokens
    assert h.payload_offset % serde.ALIGN == 0
    assert h.total_nbytes == len(data) and h.payload_nbytes == kv.nbytes
    assert len(h.layer_offsets) == len(h.layer_crc32) == L


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_layer_decodes_alone(dtype):
    key, kv = make_key(), make_kv(dtype=dtype)
    data = serde.encode(key, kv)
    h = serde.parse_header(data)
    for i in range(L):
        start, stop = h.layer_span(i)
        k, v = serde.decode_layer(h, i, bytes(data[start:stop]))
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])


def test_empty_block_round_trips():
    kv = make_kv(tokens=0)
    assert same(serde.decode(serde.encode(make_key(tokens=0), kv)), kv)


def _corrupt(data: bytearray, where: int) -> bytearray:
    bad = bytearray(data)
    bad[where] ^= 0xFF
    return bad


def test_flipped_payload_byte_is_detected():
    key = make_key()
    data = serde.encode(key, make_kv())
    h = serde.parse_header(data)
    with pytest.raises(CorruptEntryError, match="checksum"):
        serde.decode(_corrupt(data, len(data) - 3), key)
    start, stop = h.layer_span(L - 1)
    with pytest.raises(CorruptEntryError, match="checksum"):
        serde.decode_layer(h, L - 1, _corrupt(data, len(data) - 3)[start:stop])


@pytest.mark.parametrize("where", [0, 9, 20, 40])
def test_damaged_prelude_or_header_is_detected(where):
    data = serde.encode(make_key(), make_kv())
    with pytest.raises(CorruptEntryError):
        serde.decode(_corrupt(data, where))


@pytest.mark.parametrize("cut", [0, 5, 16, 100, -1, -500])
def test_truncation_is_detected(cut):
    data = serde.encode(make_key(), make_kv())
    with pytest.raises(CorruptEntryError):
        serde.decode(data[:cut])


def test_trailing_bytes_are_detected():
    data = serde.encode(make_key(), make_kv())
    with pytest.raises(CorruptEntryError, match="expected"):
        serde.decode(data + b"xx")


def test_short_layer_chunk_is_detected():
    data = serde.encode(make_key(), make_kv())
    h = serde.parse_header(data)
    start, stop = h.layer_span(0)
    with pytest.raises(CorruptEntryError, match="truncated"):
        serde.decode_layer(h, 0, data[start:stop - 4])


def test_other_format_version_is_refused():
    data = serde.encode(make_key(), make_kv())
    end = serde.header_length(data)
    fields = json.loads(bytes(data[serde.PRELUDE.size:end]))
    fields["version"] = 99
    header = json.dumps(fields, separators=(",", ":")).encode()
    header = header.ljust(end - serde.PRELUDE.size)
    import zlib
    forged = serde.PRELUDE.pack(serde.MAGIC, len(header), zlib.crc32(header)) + header + bytes(data[end:])
    with pytest.raises(CorruptEntryError, match="version 99"):
        serde.decode(forged)


@pytest.mark.parametrize("other", [
    make_key(fingerprint="fp-b"),          # another model / dtype / RoPE configuration (all in the fingerprint)
    make_key(conditioning="prefix:abc"),   # another conditioning
    make_key(namespace="tenant-b"),        # another tenant
    make_key(1),                           # other tokens
])
def test_entry_is_refused_for_another_key(other):
    """docs/invariants.md, invariant 8: an entry is only returned for the key it was written for."""
    data = serde.encode(make_key(), make_kv())
    with pytest.raises(EntryMismatchError):
        serde.decode(data, other)


def test_unsupported_dtype_is_a_clear_error():
    kv = make_kv()
    kv = type(kv)(kv.keys.to(torch.int32), kv.values.to(torch.int32))
    with pytest.raises(TypeError, match="supported"):
        serde.encode(make_key(), kv)
