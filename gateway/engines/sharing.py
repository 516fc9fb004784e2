"""One engine monitor per host under `serve --workers N`: the lead worker probes, the others
read what it found.

The lead worker's `SharedMonitor` probes the engines as any `EngineMonitor` does and, after
every round, writes its pool (specs, health, what the engines reported, the foreign load) to
a JSON file in the workers' run directory, atomically (`os.replace`). The other workers'
monitors read that file every `scrape_interval_s` and take it over instead of probing, so
the engines see one set of probes per host, not N. A follower whose snapshot is older than
`STALE_AFTER_INTERVALS` scrape intervals plus the probe timeout (the lead worker died and is
being restarted) probes for itself until a fresh one appears again.

What stays per worker: ejections on the data plane (a worker whose request failed on an
engine ejects it at once, locally; the lead's next snapshot readmits it if its probe
succeeds), and the front-door "full" marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.core.ledger import Foreign
from gateway.engines.monitor import EngineMonitor
from gateway.engines.pool import EnginePool

log = logging.getLogger(__name__)

STALE_AFTER_INTERVALS = 3
SNAPSHOT_NAME = "engines.json"


@dataclass(frozen=True, slots=True)
class SharedPool:
    """Where the workers of one `serve --workers N` share their pool, and whether this
    worker is the one that probes."""

    directory: Path
    lead: bool

    @property
    def path(self) -> Path:
        return self.directory / SNAPSHOT_NAME


def snapshot(pool: EnginePool, now: float) -> dict[str, Any]:
    """The pool as the lead worker sees it (JSON-ready); `now` is wall-clock time."""
    engines = []
    for e in pool:
        spec = asdict(e.spec)
        spec["models"] = sorted(e.spec.models)
        engines.append(
            {
                "spec": spec,
                "sources": e.sources,
                "healthy": e.healthy,
                "last_error": e.last_error,
                "failures": e.failures,
                "used_blocks": e.used_blocks,
                "running": e.running,
                "waiting": e.waiting,
                "kv_cache_usage": e.kv_cache_usage,
                "preemptions": e.preemptions,
                "scraped_ago_s": None if e.last_scrape is None else pool.clock() - e.last_scrape,
                "foreign": [e.foreign.seqs, e.foreign.blocks],
                "missing": list(e.missing),
            }
        )
    return {"at": now, "engines": engines}


def write(pool: EnginePool, path: Path, now: float) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(snapshot(pool, now)))
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def apply(pool: EnginePool, snap: dict[str, Any]) -> None:
    """Take over the lead worker's view of every engine this pool knows."""
    for got in snap.get("engines", []):
        spec = dict(got["spec"])
        state = pool.get(spec["name"])
        if state is None:
            continue
        spec["models"] = frozenset(spec["models"])
        changes = {k: v for k, v in spec.items() if k not in ("name", "url")}
        pool.update_spec(state.spec.name, "the lead worker", **changes)
        state.sources.update(got["sources"])
        if got["healthy"] and not state.healthy:
            pool.mark_healthy(state.spec.name)
        elif not got["healthy"] and state.healthy:
            pool.mark_unhealthy(state.spec.name, got["last_error"] or "unhealthy", retry_at=0.0)
        state.failures = got["failures"]
        state.used_blocks, state.running = got["used_blocks"], got["running"]
        state.waiting, state.kv_cache_usage = got["waiting"], got["kv_cache_usage"]
        state.preemptions = got["preemptions"]
        ago = got["scraped_ago_s"]
        state.last_scrape = None if ago is None else pool.clock() - ago
        state.foreign = Foreign(*got["foreign"])
        state.missing = tuple(got["missing"])


class SharedMonitor(EngineMonitor):
    """An `EngineMonitor` that probes and writes the snapshot (the lead worker), or reads
    and applies it, probing itself only while it is stale (the others)."""

    def __init__(self, *args: Any, shared: SharedPool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared = shared
        self.stale_after_s = STALE_AFTER_INTERVALS * self.cfg.scrape_interval_s + self.cfg.timeout_s
        self.probing = shared.lead

    async def _run(self) -> None:
        while True:
            started = self.clock()
            if self.shared.lead:
                self.pool.probing()
                await self.probe_all()
                with contextlib.suppress(OSError):
                    write(self.pool, self.shared.path, time.time())
                # Only the lead's own waiters can ask it for fresh figures sooner.
                await self.pause(started)
            else:
                await self.follow()
                await asyncio.sleep(max(0.0, self.cfg.scrape_interval_s - (self.clock() - started)))

    async def follow(self) -> None:
        snap = read(self.shared.path)
        fresh = snap is not None and time.time() - float(snap["at"]) <= self.stale_after_s
        if fresh and snap is not None:
            if self.probing:
                log.info("engine figures from the lead worker again")
            self.probing = False
            apply(self.pool, snap)
            return
        if not self.probing:
            log.warning("the lead worker's engine figures are stale: probing the engines here")
        self.probing = True
        await self.probe_all()
