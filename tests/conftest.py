"""Session-wide set-up: the test Redis (see `tests/redis_server.py`) is stopped at the end."""

from __future__ import annotations

import pytest

from tests import redis_server


def pytest_unconfigure(config: pytest.Config) -> None:
    redis_server.stop()
