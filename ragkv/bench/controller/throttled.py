"""The throttled tier: an in-memory tier whose every layer read waits (a fixed delay per block and layer, or a
bandwidth limit), so that loading matters on a machine where every real tier is fast next to the model."""

from __future__ import annotations

import time

from ragkv.store.base import KVStore, LayerReader


class ThrottledStore(KVStore):
    """A KVStore wrapper whose every layer read of a block waits `delay_s + nbytes / bytes_per_s` first (a slow
    remote tier, simulated with sleeps that leave the CPU to the compute). The wrapped tier holds the data."""

    name = "throttled"

    def __init__(self, inner: KVStore, delay_s: float = 0.0, bytes_per_s: float | None = None, label: str = ""):
        if delay_s < 0 or (bytes_per_s is not None and bytes_per_s <= 0):
            raise ValueError("a throttle wants delay_s >= 0 and bytes_per_s > 0")
        self.inner, self.delay_s, self.bytes_per_s, self.label = inner, delay_s, bytes_per_s, label
        self.reads = 0           # layer reads served (each one waited)

    def describe(self) -> str:   # also its bandwidth-profile id: unique per throttle setting and run
        bw = f",{self.bytes_per_s / 1e6:.3g}MB/s" if self.bytes_per_s else ""
        return f"throttled({self.delay_s * 1e3:.3g}ms/layer{bw}{',' + self.label if self.label else ''})"

    def wait_s(self, nbytes: int) -> float:
        return self.delay_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def get(self, key):
        kv = self.inner.get(key)
        if kv is not None:
            time.sleep(kv.num_layers * self.wait_s(kv.nbytes // max(1, kv.num_layers)))
        return kv

    def put(self, key, kv):
        self.inner.put(key, kv)

    def contains(self, key):
        return self.inner.contains(key)

    def delete(self, key):
        return self.inner.delete(key)

    def clear(self, namespace=None):
        return self.inner.clear(namespace)

    def open_layers(self, key):
        reader = self.inner.open_layers(key)
        return None if reader is None else _ThrottledReader(self, reader)

    def stats(self):
        return {**self.inner.stats(), "tier": self.name, "describe": self.describe(), "throttled_reads": self.reads}


class _ThrottledReader(LayerReader):
    instant = False  # never an in-memory view: the tiered store pipelines it

    def __init__(self, store: ThrottledStore, inner: LayerReader):
        super().__init__(inner.key, inner.num_layers)
        self.store, self.inner = store, inner

    def read(self, layer):
        kv = self.inner.read(layer)
        if kv is not None:
            time.sleep(self.store.wait_s(2 * kv[0].numel() * kv[0].element_size()))
            self.store.reads += 1
        return kv

    def close(self):
        self.inner.close()
