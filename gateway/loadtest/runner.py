"""One load run: schedules → requests → records.

Open-loop tenants send on their arrival schedule whatever the answers do (a request that
cannot start because `max_concurrency` are in flight waits in the client, and the lag is
recorded); closed-loop tenants keep `concurrency` requests in flight. A session's turns go
one after the other, each re-sending the conversation so far, to the same base URL.

Bounds: `max_requests` (requests sent, turns included) and `duration_s` (no request starts
after it; those in flight get `drain_s` more, then are cancelled). `stop()` (Ctrl-C) cancels
everything in flight; every request started has a record either way, `cancelled` if it did
not finish. The client watches itself: how late it sends against the schedule and how much
of a core it uses; `warnings` says when either makes the figures the client's rather than
the target's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.loadtest import retry
from gateway.loadtest.arrivals import Arrivals, Rate
from gateway.loadtest.client import Answer, Client, request_body
from gateway.loadtest.prompts import Built, PromptBuilder
from gateway.loadtest.records import (
    CANCELLED,
    ERROR,
    OK,
    REFUSED,
    Attempt,
    RequestRecord,
)
from gateway.loadtest.workload import RequestSpec, TenantLoad, draw, next_turn_input

LAG_WARN_S = 0.050  # p95 lag beyond this: the schedule was not kept
CPU_WARN_SHARE = 0.90  # a window at 90 % of one core: the client is the bottleneck
CPU_WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class RunConfig:
    tenants: tuple[TenantLoad, ...]
    model: str
    max_requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    retry_429: int = 0
    seed: int = 0
    max_model_len: int | None = None
    drain_s: float = 600.0
    trace: tuple[RequestSpec, ...] = ()
    trace_arrivals: Arrivals | None = None

    def validate(self) -> None:
        if not self.tenants:
            raise ValueError("no tenants to run")
        for tenant in self.tenants:
            tenant.validate()
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("--requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration must be positive")
        if self.max_requests is None and self.duration_s is None and not self.trace:
            raise ValueError("bound the run with --requests or --duration (or replay a trace)")
        if self.warmup < 0 or self.retry_429 < 0:
            raise ValueError("--warmup and --retry-429 must not be negative")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_epoch: float
    wall_s: float
    interrupted: bool
    client: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class Runner:
    def __init__(
        self,
        cfg: RunConfig,
        builder: PromptBuilder,
        client: Client,
        *,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.builder = builder
        self.client = client
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._issued = 0
        self._index = itertools.count()
        self._session_ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._drivers: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._t0 = 0.0
        self._deadline: float | None = None
        self._tenants = {t.name: t for t in cfg.tenants}
        self._cpu_windows: list[float] = []

    # -- control --------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop now: no new requests; those in flight are cancelled and recorded."""
        self._stopped.set()
        # Closed-loop drivers run their sessions themselves: cancel them too.
        for task in [*self._drivers, *self._tasks]:
            task.cancel()

    @property
    def sent(self) -> int:
        return self._issued

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _may_issue(self) -> bool:
        if self._stopped.is_set():
            return False
        if self.cfg.max_requests is not None and self._issued >= self.cfg.max_requests:
            return False
        return self._deadline is None or time.perf_counter() < self._deadline

    # -- the run --------------------------------------------------------------------------

    async def run(self) -> RunResult:
        epoch = time.time()
        self._t0 = time.perf_counter()
        if self.cfg.duration_s is not None:
            self._deadline = self._t0 + self.cfg.duration_s
        cpu_start = time.process_time()
        watcher = asyncio.create_task(self._watch_cpu())
        drivers = self._drivers
        if self.cfg.trace:
            drivers.append(asyncio.create_task(self._replay()))
        else:
            for tenant in self.cfg.tenants:
                rng = random.Random(f"{self.cfg.seed}:{tenant.name}")
                if tenant.arrivals is not None:
                    drivers.append(asyncio.create_task(self._open_loop(tenant, rng)))
                else:
                    for worker in range(tenant.concurrency or 1):
                        wrng = random.Random(f"{self.cfg.seed}:{tenant.name}:{worker}")
                        drivers.append(asyncio.create_task(self._closed_loop(tenant, wrng)))
        interrupted = False
        try:
            await asyncio.gather(*drivers)
            await self._drain()
        except asyncio.CancelledError:
            interrupted = True
        finally:
            interrupted = interrupted or self._stopped.is_set()
            for task in [*drivers, *self._tasks]:
                task.cancel()
            await asyncio.gather(*drivers, *self._tasks, return_exceptions=True)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        wall = time.perf_counter() - self._t0
        cpu = time.process_time() - cpu_start
        result = RunResult(sorted(self.records, key=lambda r: r.index), epoch, wall, interrupted)
        result.client = {
            "cpu_s": round(cpu, 3),
            "cpu_share_of_core": round(cpu / wall, 3) if wall > 0 else 0.0,
            "peak_window_share": round(max(self._cpu_windows, default=0.0), 3),
        }
        result.warnings = self._warnings(result)
        return result

    async def _drain(self) -> None:
        if not self._tasks:
            return
        done_by = self.cfg.drain_s
        if self._deadline is not None:
            done_by = max(0.0, self._deadline + self.cfg.drain_s - time.perf_counter())
        _, pending = await asyncio.wait(set(self._tasks), timeout=done_by)
        for task in pending:
            task.cancel()

    async def _sleep_until(self, offset: float) -> bool:
        """Sleep until `offset` from the start; False if the run stops first."""
        delay = self._t0 + offset - time.perf_counter()
        if self._deadline is not None and self._t0 + offset >= self._deadline:
            return False
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)
        return self._may_issue()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_loop(self, tenant: TenantLoad, rng: random.Random) -> None:
        assert tenant.arrivals is not None
        limit = asyncio.Semaphore(tenant.max_concurrency) if tenant.max_concurrency else None
        # Everything at once has no schedule to keep: its send lag means nothing.
        timed = not (isinstance(tenant.arrivals, Rate) and math.isinf(tenant.arrivals.rate))
        for offset in tenant.arrivals.offsets(rng):
            if not self._may_issue():
                return
            # The prompt is built before the wait, so that building it never delays the send.
            spec = draw(tenant, rng, self.cfg.max_model_len)
            request_rng = random.Random(rng.getrandbits(32))
            built = self._build(tenant, spec, request_rng, None, "", 1)
            if not await self._sleep_until(offset):
                return
            self._issued += 1
            scheduled = offset if timed else None
            self._spawn(self._session(tenant, spec, request_rng, scheduled, limit, built))
            await asyncio.sleep(0)  # let the request start before the next sleep is computed

    async def _closed_loop(self, tenant: TenantLoad, rng: random.Random) -> None:
        while self._may_issue():
            spec = draw(tenant, rng, self.cfg.max_model_len)
            self._issued += 1
            await self._session(tenant, spec, rng, None, None, None)

    async def _replay(self) -> None:
        arrivals = self.cfg.trace_arrivals
        assert arrivals is not None
        rng = random.Random(f"{self.cfg.seed}:trace")
        default = self.cfg.tenants[0]
        for spec, offset in zip(self.cfg.trace, arrivals.offsets(rng), strict=False):
            if not self._may_issue():
                return
            tenant = self._tenants.get(spec.tenant, default)
            request_rng = random.Random(rng.getrandbits(32))
            built = self._build(tenant, spec, request_rng, None, "", 1)
            if not await self._sleep_until(offset):
                return
            self._issued += 1
            self._spawn(self._session(tenant, spec, request_rng, offset, None, built))
            await asyncio.sleep(0)

    # -- one session: its turns in order --------------------------------------------------

    async def _session(
        self,
        tenant: TenantLoad,
        spec: RequestSpec,
        rng: random.Random,
        scheduled: float | None,
        limit: asyncio.Semaphore | None,
        first: Built | None,
    ) -> None:
        session = next(self._session_ids) if spec.turns > 1 else None
        base_url = self.client.pick()
        history: list[dict[str, Any]] | None = None
        before = ""
        for turn in range(1, spec.turns + 1):
            if turn > 1:
                if not self._may_issue():
                    return
                self._issued += 1
                if tenant.shape.think_time_s:
                    await asyncio.sleep(tenant.shape.think_time_s)
                # The next turn adds a user message of a freshly drawn length.
                shape = tenant.shape
                spec = RequestSpec(
                    tenant.name, next_turn_input(shape, rng), shape.output_len.sample(rng)
                )
            if turn == 1 and first is not None:
                built = first
            else:
                built = self._build(tenant, spec, rng, history, before, turn)
            if limit is not None:
                async with limit:
                    record, answer = await self._one(
                        tenant, spec, built, base_url, scheduled, session, turn, rng
                    )
            else:
                record, answer = await self._one(
                    tenant, spec, built, base_url, scheduled, session, turn, rng
                )
            scheduled = None
            if not record.ok or answer is None:
                return
            if built.messages is not None:
                history = [*built.messages, {"role": "assistant", "content": answer.text}]
            elif isinstance(built.prompt, str):
                before = built.prompt + answer.text

    def _build(
        self,
        tenant: TenantLoad,
        spec: RequestSpec,
        rng: random.Random,
        history: list[dict[str, Any]] | None,
        before: str,
        turn: int,
    ) -> Built:
        shape = tenant.shape
        prefix = spec.prefix if turn == 1 else None
        if shape.api == "chat":
            return self.builder.chat(
                spec.input_tokens,
                rng,
                prefix=prefix,
                hash_ids=spec.hash_ids,
                block_tokens=spec.block_tokens,
                history=history,
            )
        return self.builder.completion(
            spec.input_tokens,
            rng,
            prefix=prefix,
            hash_ids=spec.hash_ids,
            block_tokens=spec.block_tokens,
            before=before,
            token_ids=shape.token_ids,
        )

    async def _one(
        self,
        tenant: TenantLoad,
        spec: RequestSpec,
        built: Built,
        base_url: str,
        scheduled: float | None,
        session: int | None,
        turn: int,
        rng: random.Random,
    ) -> tuple[RequestRecord, Answer | None]:
        shape = tenant.shape
        index = next(self._index)
        body = request_body(
            shape.api,
            built,
            model=self.cfg.model,
            max_tokens=spec.output_tokens,
            stream=shape.stream,
            ignore_eos=shape.ignore_eos,
        )
        attempts: list[Attempt] = []
        answer: Answer | None = None
        first_sent = time.perf_counter()
        common: dict[str, Any] = {
            "index": index,
            "tenant": tenant.name,
            "api": shape.api,
            "stream": shape.stream,
            "input_tokens": built.prompt_tokens,
            "max_tokens": spec.output_tokens,
            "scheduled_s": scheduled,
            "session": session,
            "turn": turn,
            "prefix_group": spec.prefix[0] if spec.prefix and turn == 1 else None,
            "warmup": index < self.cfg.warmup,
            "target": self.client.target_of(base_url),
        }
        try:
            for retries in range(self.cfg.retry_429 + 1):
                answer = await self.client.send(
                    shape.api,
                    body,
                    stream=shape.stream,
                    api_key=tenant.api_key,
                    base_url=base_url,
                )
                attempt = Attempt(
                    sent_s=answer.started - self._t0,
                    status=answer.status,
                    answered_s=answer.answered - self._t0,
                    code=answer.code,
                    advised_s=retry.advised_delay(answer.headers, time.time())
                    if answer.status == 429
                    else None,
                )
                if answer.status != 429 or retries == self.cfg.retry_429:
                    attempts.append(attempt)
                    break
                wait = retry.delay(answer.headers, retries, rng, time.time())
                attempts.append(_with_wait(attempt, wait.seconds))
                if wait.seconds > 0:
                    await asyncio.sleep(wait.seconds)
        except asyncio.CancelledError:
            record = RequestRecord(
                outcome=CANCELLED,
                status=answer.status if answer else 0,
                sent_s=first_sent - self._t0,
                done_s=self.now(),
                attempts=tuple(attempts),
                **common,
            )
            self._keep(record)
            raise
        assert answer is not None
        record = _finished(common, answer, attempts, first_sent, self._t0)
        self._keep(record)
        return record, answer

    def _keep(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    # -- watching the client itself -------------------------------------------------------

    async def _watch_cpu(self) -> None:
        while True:
            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.sleep(CPU_WINDOW_S)
            spent = time.perf_counter() - wall
            if spent > 0:
                self._cpu_windows.append((time.process_time() - cpu) / spent)

    def _warnings(self, result: RunResult) -> list[str]:
        found: list[str] = []
        lags = sorted(r.lag_s for r in result.records if r.lag_s is not None and not r.warmup)
        if lags:
            p95 = lags[min(len(lags) - 1, int(0.95 * len(lags)))]
            if p95 > LAG_WARN_S:
                found.append(
                    f"the client lagged its schedule: p95 send lag {p95 * 1000:.0f} ms "
                    "(a busy client machine, or --max-concurrency holding requests back); "
                    "the arrival rate was lower than asked"
                )
        peak = result.client.get("peak_window_share", 0.0)
        if peak >= CPU_WARN_SHARE:
            found.append(
                f"the client used {peak:.0%} of a core in its busiest second: it may be the "
                "bottleneck (run it on another machine, or lower the load)"
            )
        return found


def _with_wait(attempt: Attempt, waited: float) -> Attempt:
    return Attempt(
        attempt.sent_s,
        attempt.status,
        attempt.answered_s,
        attempt.code,
        attempt.advised_s,
        round(waited, 6),
    )


def _finished(
    common: dict[str, Any],
    answer: Answer,
    attempts: Sequence[Attempt],
    first_sent: float,
    t0: float,
) -> RequestRecord:
    status = answer.status
    if status == 200 and answer.code is None:
        outcome = OK
    elif status == 429:
        outcome = REFUSED
    else:
        outcome = ERROR
    ttft = e2e = tpot = None
    itl: tuple[float, ...] = ()
    if outcome == OK:
        times = answer.token_times
        if common["stream"]:
            if not times:
                outcome = ERROR
                answer.code = "no_tokens"
            else:
                ttft = times[0] - first_sent
                e2e = times[-1] - first_sent
                itl = tuple(round(b - a, 6) for a, b in itertools.pairwise(times))  # µs: enough
        else:
            e2e = answer.finished - first_sent
        out = answer.completion_tokens
        if ttft is not None and e2e is not None and out is not None and out > 1:
            tpot = (e2e - ttft) / (out - 1)
    reason = answer.code
    if outcome == OK and answer.prompt_tokens not in (None, common["input_tokens"]):
        reason = "prompt_tokens_mismatch"
    return RequestRecord(
        outcome=outcome,
        status=status,
        sent_s=first_sent - t0,
        done_s=answer.finished - t0,
        reason=reason,
        prompt_tokens=answer.prompt_tokens,
        output_tokens=answer.completion_tokens if outcome == OK else None,
        ttft_s=ttft,
        e2e_s=e2e,
        tpot_s=tpot,
        itl_s=itl,
        attempts=tuple(attempts),
        **common,
    )
