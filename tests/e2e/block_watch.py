"""Sample the engine's used blocks and the gateway's reserved blocks from a separate process.

A single request on the tiny model lives about a second, its last block a few tenths of one.
Sampling from a thread of the test process is not enough: while the test reads a stream, its
main thread releases and retakes the GIL on every socket read, and on a busy 2-core machine a
sampling thread can wait a whole second for it. A process of its own is scheduled by the OS.
It reads the engine's `/metrics/` (see engine_metrics.SAMPLING_PATH).

    with BlockWatch(engine_url, gateway_url) as watch:
        ...                      # the request
    watch.used                   # engine's used blocks, one per sample while non-zero
    watch.reserved               # gateway's reserved blocks, sampled less often
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parents[2]


class BlockWatch:
    def __init__(self, engine_url: str, gateway_url: str) -> None:
        self.engine_url = engine_url
        self.gateway_url = gateway_url
        self.used: list[int] = []
        self.reserved: list[int] = []
        self._proc: subprocess.Popen[str] | None = None

    def __repr__(self) -> str:
        return f"BlockWatch(used={self.used}, reserved={self.reserved})"

    def __enter__(self) -> BlockWatch:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.block_watch", self.engine_url, self.gateway_url],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        # The first line says the sampler is up (imports done, first sample taken).
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("block watcher did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate(input="stop\n", timeout=30)
        for line in out.splitlines():
            source, value = json.loads(line)
            (self.used if source == "engine" else self.reserved).append(value)


def _sample_until_stdin_closes(engine_url: str, gateway_url: str) -> None:
    import selectors

    from tests.e2e.engine_metrics import SAMPLING_PATH, scrape

    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    with httpx.Client(timeout=30) as http:
        scrape(engine_url, http, path=SAMPLING_PATH)
        print("ready", flush=True)
        while not selector.select(timeout=0):
            engine = scrape(engine_url, http, path=SAMPLING_PATH)
            if engine.kv_cache_usage_perc:
                print(json.dumps(["engine", round(engine.used_blocks)]), flush=True)
            status = http.get(f"{gateway_url}/admin/status").json()
            reserved = status["engines"][0]["reserved_blocks"]
            if reserved:
                print(json.dumps(["gateway", reserved]), flush=True)
            time.sleep(0.02)


if __name__ == "__main__":
    _sample_until_stdin_closes(sys.argv[1], sys.argv[2])
