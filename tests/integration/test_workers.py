"""`kv-gateway serve --workers 2`: one port, two processes, one Redis — the replica tests'
invariants across processes (no over-commit, limits hold, nothing leaks after a worker is
SIGKILLed), one scrape for every worker's counters, SIGHUP to every worker, and the refusal
to run several workers on in-process state."""

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.harness import GatewayProcess, SimProcess, serve_command
from tests.admin import ADMIN_HEADERS
from tests.integration.test_replicas import (
    admin_status,
    complete,
    config,
    keys_without_ttl,
    settled,
    sim_state,
)
from tests.redis_server import redis_url

pytestmark = pytest.mark.redis


def workers_of(gateway: GatewayProcess) -> list[int]:
    """The supervisor's worker processes, from /proc."""
    pid = gateway.pid
    assert pid is not None
    raw = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in raw]


def multiprocess_dir(worker: int) -> Path:
    """Where the supervisor told its workers to keep their metrics (their environment)."""
    env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    value = next(e for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    return Path(value.split(b"=", 1)[1].decode())


async def two_workers(gateway: GatewayProcess) -> list[int]:
    async def started():
        return len(workers_of(gateway)) == 2

    await until(started, 30, "the supervisor did not start two workers")
    return workers_of(gateway)


async def until(predicate, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while True:
        got = await predicate()
        if got:
            return got
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_several_workers_need_redis(tmp_path):
    engine = await SimProcess(num_gpu_blocks=101, max_model_len=512).astart()
    try:
        cfg = config(engine)
        del cfg["redis"]
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = await asyncio.create_subprocess_exec(
            *serve_command(),
            "--config",
            str(path),
            "--workers",
            "2",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2
        assert "--workers 2 needs shared state: configure `redis:`" in stderr.decode()
        assert "Traceback" not in stderr.decode()
    finally:
        engine.stop()


async def test_two_workers_share_one_port_and_never_overcommit(tmp_path):
    # Capacity for exactly 10 requests: 100 usable blocks, 10 blocks each (10 + 150 tokens).
    engine = await SimProcess(
        num_gpu_blocks=101, max_num_seqs=64, max_model_len=512, decode_ms_base=3.0
    ).astart()
    cfg = config(engine)
    gw = GatewayProcess(cfg, tmp_path, args=["--workers", "2"])
    try:
        await gw.astart()
        limits = httpx.Limits(max_connections=300, keepalive_expiry=2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            pids = await two_workers(gw)
            for _ in range(3):
                # New connections each round: the kernel hands them to either worker.
                async with httpx.AsyncClient(timeout=60, limits=limits) as fresh:
                    results = await asyncio.gather(*(complete(fresh, gw.url) for _ in range(120)))
                codes = [r.status_code for r in results]
                assert set(codes) <= {200, 429}, sorted(set(codes))
                assert codes.count(200) >= 10
                assert await settled(http, [gw]) is True
            state = await sim_state(http, engine)
            # One scrape sees both workers' counters: every answer is counted once.
            page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
            answered = sum(
                float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("kv_gateway_requests_total{")
            )
            assert answered == 360, answered
            # ... and both workers answered some: each kept counters of its own.
            counted = {
                int(f.stem.rsplit("_", 1)[1])
                for f in multiprocess_dir(pids[0]).glob("counter_*.db")
            }
            assert set(pids) <= counted, (pids, counted)
        assert 0 < state["peak_used_blocks"] <= 100
        assert 0 < state["peak_running"] <= 10
        assert state["num_preemptions"] == 0
        assert keys_without_ttl(redis_url(), cfg["redis"]["key_prefix"]) == []
    finally:
        gw.stop()
        engine.stop()


async def test_limits_hold_across_workers_and_a_killed_worker_leaks_nothing(tmp_path):
    def digest(key):
        return hashlib.sha256(key.encode()).hexdigest()

    engine = await SimProcess(
        num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512, decode_ms_base=20.0
    ).astart()
    tenants = [
        {"name": "conc", "api_keys": [digest("k-conc")], "max_concurrency": 3},
        {"name": "free", "api_keys": [digest("k-free")]},
    ]
    cfg = config(engine, tenants=tenants, queue={"max_length": 50, "max_wait_s": 5})
    gw = GatewayProcess(cfg, tmp_path, args=["--workers", "2"])
    try:
        await gw.astart()
        async with httpx.AsyncClient(timeout=60) as http:
            await two_workers(gw)
            async with httpx.AsyncClient(timeout=60) as fresh:
                conc = await asyncio.gather(
                    *(complete(fresh, gw.url, max_tokens=50, key="k-conc") for _ in range(12))
                )
            assert (await sim_state(http, engine))["peak_running"] <= 3
            assert [r.status_code for r in conc].count(200) >= 3
            assert all(
                r.json()["error"]["code"] == "tenant_concurrency"
                for r in conc
                if r.status_code == 429
            )
            # Streams on both workers; SIGKILL one of them mid-stream.
            async with httpx.AsyncClient(timeout=60) as streams_client:
                streams = [
                    asyncio.create_task(
                        complete(streams_client, gw.url, max_tokens=300, stream=True, key="k-free")
                    )
                    for _ in range(6)
                ]

                async def six_running():
                    held = (await admin_status(http, gw.url))["engines"][0]
                    return held["reserved_seqs"] == 6

                await until(six_running, 30, "six streams admitted")
                before = workers_of(gw)
                os.kill(before[1], signal.SIGKILL)
                killed = time.monotonic()
                await asyncio.gather(*streams, return_exceptions=True)

            async def nothing_held():
                # A fresh connection each time: a kept one may have been the killed worker's.
                async with httpx.AsyncClient(timeout=10) as once:
                    try:
                        return await settled(once, [gw]) is True
                    except httpx.TransportError:
                        return False

            # lease_ttl_s 3: the killed worker's leases expire; nothing is left behind.
            await until(nothing_held, 3 + 5, "the killed worker's leases outlived their TTL")
            assert time.monotonic() - killed <= 3 + 5

            async def restarted():
                now = workers_of(gw)
                return len(now) == 2 and before[1] not in now

            await until(restarted, 30, "the supervisor did not start the worker again")
            async with httpx.AsyncClient(timeout=60) as after:
                again = await complete(after, gw.url, max_tokens=8, key="k-free")
            assert again.status_code == 200
        assert keys_without_ttl(redis_url(), cfg["redis"]["key_prefix"]) == []
    finally:
        gw.stop()
        engine.stop()


async def test_sighup_reaches_every_worker(tmp_path):
    engine = await SimProcess(num_gpu_blocks=257, max_model_len=512).astart()
    gw = GatewayProcess(config(engine), tmp_path, args=["--workers", "2"], log_level="info")
    try:
        await gw.astart()
        await two_workers(gw)
        await asyncio.sleep(1.0)  # both workers have set their handlers
        assert gw.pid is not None
        os.kill(gw.pid, signal.SIGHUP)

        async def both_reloaded():
            return gw.log_text().count("reloaded tenants and admin keys") == 2

        await until(both_reloaded, 20, "not every worker reloaded")
        lines = [ln for ln in gw.log_text().splitlines() if "reloaded tenants" in ln]
        assert any("[worker 0]" in ln for ln in lines) and any("[worker 1]" in ln for ln in lines)
        # One engine monitor per host: the lead worker probes, the other reads its figures.
        async with httpx.AsyncClient(timeout=10) as http:
            status = await admin_status(http, gw.url)
        assert status["engines"][0]["healthy"] is True
    finally:
        gw.stop()
        engine.stop()
