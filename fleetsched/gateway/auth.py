"""API keys: stored hashed, looked up by their digest; a key names a tenant (or the admin).

Keys are high-entropy random strings, so one round of SHA-256 is enough to keep them out of the
config in clear (a slow hash such as scrypt defends guessable passwords, and would cost
milliseconds on every request). A presented key is hashed once and its digest looked up among
the stored ones: what a lookup's time could say is how close the digest came to a stored digest,
which says nothing of how close the key came (SHA-256 has no known preimages). Compared with
every stored hash instead, each request cost time in the number of keys: 0.6 ms a request with
2,000 keys, on the event loop every call shares.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..settings import Settings, TenantSettings

PREFIX = "sha256:"


def hash_key(key: str) -> str:
    """The stored form of `key`: ``sha256:<64 hex digits>``. Hashed from its UTF-8 bytes as
    `KeyRing.identify` hashes a presented key: bytes that are not UTF-8 (read from argv as
    surrogates) are hashed as they were given, not a UnicodeEncodeError."""
    return PREFIX + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A fresh random API key (``fs-`` and 43 URL-safe characters)."""
    return "fs-" + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: a tenant (with its settings), or the admin (tenant None)."""

    tenant: str | None
    settings: TenantSettings | None = None

    @property
    def admin(self) -> bool:
        return self.tenant is None


ADMIN = Identity(None)


class KeyRing:
    """Maps presented API keys to identities. Built once from the settings."""

    def __init__(self, tenants: Mapping[str, TenantSettings], admin_hashes: list[str] = ()) -> None:  # type: ignore[assignment]
        entries: list[tuple[bytes, Identity]] = []
        seen: dict[str, str] = {}
        for name, tenant in tenants.items():
            for stored in tenant.api_keys:
                if stored in seen:
                    raise ConfigError(f"tenants.{name}.api_keys", f"the same key hash is also given to {seen[stored]}")
                seen[stored] = f"tenant {name!r}"
                entries.append((bytes.fromhex(stored.removeprefix(PREFIX)), Identity(name, tenant)))
        for stored in admin_hashes:
            if stored in seen:
                raise ConfigError("gateway.admin_api_keys", f"the same key hash is also given to {seen[stored]}")
            seen[stored] = "the admin"
            entries.append((bytes.fromhex(stored.removeprefix(PREFIX)), ADMIN))
        self._entries = tuple(entries)
        self._by_digest = dict(entries)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        return cls(settings.tenants, settings.gateway.admin_api_keys)

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, key: str) -> Identity | None:
        """The identity whose key is `key`, or None: its digest looked up, whatever the number of keys."""
        return self._by_digest.get(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest())

    def identify_header(self, authorization: bytes | None) -> Identity | None:
        """The identity for an ``Authorization: Bearer KEY`` header value (None: missing or wrong)."""
        if not authorization:
            return None
        # Read as UTF-8, as `hash_key` hashes a key: the bytes sent are the bytes hashed (bytes
        # that are not UTF-8 become surrogates, which `identify` turns back into those bytes).
        scheme, _, key = authorization.decode("utf-8", "surrogateescape").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.identify(key.strip())
