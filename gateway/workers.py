"""`kv-gateway serve --workers N`: N gateway processes on one port, sharing their state.

The supervisor (this module, the process the user started) binds the listening socket once
and starts N workers — each a `kv-gateway serve` of the same config, handed the socket (the
kernel gives each new connection to one of them) and its place (`KVGW_WORKER=i/N:fd`). Every
worker is a replica as under several `serve` processes: its leases, waiters and tenant
limits live in Redis, so N > 1 needs `redis:` (in-process state cannot be shared across
processes: each would admit against the whole engines, over-committing them N-fold).

What each piece does per process (docs/operations.md, "Several workers per host"):

- Prometheus: multiprocess mode in a private directory; one scrape sees every worker
  (`gateway/metrics.py`).
- The engine monitor: worker 0 probes and shares what it finds; the others read it
  (`gateway/engines/sharing.py`).
- SIGHUP reaches every worker (each reads the config file again); SIGTERM / SIGINT drain
  every worker, then the supervisor exits; a worker that dies otherwise (a crash, SIGKILL)
  is started again after `RESTART_AFTER_S` — its leases and queue entries expire in Redis
  within `lease_ttl_s`, like a dead replica's.
- Release-rate and output-length estimates, client connection caps and `/admin/status`'s
  engine figures are per worker (the status's store figures are global).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.metrics import MULTIPROCESS_DIR

log = logging.getLogger("gateway")

WORKER_ENV = "KVGW_WORKER"
RUN_DIR_ENV = "KVGW_RUN_DIR"
RESTART_AFTER_S = 1.0


class WorkersRefused(ValueError):
    """`--workers N` cannot run with this configuration; the message says why."""


def check(cfg: GatewayConfig, workers: int) -> None:
    if workers < 1:
        raise WorkersRefused("--workers must be at least 1")
    if workers > 1 and cfg.redis is None:
        raise WorkersRefused(
            f"--workers {workers} needs shared state: configure `redis:` (several processes "
            "with in-process state would each admit against the whole engines and "
            "over-commit them); or run one worker"
        )


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening, inheritable: every worker accepts on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def worker_argv(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        args.config,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        "--drain-s",
        str(args.drain_s),
    ]


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.count = args.workers
        self.sock = listening_socket(args.host, args.port)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvgw-workers-"))
        (self.run_dir / "metrics").mkdir()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self.stopping = False

    def spawn(self, index: int) -> None:
        env = {
            **os.environ,
            WORKER_ENV: f"{index}/{self.count}:{self.sock.fileno()}",
            RUN_DIR_ENV: str(self.run_dir),
            MULTIPROCESS_DIR: str(self.run_dir / "metrics"),
        }
        proc = subprocess.Popen(
            worker_argv(self.args), env=env, pass_fds=(self.sock.fileno(),), close_fds=True
        )
        self.procs[index] = proc
        log.info("worker %d started (pid %d)", index, proc.pid)

    def signal_all(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def run(self) -> int:
        def stop(signum: int, _frame: object) -> None:
            if self.stopping:  # a second signal: stop now, as a single `serve` does
                self.signal_all(signal.SIGKILL)
            self.stopping = True
            self.signal_all(signal.SIGTERM)

        def reload(_signum: int, _frame: object) -> None:
            self.signal_all(signal.SIGHUP)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, reload)
        log.info(
            "kv-gateway listening on http://%s:%d with %d workers",
            self.args.host,
            self.args.port,
            self.count,
        )
        try:
            for i in range(self.count):
                self.spawn(i)
            return self.watch()
        finally:
            self.signal_all(signal.SIGKILL)
            self.sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def watch(self) -> int:
        from prometheus_client import multiprocess

        restart_at: dict[int, float] = {}
        while True:
            alive = 0
            for i, proc in enumerate(self.procs):
                if proc is None:
                    if not self.stopping and time.monotonic() >= restart_at.get(i, 0.0):
                        self.spawn(i)
                        alive += 1
                    continue
                code = proc.poll()
                if code is None:
                    alive += 1
                    continue
                multiprocess.mark_process_dead(proc.pid, str(self.run_dir / "metrics"))  # type: ignore[no-untyped-call]
                self.procs[i] = None
                if not self.stopping:
                    log.warning(
                        "worker %d (pid %d) exited with %s; starting it again in %g s",
                        i,
                        proc.pid,
                        code,
                        RESTART_AFTER_S,
                    )
                    restart_at[i] = time.monotonic() + RESTART_AFTER_S
                    alive += 1  # counted until it is back
            if self.stopping and alive == 0:
                return 0
            time.sleep(0.1)


def supervise(args: argparse.Namespace) -> int:
    return Supervisor(args).run()


def worker_place() -> tuple[int, int, int] | None:
    """(index, count, listening fd) when this process is one of `serve --workers N`."""
    raw = os.environ.get(WORKER_ENV)
    if not raw:
        return None
    place, _, fd = raw.partition(":")
    index, _, count = place.partition("/")
    return int(index), int(count), int(fd)
