"""Tenants: API key -> tenant, the tenant's engine-side cache salt, and its concurrency limit.

Keys come from a JSON key file (``--keys FILE``)::

    {"keys": [{"key": "sk-...", "tenant": "acme", "max_concurrency": 64}, ...]}

or from the environment variable ``QUILLCACHE_GATEWAY_KEYS`` as ``key=tenant[,key=tenant...]``.

Invariants:
- A request without ``Authorization: Bearer <key>`` (the scheme case-insensitive, RFC 9110 11.1) or
  with a key not in the table is refused (401); the message never says whether a key exists for
  some tenant. A key appears once in a table: a key file or ``QUILLCACHE_GATEWAY_KEYS`` naming it
  twice is refused, never resolved to one of its tenants.
- Tenant ids follow the identity rule (``quillcache.identity.scope.TENANT_ID_RE``) minus ``:``,
  which the gateway reserves to join a tenant and a client's own ``cache_salt`` into one scope.
- ``salt_for(scope)`` is ``"qc-" + hex(BLAKE2b-128[key=K](scope))``, K the secret itself when it is
  at most 64 bytes (BLAKE2b's key size) and its BLAKE2b-512 digest when longer, so every byte of any
  secret counts: deterministic for one secret (two gateway replicas with the same secret send the
  same salt, so an engine's cache is shared between them), different for every scope, and a client
  cannot choose another tenant's salt (the gateway overwrites ``cache_salt``). Without a secret the
  salt is still per-scope; the secret only stops someone who talks to the engines directly from
  computing it.
- ``TenantLimiter.try_acquire`` never lets a tenant exceed its limit; every acquire is paired
  with exactly one ``release``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quillcache.gateway.config import ConfigError
from quillcache.identity.scope import TENANT_ID_RE, validate_salt

__all__ = ["KEYS_ENV", "TenantKey", "TenantLimiter", "TenantTable", "salt_for", "scope_tenant"]

KEYS_ENV = "QUILLCACHE_GATEWAY_KEYS"
SECRET_ENV = "QUILLCACHE_GATEWAY_SECRET"


@dataclass(frozen=True, slots=True)
class TenantKey:
    tenant: str
    max_concurrency: int | None = None  # None: the gateway's default


MIN_KEY_CHARS = 8


def _check_key(key: object, where: str) -> str:
    """``key`` when it is a usable API key; ``ConfigError`` naming ``where`` (the file and entry) otherwise. The
    message never quotes the key: it is a secret, and a short one is still someone's."""
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        got = (f"a {type(key).__name__}" if not isinstance(key, str) else
               "one with whitespace" if any(c.isspace() for c in key) else f"{len(key)} character(s)")
        raise ConfigError(f"{where}: API keys must be strings of at least {MIN_KEY_CHARS} characters without "
                          f"whitespace, got {got}")
    return key


def _check_tenant(tenant: object, where: str) -> str:
    if not isinstance(tenant, str) or not TENANT_ID_RE.fullmatch(tenant) or ":" in tenant:
        raise ConfigError(f"{where}: tenant {tenant!r:.80} must be 1-128 characters from [A-Za-z0-9._@-]")
    return tenant


class TenantTable:
    """API key -> :class:`TenantKey` (see module doc)."""

    def __init__(self, keys: Mapping[str, TenantKey]) -> None:
        for i, (k, v) in enumerate(keys.items()):
            _check_key(k, f"key table entry {i}")  # (from_file and from_env name the file or variable first)
            _check_tenant(v.tenant, "key table")
        if not keys:
            raise ConfigError(f"no API keys: give --keys FILE or set {KEYS_ENV}=key=tenant[,key=tenant...]")
        self._keys = dict(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, authorization: str | None) -> TenantKey | None:
        """The tenant of an ``Authorization`` header value, or None (missing, malformed or unknown)."""
        if not authorization:
            return None
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
            return None
        return self._keys.get(credentials.strip())

    @property
    def tenants(self) -> list[str]:
        return sorted({v.tenant for v in self._keys.values()})

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTable:
        p = Path(path)
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read key file {p}: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"key file {p} is not valid JSON: {exc}") from None
        items = raw.get("keys") if isinstance(raw, dict) else None
        if not isinstance(items, list):
            raise ConfigError(f"key file {p} must be {{\"keys\": [{{\"key\", \"tenant\", \"max_concurrency\"?}}]}}")
        keys: dict[str, TenantKey] = {}
        for i, item in enumerate(items):
            where = f"key file {p} keys[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("key"), str):
                raise ConfigError(f"{where} must be an object with a string 'key'")
            unknown = sorted(set(item) - {"key", "tenant", "max_concurrency"})
            if unknown:
                raise ConfigError(f"{where}: unknown fields {unknown}")
            mc = item.get("max_concurrency")
            if mc is not None and (type(mc) is not int or mc < 1):
                raise ConfigError(f"{where}: max_concurrency must be an integer >= 1, got {mc!r:.40}")
            if _check_key(item["key"], where) in keys:
                raise ConfigError(f"{where}: duplicate key")
            keys[item["key"]] = TenantKey(_check_tenant(item.get("tenant"), where), mc)
        return cls(keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TenantTable:
        text = (os.environ if environ is None else environ).get(KEYS_ENV, "")
        keys: dict[str, TenantKey] = {}
        for i, part in enumerate(p for p in text.split(",") if p.strip()):
            key, sep, tenant = part.strip().partition("=")
            if not sep:
                raise ConfigError(f"{KEYS_ENV} entry {i} is not key=tenant")
            where = f"{KEYS_ENV} entry {i}"
            if _check_key(key, where) in keys:  # as from_file: never keep one of two tenants silently
                raise ConfigError(f"{where}: duplicate key (an earlier entry names the same key)")
            keys[key] = TenantKey(_check_tenant(tenant, where))
        return cls(keys)


def scope_tenant(tenant: str, client_salt: str | None) -> str:
    """The identity tenant of a request: the tenant, or ``tenant:salt`` under a client's own cache salt."""
    if client_salt is None:
        return tenant
    validate_salt(client_salt)
    scoped = f"{tenant}:{client_salt}"
    if len(scoped) > 128:
        raise ValueError(f"cache_salt is too long for tenant {tenant!r}: tenant:salt must be at most 128 characters")
    return scoped


def salt_for(scope: str, secret: bytes = b"") -> str:
    """The engine-side ``cache_salt`` of an identity tenant scope (see module doc)."""
    return "qc-" + hashlib.blake2b(scope.encode(), digest_size=16, key=_salt_key(secret),
                                   person=b"qc-gw-salt").hexdigest()


@functools.lru_cache(maxsize=8)
def _salt_key(secret: bytes) -> bytes:
    """The BLAKE2b key of ``secret``: itself up to 64 bytes, else its 64-byte digest (never truncated)."""
    if not isinstance(secret, bytes):
        raise TypeError(f"the gateway secret must be bytes, got {type(secret).__name__}")
    if len(secret) <= hashlib.blake2b.MAX_KEY_SIZE:
        return secret
    return hashlib.blake2b(secret, digest_size=64, person=b"qc-gw-secret").digest()


class TenantLimiter:
    """In-flight requests per tenant against a limit (event-loop confined, no lock)."""

    def __init__(self, default_limit: int) -> None:
        self.default_limit = default_limit
        self._inflight: dict[str, int] = {}

    def try_acquire(self, tenant: str, limit: int | None) -> bool:
        n = self._inflight.get(tenant, 0)
        if n >= (limit or self.default_limit):
            return False
        self._inflight[tenant] = n + 1
        return True

    def release(self, tenant: str) -> None:
        n = self._inflight[tenant] - 1
        assert n >= 0, "tenant released more than acquired"
        if n:
            self._inflight[tenant] = n
        else:
            del self._inflight[tenant]

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    @property
    def total(self) -> int:
        return sum(self._inflight.values())
