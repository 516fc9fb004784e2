"""API keys: a client's key → its tenant (with no tenants configured everyone is the default
tenant), and an operator's key → access to the admin surface (`/admin/*`, `/metrics`). A
tenant's requests get its service class, or one of the classes it may name in `slo.header`.

Keys are held as sha256 digests; a presented key is compared against every digest in
constant time, whatever matches.
"""

from __future__ import annotations

import hashlib
import hmac

from gateway.config import AdminConfig, SloConfig, TenantConfig
from gateway.core.types import DEFAULT_TENANT, ServiceClass, TenantPolicy
from gateway.errors import BadRequest, Forbidden, Unauthorized

NO_SLO = SloConfig()


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


def policy_of(t: TenantConfig, slo: SloConfig = NO_SLO) -> TenantPolicy:
    """`t`'s contract, its service classes resolved in `slo` (the configuration validated
    that they are there): its own (else `slo.default_class`), and those it may name."""
    own = t.service_class or slo.default_class
    names = dict.fromkeys([*([own] if own else []), *t.service_classes])
    return TenantPolicy(
        name=t.name,
        max_concurrency=t.max_concurrency,
        rpm=t.rpm,
        tpm=t.tpm,
        kv_share=t.kv_share,
        priority=t.priority,
        weight=t.weight,
        max_queued=t.max_queued,
        service_class=slo.service_class(own) if own else None,
        service_classes=tuple(slo.service_class(name) for name in names),
    )


def default_policy(slo: SloConfig = NO_SLO) -> TenantPolicy:
    """Everyone's tenant when no tenants are configured: `slo.default_class`, and any class
    may be named (without keys nobody can be told apart)."""
    if not slo.classes:
        return DEFAULT_TENANT
    return TenantPolicy(
        name=DEFAULT_TENANT.name,
        service_class=slo.service_class(slo.default_class) if slo.default_class else None,
        service_classes=tuple(slo.service_class(name) for name in slo.classes),
    )


class Authenticator:
    def __init__(self, tenants: list[TenantConfig], slo: SloConfig = NO_SLO) -> None:
        self._keys: list[tuple[bytes, TenantPolicy]] = []
        self._default = DEFAULT_TENANT
        self.class_header = slo.header.encode("latin-1")
        self.load(tenants, slo)

    def load(self, tenants: list[TenantConfig], slo: SloConfig = NO_SLO) -> None:
        """Take these tenants' keys, limits and service classes, in place of the ones held
        (SIGHUP reload): requests that arrive from now on are authenticated against them."""
        self._keys = [
            (bytes.fromhex(digest), policy_of(t, slo)) for t in tenants for digest in t.api_keys
        ]
        self._default = default_policy(slo)
        self.class_header = slo.header.encode("latin-1")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> TenantPolicy:
        """The tenant of an `Authorization: Bearer <key>` header; raises `Unauthorized`."""
        if not self._keys:
            return self._default
        presented = presented_digest(authorization)
        found: TenantPolicy | None = None
        # Compare against every key, in constant time each, whatever matches.
        for known, policy in self._keys:
            if hmac.compare_digest(presented, known):
                found = policy
        if found is None:
            raise Unauthorized("Incorrect API key provided.")
        return found

    def service_class(self, tenant: TenantPolicy, named: str | None) -> ServiceClass | None:
        """The service class of `tenant`'s request that names `named` in `class_header`
        (None: names none, so the tenant's own); raises `BadRequest` (400
        `invalid_service_class`) for a class the tenant may not name."""
        if named is None:
            return tenant.service_class
        found = tenant.allowed_class(named)
        if found is None:
            allowed = ", ".join(sorted({c.name for c in tenant.service_classes} | _own(tenant)))
            shown = named if len(named) <= 64 else named[:64] + "…"
            raise BadRequest(
                f"The service class {shown!r} ({self.class_header.decode()}) is not one this "
                f"API key may use; it may use: {allowed or 'none'}.",
                code="invalid_service_class",
                param=self.class_header.decode(),
            )
        return found


def _own(tenant: TenantPolicy) -> set[str]:
    return set() if tenant.service_class is None else {tenant.service_class.name}


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
