"""Tenants: whose requests may share reused KV (DESIGN.md, Security).

A request's tenant is

- its API key, when the gateway has keys (``gateway.api_keys``,
  ``security.api_keys_file``); a request that also names a ``cache_salt``
  is the tenant of that key and salt;
- else the body's ``cache_salt`` (vLLM's name for it), when given;
- else the default tenant ``""``.

With ``security.tenants_share_cache`` every request is the default tenant.

What leaves this module is a digest: ``Tenant.id`` is an HMAC-SHA256 (128
bits, hex) of the key and salt, keyed with the deployment's internal
credential when one is configured (the same in every gateway replica, so a
tenant is the same tenant on all of them), never the key or the salt
themselves. Workers get it as the generate request's ``cache_salt``: it goes
into the first page's prefix-cache hash, so pages never match across tenants,
locally or in a KV pull. The gateway's own stores (conversation identity,
exact history, kept tokenizations and renders, the lease table) are scoped by
it, and conversation keys reach workers as ``Tenant.scope(key)``: a digest of
the tenant and the key, never a client's session id or user name.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

_DEFAULT_KEY = b"kvserving.tenant"  # the HMAC key without an internal credential


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as the gateway's stores and the workers see it: ``id`` is "" (the default
    tenant) or 32 hex digits."""

    id: str = ""

    @property
    def cache_salt(self) -> str | None:
        """The worker request's ``cache_salt``: none for the default tenant (its pages hash as they always have)."""
        return self.id or None

    def scope(self, key: str) -> str:
        """Conversation ``key`` of this tenant as workers and the gateway's stores see it."""
        return "conv-" + hashlib.sha256(f"{self.id}\x00{key}".encode()).hexdigest()[:32]


DEFAULT_TENANT = Tenant()


class Tenants:
    """The tenant of each request (module docstring)."""

    def __init__(self, *, keyed: bool, share: bool, secret: bytes = b"") -> None:
        self.keyed = keyed  # the gateway checks API keys: a request's key names its tenant
        self.share = share
        self._secret = secret or _DEFAULT_KEY

    def of(self, *, authorization: str | None, cache_salt: str | None) -> Tenant:
        """The tenant of a request with this ``Authorization`` header (already checked) and body ``cache_salt``."""
        if self.share:
            return DEFAULT_TENANT
        key = _bearer(authorization) if self.keyed else None
        if key is None and cache_salt is None:
            return DEFAULT_TENANT
        # length-prefixed parts: no key and salt pair reads as another
        parts = [b"k" if key is not None else b"-", (key or "").encode(), (cache_salt or "").encode()]
        message = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        return Tenant(hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32])


def _bearer(header: str | None) -> str | None:
    if not header or not header.startswith("Bearer "):
        return None
    return header[len("Bearer ") :].strip() or None
