"""API key → tenant. With no tenants configured everyone is the default tenant."""

from __future__ import annotations

import hashlib
import hmac

from gateway.config import TenantConfig
from gateway.core.types import DEFAULT_TENANT, TenantPolicy
from gateway.errors import Unauthorized


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
        if not authorization:
            raise Unauthorized(
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("The Authorization header must be 'Bearer <key>'.")
        presented = hashlib.sha256(key.strip().encode()).digest()
        found: TenantPolicy | None = None
        # Compare against every key, in constant time each, whatever matches.
        for known, policy in self._keys:
            if hmac.compare_digest(presented, known):
                found = policy
        if found is None:
            raise Unauthorized("Incorrect API key provided.")
        return found
