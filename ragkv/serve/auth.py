"""API keys and tenants: `--api-key KEY[:TENANT]` (repeatable) and `--api-keys FILE` (`KEY TENANT` per line).

A key's tenant is the namespace of its KV entries and the owner of its documents; a request sees only its own
tenant's. Without keys the server is open and everyone is the tenant `default` (with a warning at start).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from ragkv.errors import InvalidRequestError
from ragkv.settings import DEFAULT_TENANT
from ragkv.store.base import check_namespace

MIN_KEY_CHARS = 8


class ApiKeys:
    def __init__(self, keys: dict[str, str]):
        self._keys = dict(keys)  # key -> tenant

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> set[str]:
        return set(self._keys.values())

    @classmethod
    def parse(cls, specs: list[str] = (), files: list[str] = ()) -> "ApiKeys":
        """From `KEY` / `KEY:TENANT` flags and `KEY TENANT` files; a clear error for anything malformed."""
        entries: list[tuple[str, str, str]] = []  # (key, tenant, where)
        for spec in specs:
            key, _, tenant = spec.partition(":")
            entries.append((key, tenant or DEFAULT_TENANT, "--api-key"))
        for name in files:
            path = Path(name).expanduser()
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidRequestError(f"--api-keys {path}: cannot read it ({e})") from None
            for n, line in enumerate(lines, 1):
                parts = line.split("#", 1)[0].split()
                if not parts:
                    continue
                if len(parts) != 2:
                    raise InvalidRequestError(f"--api-keys {path}:{n}: want `KEY TENANT`, got {len(parts)} fields")
                entries.append((parts[0], parts[1], f"{path}:{n}"))
        keys: dict[str, str] = {}
        for key, tenant, where in entries:
            if len(key) < MIN_KEY_CHARS or any(c.isspace() or c == ":" for c in key):
                raise InvalidRequestError(f"{where}: an API key needs at least {MIN_KEY_CHARS} characters, without "
                                          "spaces or ':'")
            check_namespace(tenant)
            if keys.get(key, tenant) != tenant:
                raise InvalidRequestError(f"{where}: the same key is given for tenants {keys[key]!r} and {tenant!r}")
            keys[key] = tenant
        return cls(keys)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of `Authorization: Bearer KEY`, or None when the key is missing or unknown."""
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        given = given.strip().encode()
        tenant = None
        for key, t in self._keys.items():  # compare with every key in constant time: no timing oracle
            if hmac.compare_digest(key.encode(), given):
                tenant = t
        return tenant
