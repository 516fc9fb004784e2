"""The Redis every test that needs one uses: `KVGW_TEST_REDIS_URL` when it is set, else a
private `redis-server` (Debian's package) on a free loopback port, started at first use and
stopped when the test session ends (`tests/conftest.py`).

So `./scripts/test` needs nothing running on the machine, and never touches a Redis someone
else uses unless told to.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from gateway.harness import RedisServer

ENV = "KVGW_TEST_REDIS_URL"

_server: RedisServer | None = None


def redis_url() -> str:
    """The session's Redis URL; starts the private server on first use."""
    given = os.environ.get(ENV)
    if given:
        return given
    global _server
    if _server is None:
        _server = RedisServer().start()
    return _server.url


def redis_address() -> tuple[str, int]:
    """Host and port of `redis_url()` (for a TCP forwarder placed in front of it)."""
    parts = urlsplit(redis_url())
    return parts.hostname or "127.0.0.1", parts.port or 6379


def stop() -> None:
    """Stop the private server, if this session started one."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None
