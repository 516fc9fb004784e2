"""API keys: a client's key → its tenant (with no tenants configured everyone is the default
tenant), and an operator's key → access to the admin surface (`/admin/*`, `/metrics`).

Keys are held as sha256 digests; a presented key is compared against every digest in
constant time, whatever matches.
"""

from __future__ import annotations

import hashlib
import hmac

from gateway.config import AdminConfig, TenantConfig
from gateway.core.types import DEFAULT_TENANT, TenantPolicy
from gateway.errors import Forbidden, Unauthorized


def presented_digest(authorization: str | None) -> bytes:
    """The sha256 digest of the key in `Authorization: Bearer <key>`; raises `Unauthorized`."""
    if not authorization:
        raise Unauthorized(
            "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
        )
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("The Authorization header must be 'Bearer <key>'.")
    return hashlib.sha256(key.strip().encode()).digest()


def policy_of(t: TenantConfig) -> TenantPolicy:
    return TenantPolicy(
        name=t.name,
        max_concurrency=t.max_concurrency,
        rpm=t.rpm,
        tpm=t.tpm,
        kv_share=t.kv_share,
        priority=t.priority,
        weight=t.weight,
        max_queued=t.max_queued,
    )


class Authenticator:
    def __init__(self, tenants: list[TenantConfig]) -> None:
        self._keys: list[tuple[bytes, TenantPolicy]] = []
        self.load(tenants)

    def load(self, tenants: list[TenantConfig]) -> None:
        """Take these tenants' keys and limits, in place of the ones held (SIGHUP reload):
        requests that arrive from now on are authenticated against them."""
        self._keys = [
            (bytes.fromhex(digest), policy_of(t)) for t in tenants for digest in t.api_keys
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> TenantPolicy:
        """The tenant of an `Authorization: Bearer <key>` header; raises `Unauthorized`."""
        if not self._keys:
            return DEFAULT_TENANT
        presented = presented_digest(authorization)
        found: TenantPolicy | None = None
        # Compare against every key, in constant time each, whatever matches.
        for known, policy in self._keys:
            if hmac.compare_digest(presented, known):
                found = policy
        if found is None:
            raise Unauthorized("Incorrect API key provided.")
        return found


class AdminGate:
    """Who may read the admin surface (see `AdminConfig`): holders of an admin key; anyone
    when neither admin keys nor tenants are configured; nobody (403) when tenants are
    configured without admin keys."""

    def __init__(self, admin: AdminConfig, tenants: list[TenantConfig]) -> None:
        self._keys: list[bytes] = []
        self._closed = False
        self.load(admin, tenants)

    def load(self, admin: AdminConfig, tenants: list[TenantConfig]) -> None:
        """Take these keys in place of the ones held (SIGHUP reload)."""
        self._keys = [bytes.fromhex(digest) for digest in admin.api_keys]
        self._closed = not self._keys and bool(tenants)

    @property
    def state(self) -> str:
        """`keys`, `open` or `closed`, for the start-up log."""
        return "keys" if self._keys else "closed" if self._closed else "open"

    def check(self, authorization: str | None) -> None:
        """Pass, or raise `Unauthorized` (401) / `Forbidden` (403)."""
        if self._closed:
            raise Forbidden(
                "The admin surface is closed: tenants are configured and admin.api_keys is not.",
                code="admin_disabled",
            )
        if not self._keys:
            return
        presented = presented_digest(authorization)
        found = False
        for known in self._keys:
            found |= hmac.compare_digest(presented, known)
        if not found:
            raise Unauthorized("Incorrect admin key provided.")
