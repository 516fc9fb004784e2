"""One engine monitor per host: what the lead worker writes, the others take over whole."""

import time

import httpx

from gateway.config import HealthConfig
from gateway.core.ledger import Foreign
from gateway.core.types import EngineSpec
from gateway.engines import sharing
from gateway.engines.pool import EnginePool


def pool() -> EnginePool:
    spec = EngineSpec("e", "http://e", frozenset({"m"}), 100, 16, 256, 512)
    return EnginePool([spec], {"e": {"num_gpu_blocks": "config"}})


def test_a_follower_takes_over_what_the_lead_found(tmp_path):
    lead, follower = pool(), pool()
    lead.update_spec("e", "discovered:/metrics", num_gpu_blocks=200, max_model_len=1024)
    state = lead.get("e")
    state.used_blocks, state.running, state.waiting = 40, 3, 1
    state.kv_cache_usage, state.preemptions = 0.2, 7
    state.foreign, state.missing = Foreign(seqs=2, blocks=9), ("vllm:num_requests_waiting",)
    state.last_scrape = lead.clock() - 0.5
    path = tmp_path / sharing.SNAPSHOT_NAME
    sharing.write(lead, path, time.time())
    snap = sharing.read(path)
    assert snap is not None
    sharing.apply(follower, snap)
    got = follower.get("e")
    assert (got.spec.num_gpu_blocks, got.spec.max_model_len) == (200, 1024)
    assert got.sources["num_gpu_blocks"] == "discovered:/metrics"
    assert (got.used_blocks, got.running, got.waiting, got.preemptions) == (40, 3, 1, 7)
    assert got.foreign == Foreign(seqs=2, blocks=9) and got.missing == state.missing
    assert got.last_scrape is not None and follower.clock() - got.last_scrape >= 0.5
    # Ejected by the lead: ejected here too; readmitted there: readmitted here.
    lead.mark_unhealthy("e", "connection refused", retry_at=0.0)
    sharing.write(lead, path, time.time())
    sharing.apply(follower, sharing.read(path) or {})
    assert not follower.get("e").healthy
    assert follower.get("e").last_error == "connection refused"
    lead.mark_healthy("e")
    sharing.write(lead, path, time.time())
    sharing.apply(follower, sharing.read(path) or {})
    assert follower.get("e").healthy


async def test_a_follower_probes_itself_while_the_snapshot_is_stale(tmp_path):
    probed: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        probed.append(request.url.path)
        return httpx.Response(200, text="")

    cfg = HealthConfig(scrape_interval_s=0.1, timeout_s=0.1)
    shared = sharing.SharedPool(tmp_path, lead=False)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        monitor = sharing.SharedMonitor(pool(), client, cfg, shared=shared)
        await monitor.follow()  # no snapshot at all: probe here
        assert monitor.probing and "/health" in probed
        probed.clear()
        sharing.write(pool(), shared.path, time.time())
        await monitor.follow()  # a fresh one: read it, probe nothing
        assert not monitor.probing and probed == []
        sharing.write(pool(), shared.path, time.time() - 10)
        await monitor.follow()  # stale (the lead is gone): probe here again
        assert monitor.probing and "/health" in probed
