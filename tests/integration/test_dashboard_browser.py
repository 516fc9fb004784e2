"""The dashboard in a real headless Chromium (Debian's, driven by Playwright with
`executable_path`: Playwright's own browser download cannot work offline), over a gateway in
front of a simulated engine under load: the page renders, what it shows equals the snapshot
it fetched (the snapshot's id is on the page), and it updates; its rates (queued/s, a
tenant's admissions against its `rpm`) are those of the snapshots it fetched; a wrong key,
or one the browser cannot send, stops it with the same message.
`KVGW_DASHBOARD_SCREENSHOT=path` keeps a screenshot (docs/img/dashboard.png was taken so)."""

import asyncio
import contextlib
import dataclasses
import math
import os
import re
from pathlib import Path

import httpx
import pytest

from tests.admin import ADMIN_KEY
from tests.integration.conftest import gateway_over
from tests.integration.test_tenants import ENGINE, call, tenant

CHROMIUM = Path("/usr/bin/chromium")
playwright = pytest.importorskip("playwright.async_api", reason="Playwright (pip: playwright)")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is not installed (apt-get install chromium)"
)


async def load(url: str, name: str, stop: asyncio.Event, max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            if (await call(http, url, name, max_tokens)).status_code != 200:
                await asyncio.sleep(0.3)  # a client backing off after a refusal


def shown(doc: dict) -> dict:
    """What the page must show for snapshot `doc`, as the page formats it (en-US)."""
    return {
        "id": doc["id"],
        "queue": f"{doc['queue']['length']:,}",
        "tenants": {
            t["name"]: {
                "tokens": f"{t['prompt_tokens']:,} + {t['completion_tokens']:,}",
                "in_flight": f"{t['in_flight']:,}",
                "refusals": ", ".join(f"{r} {n}" for r, n in t["refusals"].items()) or "none",
            }
            for t in doc["tenants"]
        },
        "engines": {e["name"]: f"held {e['reserved_blocks']:,}" for e in doc["engines"]},
    }


READ_PAGE = """() => ({
  id: document.body.dataset.snapshotId,
  queue: document.getElementById("queue-length").textContent,
  tenants: Object.fromEntries([...document.querySelectorAll("#tenants tbody tr")].map((r) => [
    r.dataset.tenant,
    {
      tokens: r.querySelector('[data-field="tokens"]').textContent,
      in_flight: r.querySelector('[data-field="in_flight"]').textContent.split(" / ")[0],
      refusals: r.querySelector('[data-field="refusals"]').textContent,
    },
  ])),
  engines: Object.fromEntries([...document.querySelectorAll(".engine")].map((e) => [
    e.dataset.engine,
    e.querySelector(".figures").textContent.split(" · ")[0].replace("KV blocks: ", ""),
  ])),
})"""


READ_RATES = """() => ({
  id: document.body.dataset.snapshotId,
  queued: document.getElementById("queued-rate").textContent,
  total: document.getElementById("queued-total").textContent,
  outcomes: document.getElementById("queued-outcomes").textContent,
  admitted: Object.fromEntries([...document.querySelectorAll("#tenants tbody tr")].map((r) => [
    r.dataset.tenant, r.querySelector('[data-field="admitted"]').textContent,
  ])),
})"""


def seen_by_page(snapshots: dict[str, dict], last_id: str) -> list[dict]:
    """The page's history when it drew `last_id`: every snapshot it fetched until then."""
    until = snapshots[last_id]["generated_at"]
    return sorted(
        (d for d in snapshots.values() if d["generated_at"] <= until),
        key=lambda d: d["generated_at"],
    )


def queued(doc: dict) -> int:
    return sum(doc["traffic"]["queued"].values())


def admitted(doc: dict, name: str) -> int:
    return next(t["admitted"] for t in doc["tenants"] if t["name"] == name)


def requests(doc: dict, name: str) -> int:
    return next(t["requests"] for t in doc["tenants"] if t["name"] == name)


async def test_the_page_shows_its_snapshot_and_updates_under_load():
    # Room for about 9 requests of team-a's per engine: some of its 24 clients wait in line.
    engine = dataclasses.replace(ENGINE, num_gpu_blocks=129, decode_ms_base=8.0)
    tenants = [tenant("team-a", max_concurrency=20), tenant("team-b", rpm=5)]
    async with gateway_over([engine, engine], tenants=tenants) as gw:
        stop = asyncio.Event()
        loaders = [asyncio.ensure_future(load(gw.url, "team-a", stop, 200)) for _ in range(24)]
        loaders += [asyncio.ensure_future(load(gw.url, "team-b", stop, 40)) for _ in range(2)]
        snapshots: dict[str, dict] = {}
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(
                    executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
                )
                page = await browser.new_page(viewport={"width": 1280, "height": 1100})

                async def keep(response):
                    if response.url.endswith("/admin/status") and response.ok:
                        doc = await response.json()
                        snapshots[doc["id"]] = doc

                page.on("response", keep)
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                # The page's own CSP violations would show here.
                page.on("console", lambda m: m.type == "error" and errors.append(m.text))
                await page.goto(gw.url + "/dashboard")
                # Without the key the page's poll is refused, and it says so.
                await page.wait_for_function(
                    "() => document.getElementById('state').dataset.state === 'error'"
                )
                assert (await page.text_content("#state")).startswith(
                    "401: You didn't provide an API key"
                )
                assert errors == [
                    "Failed to load resource: the server responded with a status of 401 "
                    "(Unauthorized)"
                ]
                errors.clear()
                asked: list[str] = []  # the page's requests for its data
                page.on(
                    "request",
                    lambda r: (
                        r.url.endswith("/admin/status")
                        and asked.append(r.headers.get("authorization", ""))
                    ),
                )

                async def connect(key: str) -> None:
                    await page.click("#forget")  # "not connected": what follows is the key's
                    await page.fill("#key", key)
                    await page.click("#key-form button[type=submit]")
                    await page.wait_for_function(
                        "() => document.getElementById('state').dataset.state === 'error'"
                    )

                # A wrong key: the gateway's 401, and the page stops polling.
                await connect("not-the-admin-key")
                wrong = await page.text_content("#state")
                assert wrong == "401: Incorrect admin key provided."
                assert asked == ["Bearer not-the-admin-key"]
                # Keys the browser cannot send as typed (fetch throws on "€", would send "é"
                # as Latin-1): refused by the page itself, in the same words, nothing sent,
                # and no poll after.
                for key in (ADMIN_KEY + "é", ADMIN_KEY + "€"):
                    await connect(key)
                    assert await page.text_content("#state") == wrong
                await page.wait_for_timeout(2_500)  # longer than a poll's interval
                assert await page.text_content("#state") == wrong
                assert asked == ["Bearer not-the-admin-key"]
                assert errors == [
                    "Failed to load resource: the server responded with a status of 401 "
                    "(Unauthorized)"
                ]
                errors.clear()
                await page.fill("#key", ADMIN_KEY)
                await page.click("#key-form button[type=submit]")
                await page.wait_for_function(
                    "() => document.querySelectorAll('#tenants tbody tr').length === 2",
                    timeout=15_000,
                )
                await page.wait_for_timeout(5_000)  # a few polls: sparklines, rates
                first = await page.evaluate(READ_PAGE)
                assert first["id"] in snapshots
                assert first == shown(snapshots[first["id"]])
                assert await page.text_content("#state") == "live, every 2 s"
                # It updates: a new snapshot, with more tokens served. Two polls on: team-a's
                # requests end in waves about a poll's interval apart, and one interval can
                # fall between two waves.
                await page.wait_for_function(
                    f"() => document.body.dataset.snapshotId !== {first['id']!r}", timeout=10_000
                )
                await page.wait_for_timeout(2_500)
                second = await page.evaluate(READ_PAGE)
                assert second["id"] != first["id"]
                assert second == shown(snapshots[second["id"]])
                a1 = snapshots[first["id"]]["tenants"][0]
                a2 = snapshots[second["id"]]["tenants"][0]
                assert a2["completion_tokens"] > a1["completion_tokens"]
                assert "tenant_rpm" in snapshots[second["id"]]["tenants"][1]["refusals"]
                # Queued/s: the requests that left the line over the last poll's interval.
                rates = await page.evaluate(READ_RATES)
                seen = seen_by_page(snapshots, rates["id"])
                before, last = seen[-2], seen[-1]
                per_s = (queued(last) - queued(before)) / (
                    last["generated_at"] - before["generated_at"]
                )
                # team-a's clients wait for room; its first ones and team-b's did not.
                assert 0 < queued(last) < last["traffic"]["admitted"]
                assert rates["total"] == f"{queued(last):,}"
                assert math.isclose(float(rates["queued"].replace(",", "")), per_s, abs_tol=0.051)
                assert rates["outcomes"].startswith("admitted ")
                # team-b's admissions over the page's last minute (here: since it connected),
                # counted against its rpm, apart from its refusals.
                cell = re.fullmatch(
                    r"(\d+)(?: in (\d+) s)? / 5 \((\d+) left\)", rates["admitted"]["team-b"]
                )
                assert cell, rates["admitted"]["team-b"]
                span = last["generated_at"] - seen[0]["generated_at"]
                count = admitted(last, "team-b") - admitted(seen[0], "team-b")
                assert (int(cell[1]), cell[2]) == (count, f"{span:.0f}")
                assert count <= 5 + math.ceil(span * 5 / 60)  # the bucket: 5 at once, 5 a minute
                assert requests(last, "team-b") - requests(seen[0], "team-b") > count
                # Drawn: two engines' bars, sparklines with points.
                assert await page.locator(".engine svg rect.held").count() >= 2
                assert await page.locator("#spark-admitted polyline").count() == 1
                assert await page.locator("#spark-queued polyline").count() == 1
                assert errors == []
                if os.environ.get("KVGW_DASHBOARD_SCREENSHOT"):
                    await page.screenshot(
                        path=os.environ["KVGW_DASHBOARD_SCREENSHOT"], full_page=True
                    )
                await browser.close()
        finally:
            stop.set()
            for task in loaders:
                task.cancel()
            for task in loaders:
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
