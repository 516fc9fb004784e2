"""An ejected engine's back-off counts its failed probes, not the requests that fail while
it is out (issue 42: in a rolling restart under load an engine answering again after 0.9 s
was readmitted 30 s later, each request that failed to reach it doubling the back-off)."""

import socket

import httpx

from gateway.config import HealthConfig
from gateway.core.types import EngineSpec
from gateway.engines.monitor import EngineMonitor, backoff_s
from gateway.engines.pool import EnginePool


def closed_url() -> str:
    """A loopback address nothing listens on: a probe there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_requests_failing_while_an_engine_is_out_do_not_lengthen_its_back_off():
    cfg = HealthConfig(scrape_interval_s=1.0, backoff_max_s=30.0)
    pool = EnginePool([EngineSpec("a", closed_url(), frozenset({"m"}), 100, 16, 8, 512)])
    clock = Clock()
    async with httpx.AsyncClient() as client:
        monitor = EngineMonitor(pool, client, cfg, clock=clock)
        a = pool.get("a")
        monitor.eject("a", "connection refused")  # a request saw it fail: out, probe in 1 s
        assert not a.healthy and a.failures == 1 and a.next_probe_at == 101.0
        for _ in range(8):  # requests sent before the ejection fail afterwards
            monitor.eject("a", "connection refused")
        assert a.failures == 1 and a.next_probe_at == 101.0  # unchanged
        # Its probes still count: two more refused probes, 2 then 4 intervals.
        clock.now = 101.0
        await monitor.probe_all()
        assert a.failures == 2 and a.next_probe_at == 103.0
        clock.now = 103.0
        await monitor.probe_all()
        assert a.failures == 3 and a.next_probe_at == 103.0 + backoff_s(3, 1.0, 30.0) == 107.0
        monitor.eject("a", "connection refused")
        assert a.failures == 3 and a.next_probe_at == 107.0
        # Back in routing, a request that fails takes it out again, from the first interval.
        pool.mark_healthy("a")
        monitor.eject("a", "connection refused")
        assert not a.healthy and a.failures == 1 and a.next_probe_at == 104.0
