"""The dashboard and what it reads, over real sockets: `GET /dashboard` is a self-contained
page (no outside address, its own script and style, a strict CSP); `/admin/status` (the
page's JSON) validates against docs/status.schema.json and carries per-tenant usage that
matches `/metrics` and the answers the clients got, with a 429's reason; tenant labels come
only from the configuration."""

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.harness import GatewayProcess, SimProcess
from tests.admin import ADMIN_HEADERS
from tests.integration.conftest import gateway_over
from tests.integration.test_replicas import config
from tests.integration.test_tenants import ENGINE, call, tenant
from tests.integration.test_workers import multiprocess_dir, two_workers

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "status.schema.json").read_text())


def validate(document):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)


def samples(page: str, name: str) -> dict[frozenset, float]:
    """`name`'s samples on a Prometheus page, by their label pairs."""
    out = {}
    for line in page.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            out[labels] = float(m.group(2))
    return out


async def test_the_page_is_self_contained_and_its_data_needs_the_admin_key():
    async with (
        gateway_over([ENGINE], tenants=[tenant("a")]) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        page = await http.get(gw.url + "/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "connect-src 'self'" in csp
        # Nothing from outside: every reference is to this origin's own files.
        refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert refs and all(r.startswith("/dashboard/") or r == "data:," for r in refs), refs
        for ref in refs:
            if ref == "data:,":  # no favicon
                continue
            asset = await http.get(gw.url + ref)
            assert asset.status_code == 200, ref
            assert "http://" not in asset.text.replace("http://www.w3.org/2000/svg", "")
            assert "https://" not in asset.text
        script = (await http.get(gw.url + "/dashboard/app.js")).text
        assert 'fetch("/admin/status"' in script and "Authorization" in script
        assert ".innerHTML" not in script and "insertAdjacentHTML" not in script  # text only
        # The page holds no data; the data needs the admin key.
        no_key = await http.get(gw.url + "/admin/status")
        assert no_key.status_code == 401
        assert no_key.json()["error"]["code"] == "invalid_api_key"
        tenant_key = await http.get(
            gw.url + "/admin/status", headers={"authorization": "Bearer key-a"}
        )
        assert tenant_key.status_code == 401
        ok = await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)
        assert ok.status_code == 200
        validate(ok.json())


async def test_per_tenant_usage_matches_the_answers_on_metrics_and_status():
    tenants = [tenant("a"), tenant("b", rpm=2, tpm=10_000, max_concurrency=4)]
    async with (
        gateway_over([ENGINE], tenants=tenants) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        before = (await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
        validate(before)
        assert [t["name"] for t in before["tenants"]] == ["a", "b"]
        assert all(t["requests"] == 0 and t["refusals"] == {} for t in before["tenants"])

        answers = [await call(http, gw.url, "a", 7) for _ in range(3)]
        answers += [await call(http, gw.url, "b", 5) for _ in range(3)]  # the third: 429
        assert [r.status_code for r in answers] == [200] * 5 + [429]
        assert answers[-1].json()["error"]["code"] == "tenant_rpm"
        # Keys no tenant holds, and a made-up tenant name: counted under no tenant.
        stranger = await http.post(
            gw.url + "/v1/completions",
            headers={"authorization": "Bearer not-a-key", "x-tenant": "mallory"},
            json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2},
        )
        assert stranger.status_code == 401

        def used(rs, field):
            return sum(r.json()["usage"][field] for r in rs if r.status_code == 200)

        page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
        requests = samples(page, "kv_gateway_tenant_requests_total")
        assert requests == {
            frozenset({("tenant", "a")}): 3.0,
            frozenset({("tenant", "b")}): 3.0,
        }
        prompt = samples(page, "kv_gateway_tenant_prompt_tokens_total")
        completion = samples(page, "kv_gateway_tenant_completion_tokens_total")
        for name, rs in (("a", answers[:3]), ("b", answers[3:])):
            label = frozenset({("tenant", name)})
            assert prompt[label] == used(rs, "prompt_tokens")
            assert completion[label] == used(rs, "completion_tokens")
        assert completion[frozenset({("tenant", "a")})] == 21  # 3 × max_tokens 7 (ignore_eos)
        # Admitted: what rpm bounds (b's third request was refused, not admitted).
        admitted = samples(page, "kv_gateway_tenant_admitted_total")
        assert admitted == {
            frozenset({("tenant", "a")}): 3.0,
            frozenset({("tenant", "b")}): 2.0,
        }
        refusals = samples(page, "kv_gateway_tenant_refusals_total")
        assert refusals == {frozenset({("tenant", "b"), ("reason", "tenant_rpm")}): 1.0}
        # Nobody waited in the line: every outcome's series is there, at 0.
        queued = samples(page, "kv_gateway_queued_total")
        assert queued == {
            frozenset({("outcome", o)}): 0.0 for o in ("admitted", "refused", "abandoned", "failed")
        }
        assert "mallory" not in page
        in_flight = samples(page, "kv_gateway_tenant_in_flight")
        assert set(in_flight.values()) == {0.0}  # every request ended: back to exactly zero

        status = (await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
        validate(status)
        assert status["id"] != before["id"]
        assert status["generated_at"] >= before["generated_at"]
        a, b = status["tenants"]
        assert (a["requests"], b["requests"]) == (3, 3)
        assert (a["admitted"], b["admitted"]) == (3, 2)
        assert a["completion_tokens"] == 21 and a["prompt_tokens"] == used(
            answers[:3], "prompt_tokens"
        )
        assert b["refusals"] == {"tenant_rpm": 1} and a["refusals"] == {}
        assert b["limits"]["rpm"] == 2 and b["limits"]["max_concurrency"] == 4
        assert b["rate_limits"]["remaining_requests"] == 0
        assert 0 < b["rate_limits"]["remaining_tokens"] < 10_000
        assert a["rate_limits"] is None  # no rpm/tpm: no bucket to read
        assert a["in_flight"] == b["in_flight"] == 0
        assert status["traffic"]["refused"] == {"tenant_rpm": 1}
        assert status["traffic"]["admitted"] == 5
        assert status["traffic"]["queued"] == {}
        assert status["traffic"]["requests"] == {"200": 5, "invalid_api_key": 1, "tenant_rpm": 1}
        assert status["process"] == {
            "pid": status["process"]["pid"],
            "worker": None,
            "workers": 1,
            "stored_responses": {"entries": 0, "max": 10_000},  # no Responses request here
        }
        assert status["queue"] == {"length": 0, "oldest_wait_s": None}
        assert [m["name"] for m in status["models"]] == ["tiny"]


async def test_refusals_by_the_line_count_for_the_tenant_and_the_wait_shows():
    """A request that waits shows in the line's oldest wait; one the full line refuses is
    counted under `queue_full` for its tenant."""
    tight = {"max_length": 1, "max_wait_s": 5.0}
    engine = dataclasses.replace(ENGINE, num_gpu_blocks=33, decode_ms_base=4.0)
    async with (
        gateway_over([engine], tenants=[tenant("a")], queue=tight) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        # 32 usable blocks, 4 + 300 tokens = 19 blocks each: one runs, one waits, one is refused.
        first = asyncio.ensure_future(call(http, gw.url, "a", 300))
        await asyncio.sleep(0.2)
        second = asyncio.ensure_future(call(http, gw.url, "a", 300))
        waiting = None
        for _ in range(100):
            status = (await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
            if status["queue"]["length"] == 1 and status["queue"]["oldest_wait_s"] is not None:
                waiting = status
                break
            await asyncio.sleep(0.02)
        assert waiting is not None, "the second request never showed as waiting"
        assert waiting["tenants"][0]["in_flight"] == 1
        third = await call(http, gw.url, "a", 300)
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        assert [(await first).status_code, (await second).status_code] == [200, 200]
        status = (await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
        validate(status)
        assert status["tenants"][0]["refusals"] == {"queue_full": 1}
        assert status["tenants"][0]["requests"] == 3
        assert status["tenants"][0]["admitted"] == 2
        # The second waited and was admitted; the third, refused at once, never waited.
        assert status["traffic"]["queued"] == {"admitted": 1}
        page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
        queued = samples(page, "kv_gateway_queued_total")
        assert queued[frozenset({("outcome", "admitted")})] == 1.0
        assert sum(queued.values()) == 1.0


async def test_the_line_counts_who_waited_by_how_they_left():
    """A request that waits out `max_wait_s` is counted as queued and refused; one whose
    client leaves while it waits, as queued and abandoned."""
    short = {"max_length": 8, "max_wait_s": 0.5}
    engine = dataclasses.replace(ENGINE, num_gpu_blocks=33, decode_ms_base=8.0)
    async with (
        gateway_over([engine], tenants=[tenant("a")], queue=short) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        # 32 usable blocks, 19 a request: while the first runs (300 tokens, 8 ms each), the
        # others wait.
        first = asyncio.ensure_future(call(http, gw.url, "a", 300))
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=0.2) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await call(impatient, gw.url, "a", 300)
        timed_out = await call(http, gw.url, "a", 300)
        assert timed_out.status_code == 429
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        assert (await first).status_code == 200
        status = None
        for _ in range(100):  # the impatient client's departure reaches the gateway
            status = (await http.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
            if status["traffic"]["queued"].get("abandoned"):
                break
            await asyncio.sleep(0.02)
        assert status is not None
        validate(status)
        assert status["traffic"]["queued"] == {"refused": 1, "abandoned": 1}
        assert status["tenants"][0]["admitted"] == 1
        assert status["tenants"][0]["refusals"] == {"queue_timeout": 1}


@pytest.mark.parametrize("tenants", [[], [tenant("a")]])
async def test_the_default_tenant_stands_for_everyone_without_tenants(tenants):
    async with gateway_over([ENGINE], tenants=tenants) as gw:
        names = [t["name"] for t in (await gw.status())["tenants"]]
        assert names == (["default"] if not tenants else ["a"])


@pytest.mark.redis
async def test_under_two_workers_every_scrape_and_status_sums_both_workers(tmp_path):
    engine = await SimProcess(num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512).astart()
    cfg = config(engine, tenants=[tenant("a"), tenant("b", rpm=3)])
    gw = GatewayProcess(cfg, tmp_path, args=["--workers", "2"])
    try:
        await gw.astart()
        pids = await two_workers(gw)
        codes = {"a": [], "b": []}
        for name, n in (("a", 24), ("b", 5)):
            for _ in range(n):
                # A connection per request: the kernel hands each to either worker.
                async with httpx.AsyncClient(timeout=60) as fresh:
                    codes[name].append((await call(fresh, gw.url, name, 3)).status_code)
        assert codes == {"a": [200] * 24, "b": [200] * 3 + [429] * 2}

        # Each worker counted its own share, in its own file...
        shares = []
        for pid in pids:
            files = [str(f) for f in multiprocess_dir(pid).glob(f"counter_{pid}.db")]
            families = MultiProcessCollector.merge(files, accumulate=True)
            shares.append(
                sum(
                    s.value
                    for f in families
                    for s in f.samples
                    if s.name == "kv_gateway_tenant_requests_total"
                )
            )
        assert sum(shares) == 29 and all(shares), shares
        # ... and whichever worker answers, the scrape and the status show the sums.
        answered_by = set()
        for _ in range(6):
            async with httpx.AsyncClient(timeout=60) as fresh:
                page = (await fresh.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
                status = (await fresh.get(gw.url + "/admin/status", headers=ADMIN_HEADERS)).json()
            requests = samples(page, "kv_gateway_tenant_requests_total")
            assert requests == {
                frozenset({("tenant", "a")}): 24.0,
                frozenset({("tenant", "b")}): 5.0,
            }
            refusals = samples(page, "kv_gateway_tenant_refusals_total")
            assert refusals == {frozenset({("tenant", "b"), ("reason", "tenant_rpm")}): 2.0}
            completion = samples(page, "kv_gateway_tenant_completion_tokens_total")
            assert completion[frozenset({("tenant", "a")})] == 24 * 3
            validate(status)
            assert status["process"]["workers"] == 2
            answered_by.add(status["process"]["worker"])
            a, b = status["tenants"]
            assert (a["requests"], b["requests"]) == (24, 5)
            assert (a["admitted"], b["admitted"]) == (24, 3)
            assert a["completion_tokens"] == 72 and b["refusals"] == {"tenant_rpm": 2}
            assert a["in_flight"] == b["in_flight"] == 0
            assert status["traffic"]["refused"] == {"tenant_rpm": 2}
        assert answered_by <= {0, 1}
    finally:
        gw.stop()
        engine.stop()
