"""Errors raised by the KV store. A cache miss is `None`, never one of these."""

from __future__ import annotations

from ragkv.errors import RagkvError


class StoreError(RagkvError):
    """Base class for store configuration and availability problems."""


class StoreSpecError(StoreError):
    """A `--store` spec (or a size in it) could not be parsed; the message shows the accepted syntax."""


class StoreUnavailableError(StoreError):
    """A tier cannot be used at start-up: unwritable directory, unreachable Redis."""


class InvalidNamespaceError(StoreError):
    """A namespace that cannot be used safely as part of a file name or Redis key."""


class CorruptEntryError(StoreError):
    """Stored bytes that fail validation (bad magic, header, checksum or length). Tiers turn it into a logged
    miss and delete the entry; it never reaches a request."""


class EntryMismatchError(CorruptEntryError):
    """A well-formed entry whose header names another key (model fingerprint, conditioning, tokens or
    namespace): never used for the requested key (docs/invariants.md, invariant 8)."""


class MissingBlockError(StoreError, KeyError):
    """A block the caller was told is cached vanished (evicted, expired or corrupt) before all its layers were
    read; the caller should encode it again."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
