"""The admin key the tests' gateways accept when they have tenants (the admin surface is
closed then without one): `with_admin(raw)` adds it to a config, `ADMIN_HEADERS` present it.
Sent to a gateway whose admin surface is open, the header is ignored."""

from __future__ import annotations

import hashlib
from typing import Any

ADMIN_KEY = "test-admin-key"
ADMIN_DIGEST = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}


def with_admin(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the test admin key, if it has tenants and no admin section of its own."""
    if raw.get("tenants") and "admin" not in raw:
        return {**raw, "admin": {"api_keys": [ADMIN_DIGEST]}}
    return raw
