"""The engine's `/metrics/` and the gateway's `/admin/status`, sampled side by side for a whole
run, zeros included, from a process of its own (why a process: tests/e2e/block_watch.py).

Each sample reads the engine first, then the gateway, then sleeps 20 ms, as block_watch does;
so an engine reading falls between the gateway readings of its own sample and of the one before
it, and "at the same moment" means against either of those two (`Sample.bracket`).

    with LedgerWatch(engine_url, gateway_url) as watch:
        ...                      # the load
    watch.samples                # one Sample per iteration
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the watcher started
    used: int  # the engine's used blocks: kv_cache_usage_perc x (num_gpu_blocks - 1), rounded
    running: int
    waiting: int
    preemptions: float  # vllm:num_preemptions_total
    reserved: int  # the gateway's reserved blocks on the engine, read just after
    reserved_seqs: int


def brackets(samples: list[Sample]) -> list[tuple[Sample, int]]:
    """Each sample with the most the gateway reserved around its engine reading: the larger of
    the gateway's readings just before it (the previous sample's) and just after it (its own)."""
    out = []
    for i, sample in enumerate(samples):
        before = samples[i - 1].reserved if i else sample.reserved
        out.append((sample, max(before, sample.reserved)))
    return out


class LedgerWatch:
    def __init__(self, engine_url: str, gateway_url: str) -> None:
        self.engine_url = engine_url
        self.gateway_url = gateway_url
        self.samples: list[Sample] = []
        self._proc: subprocess.Popen[str] | None = None

    def __repr__(self) -> str:
        return f"LedgerWatch({len(self.samples)} samples)"

    def __enter__(self) -> LedgerWatch:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.ledger_watch", self.engine_url, self.gateway_url],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("ledger watcher did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate(input="stop\n", timeout=30)
        self.samples = [Sample(*json.loads(line)) for line in out.splitlines()]


def _sample_until_stdin_closes(engine_url: str, gateway_url: str) -> None:
    import selectors

    from tests.e2e.engine_metrics import SAMPLING_PATH, scrape

    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    start = time.monotonic()
    with httpx.Client(timeout=30) as http:
        scrape(engine_url, http, path=SAMPLING_PATH)
        print("ready", flush=True)
        while not selector.select(timeout=0):
            t = time.monotonic() - start
            engine = scrape(engine_url, http, path=SAMPLING_PATH)
            status = http.get(f"{gateway_url}/admin/status").json()["engines"][0]
            row = [
                round(t, 3),
                round(engine.used_blocks),
                int(engine.running),
                int(engine.waiting),
                engine.num_preemptions_total,
                status["reserved_blocks"],
                status["reserved_seqs"],
            ]
            print(json.dumps(row), flush=True)
            time.sleep(0.02)


if __name__ == "__main__":
    _sample_until_stdin_closes(sys.argv[1], sys.argv[2])
