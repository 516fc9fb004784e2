"""Several gateway replicas (real `kv-gateway serve` processes) sharing one real Redis."""

import asyncio
import contextlib
import time
import uuid

import httpx
import pytest
import redis

from gateway.harness import GatewayProcess, RedisServer, SimProcess
from tests.admin import ADMIN_HEADERS, with_admin
from tests.redis_server import redis_url as session_redis_url

pytestmark = pytest.mark.redis

PROMPT = list(range(100, 110))  # 10 token ids: the footprint is exact
BLOCK = 16


def config(engine: SimProcess, *, redis_url=None, prefix=None, **extra):
    cfg = {
        "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 64}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "admission": {"kv_ceiling": 1.0},
        "queue": {"max_length": 20, "max_wait_s": 1.0},
        "redis": {
            "url": redis_url or session_redis_url(),
            "key_prefix": prefix or f"t{uuid.uuid4().hex[:10]}",
            "lease_ttl_s": 3,
            # Three gateways, an engine and the clients share two cores: a Redis answer may
            # take over the default 1 s, which would be a 503 (fail_closed), not a finding.
            "timeout_s": 3,
        },
        "health": {"scrape_interval_s": 0.5},
    }
    cfg.update(extra)
    return with_admin(cfg)


@contextlib.asynccontextmanager
async def replicas(cfg, n, tmp_path):
    procs = [GatewayProcess(cfg, tmp_path) for _ in range(n)]
    try:
        await asyncio.gather(*(p.astart() for p in procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


async def complete(http, url, max_tokens=150, key=None, stream=False):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await http.post(
        url + "/v1/completions",
        headers=headers,
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        },
    )


async def sim_state(http, engine):
    return (await http.get(engine.url + "/sim/state")).json()


async def admin_status(http, url):
    try:
        response = await http.get(url + "/admin/status", headers=ADMIN_HEADERS)
    except httpx.RemoteProtocolError:
        # A kept-alive connection the gateway closed as it was reused (uvicorn's 5 s idle
        # timer, read late by a client busy with hundreds of answers on two cores): HTTP/1.1's
        # keep-alive race, not the gateway's state. Once more on a new connection (the pool's
        # other idle ones may be as old); a gateway that is gone fails this one too.
        async with httpx.AsyncClient(timeout=http.timeout) as fresh:
            response = await fresh.get(url + "/admin/status", headers=ADMIN_HEADERS)
    return response.json()


async def settled(http, gateways):
    """Every replica sees nothing reserved and nobody queued (waits for releases to land)."""
    for _ in range(100):
        statuses = [await admin_status(http, g.url) for g in gateways]
        if all(
            s["queue"]["length"] == 0
            and all(e["reserved_blocks"] == 0 and e["reserved_seqs"] == 0 for e in s["engines"])
            for s in statuses
        ):
            return True
        await asyncio.sleep(0.05)
    return statuses


def keys_without_ttl(url, prefix):
    client = redis.Redis.from_url(url)
    try:
        # -1: no TTL; -2: gone since the scan (the TTL clock, `{p}:touch`, lives 1.3 s).
        return [k for k in client.scan_iter(match=f"{{{prefix}}}*") if client.pttl(k) == -1]
    finally:
        client.close()


async def test_burst_across_three_replicas_never_overcommits(tmp_path):
    # Capacity for exactly 10 requests: 100 usable blocks, 10 blocks each (10 + 150 tokens).
    engine = await SimProcess(
        num_gpu_blocks=101,
        max_num_seqs=64,
        max_model_len=512,
        decode_ms_base=3.0,
        decode_ms_per_seq=0.02,
    ).astart()
    prefix = f"t{uuid.uuid4().hex[:10]}"
    try:
        # A fresh connection per request: a kept-alive one may be closed by the gateway just
        # as it is reused (a ReadError seen once on a loaded machine), which is not what this
        # test is about; a connection reset under a request still fails it.
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with (
            replicas(config(engine, prefix=prefix), 3, tmp_path) as gws,
            httpx.AsyncClient(timeout=60, limits=limits) as http,
        ):
            for trial in range(4):
                results = await asyncio.gather(
                    *(complete(http, gws[i % 3].url) for i in range(200))
                )
                codes = [r.status_code for r in results]
                assert set(codes) <= {200, 429}, (trial, sorted(set(codes)))
                assert codes.count(200) >= 10
                assert await settled(http, gws) is True
            state = await sim_state(http, engine)
        # Over all trials the engine never held more than the 100 blocks the gateways share,
        # never ran more than 10 requests, and never preempted.
        assert 0 < state["peak_used_blocks"] <= 100
        assert 0 < state["peak_running"] <= 10
        assert state["num_preemptions"] == 0
        assert keys_without_ttl(session_redis_url(), prefix) == []
    finally:
        engine.stop()


async def test_tenant_limits_hold_across_replicas(tmp_path):
    import hashlib

    def digest(key):
        return hashlib.sha256(key.encode()).hexdigest()

    engine = await SimProcess(
        num_gpu_blocks=1025, max_num_seqs=128, max_model_len=512, decode_ms_base=4.0
    ).astart()
    tenants = [
        {"name": "conc", "api_keys": [digest("k-conc")], "max_concurrency": 3},
        {"name": "rpm", "api_keys": [digest("k-rpm")], "rpm": 10},
        # Each request is charged 10 + 90 = 100 tokens: 1000 tokens admit about 10.
        {"name": "tpm", "api_keys": [digest("k-tpm")], "tpm": 1000},
    ]
    try:
        async with (
            replicas(
                config(engine, tenants=tenants, queue={"max_length": 50, "max_wait_s": 5}),
                3,
                tmp_path,
            ) as gws,
            httpx.AsyncClient(timeout=60) as http,
        ):
            conc = await asyncio.gather(
                *(complete(http, gws[i % 3].url, max_tokens=100, key="k-conc") for i in range(12))
            )
            peak_running = (await sim_state(http, engine))["peak_running"]
            rpm = await asyncio.gather(
                *(complete(http, gws[i % 3].url, max_tokens=4, key="k-rpm") for i in range(30))
            )
            tpm = await asyncio.gather(
                *(complete(http, gws[i % 3].url, max_tokens=90, key="k-tpm") for i in range(30))
            )
            unauth = await complete(http, gws[0].url, max_tokens=4, key="wrong")
            assert await settled(http, gws) is True
        conc_codes = [r.status_code for r in conc]
        assert conc_codes.count(200) >= 3
        assert all(
            r.json()["error"]["code"] == "tenant_concurrency" for r in conc if r.status_code == 429
        )
        assert peak_running <= 3
        ok_rpm = [r for r in rpm if r.status_code == 200]
        assert 10 <= len(ok_rpm) <= 11
        limited = [r for r in rpm if r.status_code == 429]
        assert limited and all(r.json()["error"]["code"] == "tenant_rpm" for r in limited)
        assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
        assert ok_rpm[0].headers["x-ratelimit-limit-requests"] == "10"
        assert "x-ratelimit-remaining-requests" in ok_rpm[0].headers
        ok_tpm = [r for r in tpm if r.status_code == 200]
        assert 9 <= len(ok_tpm) <= 11
        assert all(r.json()["error"]["code"] == "tenant_tpm" for r in tpm if r.status_code == 429)
        assert unauth.status_code == 401 and unauth.json()["error"]["code"] == "invalid_api_key"
    finally:
        engine.stop()


async def test_killed_replica_leases_expire(tmp_path):
    engine = await SimProcess(
        num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512, decode_ms_base=20.0
    ).astart()
    try:
        async with (
            replicas(config(engine), 2, tmp_path) as (doomed, survivor),
            httpx.AsyncClient(timeout=60) as http,
        ):
            streams = [
                asyncio.create_task(complete(http, doomed.url, max_tokens=400, stream=True))
                for _ in range(5)
            ]
            for _ in range(100):
                held = (await admin_status(http, survivor.url))["engines"][0]
                if held["reserved_seqs"] == 5:
                    break
                await asyncio.sleep(0.05)
            assert held["reserved_seqs"] == 5  # the survivor sees the doomed replica's leases
            doomed.kill()
            killed = time.monotonic()
            await asyncio.gather(*streams, return_exceptions=True)
            while time.monotonic() - killed < 10:
                held = (await admin_status(http, survivor.url))["engines"][0]
                if held["reserved_blocks"] == 0:
                    break
                await asyncio.sleep(0.1)
            returned_after = time.monotonic() - killed
        assert held["reserved_blocks"] == 0 and held["reserved_seqs"] == 0
        # lease_ttl_s 3, plus room for a slow machine (leases that never expire fail above).
        assert returned_after <= 3 + 3, returned_after
    finally:
        engine.stop()


@pytest.mark.parametrize("on_failure", ["fail_closed", "fail_open_local"])
async def test_redis_restart_mid_load(tmp_path, on_failure):
    private = RedisServer().start()
    engine = await SimProcess(num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512).astart()
    prefix = f"t{uuid.uuid4().hex[:10]}"
    try:
        cfg = config(engine, redis_url=private.url, prefix=prefix)
        cfg["redis"]["on_failure"] = on_failure
        async with replicas(cfg, 2, tmp_path) as gws, httpx.AsyncClient(timeout=30) as http:
            before = await asyncio.gather(*(complete(http, g.url, max_tokens=8) for g in gws))
            assert [r.status_code for r in before] == [200, 200]
            private.stop()
            during = await asyncio.gather(*(complete(http, g.url, max_tokens=8) for g in gws))
            if on_failure == "fail_closed":
                assert [r.status_code for r in during] == [503, 503]
                assert all(r.json()["error"]["code"] == "state_unavailable" for r in during)
            else:
                assert [r.status_code for r in during] == [200, 200]
            private.start()  # same port: the replicas' URL
            recovered = []
            for _ in range(60):
                after = await asyncio.gather(*(complete(http, g.url, max_tokens=8) for g in gws))
                recovered = [r.status_code for r in after]
                if recovered == [200, 200]:
                    break
                await asyncio.sleep(0.25)
            assert recovered == [200, 200]
            assert await settled(http, gws) is True
        assert keys_without_ttl(private.url, prefix) == []
    finally:
        engine.stop()
        private.stop()


async def test_redis_restart_counts_running_requests_again(tmp_path):
    """Redis keeps nothing on disk: a restart empties it while requests still run on the
    engine. Their replica writes their leases again at its next renewal, so every replica
    counts their blocks again within a renewal period, and all of it is released at the end."""
    private = RedisServer().start()
    engine = await SimProcess(
        num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512, decode_ms_base=20.0
    ).astart()
    try:
        cfg = config(engine, redis_url=private.url)
        async with (
            replicas(cfg, 2, tmp_path) as (serving, watching),
            httpx.AsyncClient(timeout=60) as http,
        ):

            async def reserved():
                return (await admin_status(http, watching.url))["engines"][0]

            streams = [
                asyncio.create_task(complete(http, serving.url, max_tokens=400, stream=True))
                for _ in range(4)
            ]
            for _ in range(100):
                held = await reserved()
                if held["reserved_seqs"] == 4:
                    break
                await asyncio.sleep(0.05)
            assert held["reserved_seqs"] == 4, held
            blocks = held["reserved_blocks"]
            private.stop()
            private.start()  # empty, same port
            restarted = time.monotonic()
            held = None
            while time.monotonic() - restarted < 8:
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    held = await reserved()
                    if held["reserved_seqs"] == 4:
                        break
                await asyncio.sleep(0.05)
            counted_after = time.monotonic() - restarted
            assert held is not None and held["reserved_seqs"] == 4, held
            assert held["reserved_blocks"] == blocks
            # lease_ttl_s 3: renewed every second, plus the store's 0.5 s back-off, plus room
            # for a slow machine (never counted again fails the loop above).
            assert counted_after <= 5, counted_after
            assert not any(t.done() for t in streams)  # still running when counted again
            done = await asyncio.gather(*streams)
            assert [r.status_code for r in done] == [200] * 4
            assert all("[DONE]" in r.text and '"error"' not in r.text for r in done)
            assert await settled(http, (serving, watching)) is True
        assert keys_without_ttl(private.url, cfg["redis"]["key_prefix"]) == []
    finally:
        engine.stop()
        private.stop()


async def test_a_killed_replicas_waiters_stop_blocking_the_line(tmp_path):
    """Replica A fills the engine, replica B queues three large requests and is SIGKILLed,
    then a small request arrives at A. B's entries are owned by B and kept alive like its
    leases: they leave the line (and stop counting towards `queue.max_length`) within
    `lease_ttl_s`, although their `max_wait_s` is far longer, so the small request is
    answered within `lease_ttl_s` + 2 s of the kill (before the fix: after `max_wait_s`)."""
    ttl = 3.0
    # 100 usable blocks; a large request is 10 + 790 tokens = 50 blocks, ~2.4 s of decoding.
    engine = await SimProcess(
        num_gpu_blocks=101, max_num_seqs=64, max_model_len=1024, decode_ms_base=3.0
    ).astart()
    try:
        cfg = config(engine, queue={"max_length": 4, "max_wait_s": 60.0})
        cfg["redis"]["lease_ttl_s"] = ttl
        async with (
            replicas(cfg, 2, tmp_path) as (a, b),
            httpx.AsyncClient(timeout=120) as http,
        ):
            fill = [asyncio.create_task(complete(http, a.url, max_tokens=790)) for _ in range(2)]
            for _ in range(200):
                if (await admin_status(http, a.url))["engines"][0]["reserved_seqs"] == 2:
                    break
                await asyncio.sleep(0.02)
            doomed = [asyncio.create_task(complete(http, b.url, max_tokens=790)) for _ in range(3)]
            for _ in range(200):
                if (await admin_status(http, a.url))["queue"]["length"] == 3:
                    break
                await asyncio.sleep(0.02)
            assert (await admin_status(http, a.url))["queue"]["length"] == 3
            assert not any(t.done() for t in fill)  # B was killed while the engine was full
            b.kill()
            killed = time.monotonic()
            small = await complete(http, a.url, max_tokens=8)
            answered_after = time.monotonic() - killed
            assert small.status_code == 200, small.text
            assert answered_after <= ttl + 2, answered_after
            assert [r.status_code for r in await asyncio.gather(*fill)] == [200, 200]
            await asyncio.gather(*doomed, return_exceptions=True)
            # The dead entries no longer count towards max_length (4): four requests that
            # must all queue behind each other are all admitted, none is `queue_full`.
            assert (await admin_status(http, a.url))["queue"]["length"] == 0
            again = await asyncio.gather(*(complete(http, a.url, max_tokens=790) for _ in range(4)))
            assert [r.status_code for r in again] == [200] * 4, [r.text for r in again]
            assert await settled(http, [a]) is True
    finally:
        engine.stop()


async def test_500_concurrent_requests_through_a_pool_of_20_get_no_503(tmp_path):
    """Many more requests waiting than pooled Redis connections: waiters hold no connection
    while they wait, admissions queue for the pool, and running out of connections is
    back-pressure, never "Redis lost" (which fail_closed answers with 503)."""
    engine = await SimProcess(
        num_gpu_blocks=321, max_num_seqs=64, max_model_len=512, decode_ms_base=2.0
    ).astart()
    try:
        cfg = config(engine, queue={"max_length": 1000, "max_wait_s": 120.0})
        cfg["redis"]["max_connections"] = 20
        limits = httpx.Limits(max_connections=600, keepalive_expiry=2)
        async with (
            replicas(cfg, 1, tmp_path) as (gw,),
            httpx.AsyncClient(timeout=180, limits=limits) as http,
        ):
            results = await asyncio.gather(
                *(complete(http, gw.url, max_tokens=30) for _ in range(500)),
                return_exceptions=True,
            )
            codes = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in results]
            assert 503 not in codes
            assert codes == [200] * 500, sorted(set(map(str, codes)))
            assert await settled(http, [gw]) is True
            log = gw.log_text()
        assert "redis unreachable" not in log
    finally:
        engine.stop()
