"""SIGHUP reloads the tenants and admin keys of a running `kv-gateway serve` (a real
process)."""

import asyncio
import hashlib
import json
import os
import signal
import time

import httpx

from gateway.harness import GatewayProcess, SimProcess


def tenant(name: str, **limits: object) -> dict[str, object]:
    return {
        "name": name,
        "api_keys": [hashlib.sha256(f"key-{name}".encode()).hexdigest()],
        **limits,
    }


async def ask(http: httpx.AsyncClient, url: str, name: str) -> httpx.Response:
    return await http.post(
        url + "/v1/completions",
        headers={"authorization": f"Bearer key-{name}"},
        json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True},
    )


async def test_sighup_reloads_tenants_and_refuses_a_bad_file(tmp_path):
    engine = await SimProcess(num_gpu_blocks=257, max_num_seqs=16, max_model_len=512).astart()
    cfg = {
        "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 16}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "tenants": [tenant("old")],
    }
    gateway = await GatewayProcess(cfg, tmp_path).astart()
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await ask(http, gateway.url, "old")).status_code == 200
            assert (await ask(http, gateway.url, "new")).status_code == 401
            admin = {"authorization": "Bearer key-admin"}
            status = await http.get(gateway.url + "/admin/status", headers=admin)
            assert status.status_code == 403  # tenants without admin keys: closed

            # A new key, a limit, an admin key, and a change that needs a restart (not applied).
            cfg["tenants"] = [tenant("new", rpm=1)]
            cfg["admin"] = {"api_keys": tenant("admin")["api_keys"]}
            cfg["queue"] = {"max_length": 7}
            gateway.config_path.write_text(json.dumps(cfg))
            os.kill(gateway.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while (await ask(http, gateway.url, "new")).status_code == 401:
                assert time.monotonic() < deadline, gateway.log_text()[-2000:]
                await asyncio.sleep(0.1)
            limited = await ask(http, gateway.url, "new")  # rpm 1: the first one above used it
            assert limited.status_code == 429
            assert limited.json()["error"]["code"] == "tenant_rpm"
            assert (await ask(http, gateway.url, "old")).status_code == 401  # its key is gone
            status = await http.get(gateway.url + "/admin/status", headers=admin)
            assert status.status_code == 200  # the admin key is taken too

            # A file that does not validate changes nothing.
            gateway.config_path.write_text(json.dumps({**cfg, "tenants": [{"name": "x"}]}))
            os.kill(gateway.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "refused, nothing changed" not in gateway.log_text():
                assert time.monotonic() < deadline, gateway.log_text()[-2000:]
                await asyncio.sleep(0.1)
            assert (await ask(http, gateway.url, "old")).status_code == 401
            assert (await ask(http, gateway.url, "new")).status_code == 429  # still limited
            assert gateway.proc.poll() is None
        log = gateway.log_text()
        assert "need a restart and were not applied: ['queue']" in log
        assert "reload of" in log
    finally:
        gateway.stop()
        engine.stop()
