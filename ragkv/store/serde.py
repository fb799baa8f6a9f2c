"""BlockKV <-> bytes, shared by the disk and Redis tiers.

Layout: a 16-byte prelude (magic, header length, crc32 of the header), a JSON header padded so the payload starts
64-byte aligned, then the payload layer by layer, each layer its K [Hkv, T, D] then its V, so one layer can be
read alone with a seek or a GETRANGE. Every layer carries its own crc32, checked whenever it is read.
The header repeats the full cache key: an entry is only ever returned for the key it was written for
(docs/invariants.md, invariant 8). Tensors go through `.view(torch.uint8)`, so bf16 round-trips bit-exactly.
A compressed entry (format 2, header field `kv`: a codec of ragkv.store.compress) stores each layer as the codec's
parts, each 8-byte aligned, and decodes into the header's `dtype`; any reader decodes any codec. Uncompressed
entries are still written as format 1, so caches written before stay readable.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch
from zlib_ng import zlib_ng as zlib  # the same crc32 as the stdlib's, SIMD: ~3x faster on every cache read

from ragkv.store.base import BlockKV, CacheKey
from ragkv.store.compress import CODECS, Codec, layer_nbytes, padded
from ragkv.store.errors import CorruptEntryError, EntryMismatchError

MAGIC = b"RAGKVKV\x00"
FORMAT_VERSION = 1             # uncompressed entries
COMPRESSED_FORMAT_VERSION = 2  # entries with a `kv` codec
PRELUDE = struct.Struct("<8sII")  # magic, header length (padded), crc32 of the header bytes
ALIGN = 64
HEADER_PROBE = 4096  # first read: holds the header of models with up to ~150 layers
MAX_HEADER = 1 << 20

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


@dataclass(frozen=True)
class EntryHeader:
    version: int
    digest: str
    fingerprint: str
    conditioning: str
    token_hash: str
    num_tokens: int
    namespace: str
    dtype: str
    shape: tuple[int, int, int, int]  # L, Hkv, T, D
    layer_offsets: tuple[int, ...]    # from payload_offset; layer i = K then V
    layer_nbytes: int
    layer_crc32: tuple[int, ...]
    payload_offset: int               # absolute: prelude + padded header
    kv: str = "none"                  # the codec of a compressed entry (ragkv.store.compress.CODECS)

    @property
    def codec(self) -> Codec | None:
        return CODECS.get(self.kv)

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def payload_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.payload_offset + self.payload_nbytes

    def key(self) -> CacheKey:
        return CacheKey(self.fingerprint, self.conditioning, self.token_hash, self.num_tokens, self.namespace)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Absolute [start, stop) byte range of one layer."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for an entry with {self.num_layers} layers")
        start = self.payload_offset + self.layer_offsets[layer]
        return start, start + self.layer_nbytes

    def check_key(self, key: CacheKey) -> None:
        if self.key() != key:
            raise EntryMismatchError(
                f"entry {self.digest} was written for another key (fingerprint {self.fingerprint}, conditioning "
                f"{self.conditioning!r}, namespace {self.namespace!r}); refusing it for {key.digest()}")


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"cannot store KV of dtype {dtype}; supported: {', '.join(DTYPES)}")


def _layer_pieces(kv: BlockKV, codec: Codec | None) -> tuple[str, list[list[tuple[torch.Tensor, int]]]]:
    """Per layer, its byte pieces with the size each takes (padding included), on the CPU."""
    if codec is None:
        keys, values = kv.keys.detach().cpu(), kv.values.detach().cpu()
        return _dtype_name(keys.dtype), [[(_byte_view(t[i]), t[i].numel() * t.element_size()) for t in (keys, values)]
                                         for i in range(kv.num_layers)]
    dtype = _dtype_name(kv.dtype)
    # quantized where the tensors are; only the compressed parts cross to the host
    parts = {n: t.cpu() for n, t in codec.compress(BlockKV(kv.keys.detach(), kv.values.detach())).parts.items()}
    _, H, T, D = kv.keys.shape
    names = [n for n, _, _ in codec.part_shapes(H, T, D)]
    return dtype, [[(_byte_view(parts[n][i]), padded(parts[n][i].numel() * parts[n].element_size())) for n in names]
                   for i in range(kv.num_layers)]


def encode(key: CacheKey, kv: BlockKV, codec: Codec | None = None) -> bytearray:
    """Serialize `kv` for `key`, compressed with `codec` (None: as is; tensors are copied to CPU)."""
    L, H, T, D = kv.keys.shape
    dtype, layers = _layer_pieces(kv, codec)
    size = sum(n for _, n in layers[0]) if layers else 0
    crcs = []
    for pieces in layers:
        crc = 0
        for t, n in pieces:
            crc = zlib.crc32(t.numpy(), crc)
            crc = zlib.crc32(bytes(n - t.numel()), crc)  # alignment padding (zeros) is checked as well
        crcs.append(crc)
    fields = dict(version=FORMAT_VERSION, digest=key.digest(), fingerprint=key.fingerprint,
                  conditioning=key.conditioning, token_hash=key.token_hash, num_tokens=key.num_tokens,
                  namespace=key.namespace, dtype=dtype, shape=[L, H, T, D],
                  layer_offsets=[i * size for i in range(L)], layer_nbytes=size, layer_crc32=crcs)
    if codec is not None:
        fields.update(version=COMPRESSED_FORMAT_VERSION, kv=codec.name)
    header = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    header += b" " * (-(PRELUDE.size + len(header)) % ALIGN)
    offset = PRELUDE.size + len(header)
    out = bytearray(offset + L * size)
    out[:offset] = PRELUDE.pack(MAGIC, len(header), zlib.crc32(header)) + header
    if size:
        buf = torch.frombuffer(out, dtype=torch.uint8)
        o = offset
        for pieces in layers:
            for t, n in pieces:
                buf[o:o + t.numel()].copy_(t)
                o += n
    return out


def header_length(prefix) -> int:
    """Bytes from the start of an entry to its payload, read from its first 16 bytes."""
    if len(prefix) < PRELUDE.size:
        raise CorruptEntryError(f"entry is {len(prefix)} bytes, shorter than its {PRELUDE.size}-byte prelude")
    magic, hlen, _ = PRELUDE.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptEntryError("not a ragkv KV entry (bad magic bytes)")
    if hlen > MAX_HEADER:
        raise CorruptEntryError(f"implausible header length {hlen}")
    return PRELUDE.size + hlen


def parse_header(data) -> EntryHeader:
    """Parse and validate the header at the start of `data` (which may end anywhere after the header)."""
    end = header_length(data)
    if len(data) < end:
        raise CorruptEntryError(f"entry truncated inside its header ({len(data)} of {end} bytes)")
    _, _, crc = PRELUDE.unpack_from(data)
    raw = bytes(data[PRELUDE.size:end])
    if zlib.crc32(raw) != crc:
        raise CorruptEntryError("header checksum mismatch")
    try:
        f = json.loads(raw)
        h = EntryHeader(version=int(f["version"]), digest=str(f["digest"]), fingerprint=str(f["fingerprint"]),
                        conditioning=str(f["conditioning"]), token_hash=str(f["token_hash"]),
                        num_tokens=int(f["num_tokens"]), namespace=str(f["namespace"]), dtype=str(f["dtype"]),
                        shape=tuple(int(x) for x in f["shape"]),
                        layer_offsets=tuple(int(x) for x in f["layer_offsets"]),
                        layer_nbytes=int(f["layer_nbytes"]), layer_crc32=tuple(int(x) for x in f["layer_crc32"]),
                        payload_offset=end, kv=str(f.get("kv", "none")))
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntryError(f"unreadable entry header: {e}") from e
    _validate(h)
    return h


def _validate(h: EntryHeader) -> None:
    if h.version not in (FORMAT_VERSION, COMPRESSED_FORMAT_VERSION):
        raise CorruptEntryError(f"entry format version {h.version} is not readable by this ragkv "
                                f"(expects {FORMAT_VERSION} or {COMPRESSED_FORMAT_VERSION}); it will be recomputed")
    if (h.version == COMPRESSED_FORMAT_VERSION) != (h.codec is not None):
        raise CorruptEntryError(f"entry format version {h.version} disagrees with its codec {h.kv!r}")
    if h.dtype not in DTYPES or len(h.shape) != 4 or min(h.shape) < 0:
        raise CorruptEntryError(f"bad dtype/shape in header: {h.dtype} {h.shape}")
    L, H, T, D = h.shape
    if h.codec is not None and h.codec.name == "int4" and D % 2:
        raise CorruptEntryError(f"int4 entry with an odd head_dim {D}")
    if h.layer_nbytes != layer_nbytes(h.codec, H, T, D, DTYPES[h.dtype]):
        raise CorruptEntryError("header layer size disagrees with its shape, dtype and codec")
    if h.layer_offsets != tuple(i * h.layer_nbytes for i in range(L)) or len(h.layer_crc32) != L:
        raise CorruptEntryError("header layer offsets or checksums disagree with its shape")
    if h.key().digest() != h.digest:
        raise CorruptEntryError("header key fields disagree with its digest")


def _check_crc(h: EntryHeader, layer: int, chunk) -> None:
    if zlib.crc32(chunk) != h.layer_crc32[layer]:
        raise CorruptEntryError(f"checksum mismatch in layer {layer} of entry {h.digest}")


def _writable(data):
    # torch.frombuffer over immutable bytes would alias read-only memory
    return data if isinstance(data, bytearray) else bytearray(data)


def _tensor(h: EntryHeader, data, offset: int, layers: int) -> torch.Tensor:
    """[layers, 2, Hkv, T, D] over `data` without copying (uncompressed entries)."""
    _, H, T, D = h.shape
    n = layers * h.layer_nbytes
    if n == 0:
        return torch.empty((layers, 2, H, T, D), dtype=h.torch_dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=n)
    return flat.view(h.torch_dtype).view(layers, 2, H, T, D)


def _parts(h: EntryHeader, data, offset: int) -> dict[str, torch.Tensor]:
    """The codec's parts of the layer at `offset` of `data`, viewed in place (each starts 8-byte aligned)."""
    _, H, T, D = h.shape
    out = {}
    for name, dtype, shape in h.codec.part_shapes(H, T, D):
        n = math.prod(shape) * dtype.itemsize
        raw = (torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=n) if n
               else torch.empty(0, dtype=torch.uint8))
        out[name] = raw.view(dtype).view(shape)
        offset += padded(n)
    return out


def _layer(h: EntryHeader, data, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    if h.codec is None:
        x = _tensor(h, data, offset, 1)[0]
        return x[0], x[1]
    return h.codec.decompress(_parts(h, data, offset), h.torch_dtype)


def decode(data, key: CacheKey | None = None) -> BlockKV:
    """Validate and deserialize a whole entry; with `key`, also refuse an entry written for another key.

    Raises:
        CorruptEntryError: bad magic/header/checksum, truncated or trailing bytes.
        EntryMismatchError: the entry belongs to another key.
    """
    h = parse_header(data)
    if key is not None:
        h.check_key(key)
    if len(data) != h.total_nbytes:
        raise CorruptEntryError(f"entry {h.digest} is {len(data)} bytes, expected {h.total_nbytes} (truncated?)")
    view = memoryview(data)
    for i in range(h.num_layers):
        start, stop = h.layer_span(i)
        _check_crc(h, i, view[start:stop])
    data = _writable(data)
    if h.codec is None:
        x = _tensor(h, data, h.payload_offset, h.num_layers)
        return BlockKV(x[:, 0], x[:, 1])
    _, H, T, D = h.shape
    if not h.num_layers:
        return BlockKV(torch.empty((0, H, T, D), dtype=h.torch_dtype), torch.empty((0, H, T, D), dtype=h.torch_dtype))
    layers = [_layer(h, data, h.layer_span(i)[0]) for i in range(h.num_layers)]
    return BlockKV(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]))


def decode_layer(h: EntryHeader, layer: int, chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (K, V) [Hkv, T, D] from exactly the bytes of `h.layer_span(layer)`, decompressed into the
    entry's dtype."""
    if len(chunk) != h.layer_nbytes:
        raise CorruptEntryError(f"layer {layer} of entry {h.digest} is {len(chunk)} bytes, expected "
                                f"{h.layer_nbytes} (truncated?)")
    _check_crc(h, layer, chunk)
    return _layer(h, _writable(chunk), 0)
