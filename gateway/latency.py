"""The latency model fed from what the gateway and the engines show (issue 40).

`LatencyBook` keeps, per engine, what the pure model (`gateway/core/latency.py`) needs at
admission and the observations that calibrate it:

- **the batch a request would find** (`snapshot`): the requests this process sent there
  that have no first token yet, each with its prefill after prefix credit, in sending order;
  its requests past their first token; and what the engine's last scrape showed beyond them
  (other clients, other replicas or workers, the gateway's requests this book does not
  follow): running sequences as decoders, waiting requests at `foreign_prompt_tokens` each;
- **the prefill rate** later requests add to each step: the engine's own, from the deltas
  of its histograms between two scrapes, else what this process sent over `rate_window_s`;
- **the tightest TPOT target** of the requests in flight there (`tightest_tpot`);
- **how far off its TTFT predictions run** (`ttft_factor`): the 95th percentile of observed
  over predicted TTFT of its last 256 streamed requests, so that the deadline gate holds a
  bound, not the mean the calibration fits;
- **when its requests end** (`releases`): each followed request whose output budget is known,
  at its first token (or predicted first token) plus its budget's steps at the TPOT a
  request sent now would get, stretched by the 95th percentile of how far such forecasts
  ran short there (`decode_factor`) — an upper bound where answers stop before `max_tokens`;
- **observations**: a TTFT (the `ttft_work` at sending, against the time from sending to
  the first streamed chunk), a decode (the steps after the first token, against the time to
  the end; a whole non-streamed answer as the sum of both), and one mean engine step per
  scrape interval. With `calibrate=False` none is made: the configured costs only.

Every figure is per engine name and bounded: the requests followed on an engine are at most
`max_num_seqs + staged_seqs + line` (a lease holds at least one sequence, so admission keeps
them at `max_num_seqs + staged_seqs`; past the bound a request is not followed and is
counted in `unfollowed`), the engine's waiting requests enter a snapshot as at most
`max_num_seqs` entries (the rest merged into one), the TPOT targets are counted by value,
and the rest of an engine's state is a fixed set of numbers. docs/latency.md ("Feeding
it") says where the exchange and the monitor call it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.core.latency import (
    BatchSnapshot,
    LatencyModels,
    StepCosts,
    StepWork,
    decode_work,
    predict_tpot,
    ttft_work,
)
from gateway.engines.metrics import MetricsPage, StepCounters
from gateway.engines.pool import EnginePool

__all__ = ["LatencyBook", "Sent"]

_PENDING, _DECODING, _DONE = 0, 1, 2

ERRORS = 256  # TTFT errors kept per engine
ERRORS_NEEDED = 20  # before which predictions are taken as they are
ERROR_QUANTILE = 0.95


class Sent:
    """One request sent to an engine, as `LatencyBook.sent` follows it (`lane` None: not
    followed — an engine not in the pool, or past the bound)."""

    __slots__ = (
        "at",
        "batch",
        "due",
        "engine",
        "first_at",
        "lane",
        "max_tokens",
        "predicted",
        "predicted_decode",
        "prefill",
        "sent_seqs",
        "sent_tokens",
        "seqs",
        "state",
        "streamed",
        "tpot_s",
        "work",
    )

    def __init__(
        self,
        engine: str,
        prefill: int,
        tpot_s: float | None,
        streamed: bool,
        seqs: int,
        at: float,
        max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_tokens = max_tokens  # each sequence's output budget (None: not known)
        self.prefill = prefill
        self.tpot_s = tpot_s
        self.streamed = streamed
        self.seqs = seqs
        self.at = at
        self.lane: _Lane | None = None
        self.state = _PENDING
        self.work: StepWork | None = None  # its TTFT's work at sending (None: not predicted)
        self.predicted = 0.0  # its TTFT predicted at sending, in seconds (with `work`)
        self.predicted_decode = 0.0  # at its first token: its whole budget's decode, seconds
        self.due = math.inf  # not streamed: when its first token is expected
        self.first_at = 0.0
        # At the start of its decode (streamed: its first token; not streamed: sending): the
        # batch it decodes in, and the engine's prefill sent so far, for the decode observation.
        self.batch = 0.0
        self.sent_tokens = 0
        self.sent_seqs = 0


@dataclass(slots=True)
class _Lane:
    """One engine's figures."""

    limit: int  # requests followed at most
    pending: dict[Sent, None]  # no first token yet, in sending order
    running: dict[Sent, None] = field(default_factory=dict)  # past their first token
    # Observed over predicted TTFT of the last `ERRORS` streamed requests, and its high
    # quantile once worked out (None: to work out again).
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=ERRORS))
    factor: float | None = None
    # The same for the decode of requests that ran their whole output budget.
    decode_errors: deque[float] = field(default_factory=lambda: deque(maxlen=ERRORS))
    decode_factor: float | None = None
    pending_seqs: int = 0  # their sequences
    unstreamed: int = 0  # of them, not streamed (their first token is not seen)
    decoding: int = 0  # sequences of the followed requests past their first token
    followed: int = 0  # requests followed (pending and decoding)
    tpots: dict[float, int] = field(default_factory=dict)  # their TPOT targets, counted
    sent_tokens: int = 0  # prefill tokens sent there, ever (deltas are read)
    sent_seqs: int = 0
    rate: float = 0.0  # prefill tokens sent, exponentially forgotten over rate_window_s
    rate_at: float = 0.0
    # From the last scrape: running and waiting sequences beyond this book's requests.
    scraped: bool = False
    foreign_running: int = 0
    foreign_waiting: int = 0
    # The histograms' counters at the last scrape, and the process start time then.
    counters: StepCounters | None = None
    started: float | None = None
    # Prefill tokens per step over the last scrape interval, and when it was read.
    step_prefill: float | None = None
    step_prefill_at: float = -math.inf


class LatencyBook:
    """Per engine: the calibrated step costs (core LatencyModels), the requests this process
    sent there that have no first token yet (their prefill after credit, in sending order),
    the in-flight requests' tightest TPOT target, and the recent prefill rate per step.

    Contract: `sent` returns a handle; exactly one of `finished` or `dropped` ends it (both
    idempotent, and either after the other is a no-op), `first_token` before `finished`.
    A handle of an engine forgotten meanwhile (restarted, `forget`, `retain`) changes only
    figures no longer read, and gives no observation."""

    def __init__(
        self,
        models: LatencyModels,
        pool: EnginePool,
        *,
        calibrate: bool = True,
        clock: Callable[[], float] = time.monotonic,
        foreign_prompt_tokens: int = 512,
        rate_window_s: float = 10.0,
        line: int = 0,
    ) -> None:
        if foreign_prompt_tokens < 1:
            raise ValueError(f"foreign_prompt_tokens must be >= 1, not {foreign_prompt_tokens}")
        if not (math.isfinite(rate_window_s) and rate_window_s > 0):
            raise ValueError(f"rate_window_s must be > 0, not {rate_window_s}")
        self.models = models
        self.pool = pool
        self.calibrate = calibrate
        self.clock = clock
        self.foreign_prompt_tokens = foreign_prompt_tokens
        self.rate_window_s = rate_window_s
        self.line = max(0, line)
        self.unfollowed = 0
        """Requests not followed: sent to an engine not in the pool, or past the bound."""
        self.skipped_intervals = 0
        """Scrape intervals not observed: across a restart, or a counter that went down."""
        self._lanes: dict[str, _Lane] = {}

    # -- what the gate reads ------------------------------------------------------------------

    def costs(self, engine: str) -> StepCosts:
        """The step costs to predict with on `engine` now (configured until calibrated)."""
        return self.models.costs(engine)

    def ttft_factor(self, engine: str) -> float:
        """What to multiply a TTFT predicted on `engine` by so that it holds for about
        `ERROR_QUANTILE` of requests: that quantile of observed over predicted TTFT of
        the last `ERRORS` streamed requests sent there, at least 1 (1 until
        `ERRORS_NEEDED` were seen, or without calibration). The model fits the mean; a
        deadline needs a bound."""
        lane = self._lanes.get(engine)
        if lane is None:
            return 1.0
        if lane.factor is None:
            lane.factor = _bound(lane.errors)
        return lane.factor

    def decode_factor(self, engine: str) -> float:
        """`ttft_factor` for the decode of a whole output budget: observed over predicted
        time from first token to end of the last `ERRORS` streamed requests that ran their
        budget there (`releases` stretches its forecast by it)."""
        lane = self._lanes.get(engine)
        if lane is None:
            return 1.0
        if lane.decode_factor is None:
            lane.decode_factor = _bound(lane.decode_errors)
        return lane.decode_factor

    def tightest_tpot(self, engine: str) -> float | None:
        """The smallest TPOT target of this process's requests in flight on `engine`."""
        lane = self._lanes.get(engine)
        return min(lane.tpots) if lane is not None and lane.tpots else None

    def snapshot(self, engine: str) -> BatchSnapshot:
        """`engine` as a request sent there now would find it (see the module docstring)."""
        now = self.clock()
        lane = self._lane(engine)
        if lane is None:
            return BatchSnapshot(0)
        ahead, pending, started = _mine(lane, now)
        running, waiting = self._foreign(engine, lane, pending, started)
        decoding = lane.decoding + started + running
        if waiting:
            ahead += self._foreign_prefills(engine, waiting)
        rate = self._prefill_per_step(engine, lane, decoding, now)
        return BatchSnapshot(decoding, tuple(ahead), rate)

    def releases(self, engine: str) -> list[float]:
        """Seconds from now until each request this process follows on `engine` is
        predicted to end, for those whose output budget is known (in no order): its first
        token (seen, or predicted at sending) and then `max_tokens - 1` steps at the TPOT a
        request sent now would get; 0 for one already past it. At most the requests
        followed there (`max_num_seqs + staged_seqs + line`)."""
        lane = self._lanes.get(engine)
        if lane is None or not (lane.running or lane.pending):
            return []
        now = self.clock()
        costs = self.models.costs(engine)
        tpot = predict_tpot(costs, self.snapshot(engine)) * self.decode_factor(engine)
        ends = []
        for sent in lane.running:
            if sent.max_tokens is not None:
                ends.append(sent.first_at + (sent.max_tokens - 1) * tpot - now)
        for sent in lane.pending:
            if sent.max_tokens is not None:
                first = sent.at + (costs.seconds(sent.work) if sent.work is not None else 0.0)
                ends.append(max(first, now) + (sent.max_tokens - 1) * tpot - now)
        return [max(0.0, end) for end in ends]

    # -- the exchange's hooks -----------------------------------------------------------------

    def sent(
        self,
        engine: str,
        prefill_tokens: int,
        tpot_s: float | None,
        *,
        streamed: bool = True,
        seqs: int = 1,
        max_tokens: int | None = None,
    ) -> Sent:
        """A request goes to `engine` now: `prefill_tokens` to compute there (after prefix
        credit; all its prompts and sequences), its TPOT target, whether its answer is
        streamed (else its first token is not seen: it counts as decoding from its predicted
        first token on), its sequences, each sequence's output budget (`max_tokens`, for
        `releases`; None: not known). Returns the handle the other hooks take."""
        now = self.clock()
        prefill = max(1, prefill_tokens)
        budget = None if max_tokens is None else max(1, max_tokens)
        sent = Sent(engine, prefill, tpot_s, streamed, max(1, seqs), now, budget)
        lane = self._lane(engine)
        if lane is None or lane.followed >= lane.limit:
            self.unfollowed += 1
            return sent
        if self.calibrate or not streamed or budget is not None:
            batch = self.snapshot(engine)
            costs = self.models.costs(engine)
            sent.work = ttft_work(batch, prefill, costs.chunk_tokens)
            if sent.work is not None:
                sent.predicted = costs.seconds(sent.work)
            if not streamed:
                if sent.work is not None:
                    sent.due = now + costs.seconds(sent.work)
                ahead = sum(1 for tokens in batch.prefills_ahead if tokens > 0)
                sent.batch = batch.decoding + ahead + sent.seqs
        sent.lane = lane
        lane.pending[sent] = None
        lane.pending_seqs += sent.seqs
        lane.unstreamed += not streamed
        lane.followed += 1
        lane.sent_tokens += prefill
        lane.sent_seqs += sent.seqs
        sent.sent_tokens, sent.sent_seqs = lane.sent_tokens, lane.sent_seqs
        lane.rate = lane.rate * math.exp((lane.rate_at - now) / self.rate_window_s) + prefill
        lane.rate_at = now
        if tpot_s is not None:
            lane.tpots[tpot_s] = lane.tpots.get(tpot_s, 0) + 1
        return sent

    def first_token(self, sent: Sent) -> None:
        """Its first token arrived (streamed: the first chunk; not streamed: the answer).
        A TTFT observation for a streamed request of one sequence."""
        lane = sent.lane
        if lane is None or sent.state != _PENDING:
            return
        now = self.clock()
        del lane.pending[sent]
        lane.pending_seqs -= sent.seqs
        lane.unstreamed -= not sent.streamed
        lane.decoding += sent.seqs
        lane.running[sent] = None
        sent.state, sent.first_at = _DECODING, now
        if not (self.calibrate and sent.streamed and self._current(sent)):
            return
        if sent.max_tokens is not None and sent.max_tokens > 1 and sent.seqs == 1:
            tpot = predict_tpot(self.models.costs(sent.engine), self.snapshot(sent.engine))
            sent.predicted_decode = (sent.max_tokens - 1) * tpot
        if sent.work is not None and sent.seqs == 1:
            self.models.observe(sent.engine, sent.work, now - sent.at)
            if sent.predicted > 0:
                lane.errors.append((now - sent.at) / sent.predicted)
                lane.factor = None
        sent.batch = self._batch(sent.engine, lane, now)
        sent.sent_tokens, sent.sent_seqs = lane.sent_tokens, lane.sent_seqs

    def finished(self, sent: Sent, output_tokens: int) -> None:
        """Its answer ended, whole, with `output_tokens` (all sequences): the decode
        observation (streamed), or the whole answer's (not streamed; call `first_token`
        first). A request that never had its first token is ended as `dropped`."""
        lane = sent.lane
        if lane is not None and sent.state == _DECODING and self.calibrate and self._current(sent):
            self._observe_decode(sent, lane, output_tokens // sent.seqs)
            if sent.predicted_decode > 0 and output_tokens == sent.max_tokens:
                lane.decode_errors.append((self.clock() - sent.first_at) / sent.predicted_decode)
                lane.decode_factor = None
        self.dropped(sent)

    def dropped(self, sent: Sent) -> None:
        """It failed or was cancelled (before or after its first token); nothing is
        observed. Idempotent, and a no-op after `finished`."""
        lane = sent.lane
        if lane is None or sent.state == _DONE:
            return
        if sent.state == _PENDING:
            del lane.pending[sent]
            lane.pending_seqs -= sent.seqs
            lane.unstreamed -= not sent.streamed
        else:
            lane.decoding -= sent.seqs
            lane.running.pop(sent, None)
        sent.state = _DONE
        lane.followed -= 1
        tpot = sent.tpot_s
        if tpot is not None:
            left = lane.tpots[tpot] - 1
            if left:
                lane.tpots[tpot] = left
            else:
                del lane.tpots[tpot]

    # -- the monitor's hook -------------------------------------------------------------------

    def scraped(self, engine: str, page: MetricsPage) -> None:
        """`engine`'s `/metrics` page was read: the load beyond this book's requests, the
        prefill per step and one mean-step observation over the interval since the last
        page (not across a restart — the engine is then forgotten — nor a counter that
        went down)."""
        lane = self._lane(engine)
        if lane is None:
            return
        if lane.started is not None and page.started is not None and page.started != lane.started:
            self.forget(engine)  # restarted: another identity, maybe other flags
            self.skipped_intervals += 1
            lane = self._lane(engine)
            assert lane is not None
        if page.started is not None:
            lane.started = page.started
        now = self.clock()
        running = _total(m.num_requests_running for m in page.models.values())
        waiting = _total(m.num_requests_waiting for m in page.models.values())
        pending, started = _seqs(lane, now)
        lane.scraped = True
        lane.foreign_running, lane.foreign_waiting = _beyond(
            pending, lane.decoding + started, running, waiting
        )
        counters = StepCounters.total(m.steps for m in page.models.values())
        before, lane.counters = lane.counters, counters
        if before is None or counters is None:
            return
        delta = counters.since(before)
        if delta is None:
            self.skipped_intervals += 1
            return
        if delta.steps == 0:
            lane.step_prefill, lane.step_prefill_at = 0.0, now  # idle
            return
        sampled = delta.generated / delta.steps
        # Steps that sampled no token (a long prompt's chunks with no decoder beside them)
        # are not counted in `steps`, but their prefill is: at most what a step leaves
        # beside the tokens it samples is taken as prefill per step.
        room = max(0.0, self.models.costs(engine).chunk_tokens - sampled)
        prefill = min(delta.prefill_tokens / delta.steps, room)
        lane.step_prefill, lane.step_prefill_at = prefill, now
        if self.calibrate and delta.decode_tokens > 0:
            self.models.observe(engine, StepWork(1, sampled, prefill), delta.step_seconds)

    # -- the engines' set ---------------------------------------------------------------------

    def retain(self, engines: Iterable[str]) -> None:
        """Forget every engine not in `engines` (the pool's set after a change)."""
        keep = set(engines)
        for name in [name for name in self._lanes if name not in keep]:
            del self._lanes[name]
        self.models.retain(keep)

    def forget(self, engine: str) -> None:
        """Forget `engine`: its costs start again from the configured ones, its requests in
        flight are no longer followed."""
        self._lanes.pop(engine, None)
        self.models.forget(engine)

    # -- internals ----------------------------------------------------------------------------

    def _lane(self, engine: str) -> _Lane | None:
        """The engine's lane, new if it has none (None: not in the pool)."""
        lane = self._lanes.get(engine)
        if lane is not None:
            return lane
        state = self.pool.get(engine)
        if state is None:
            return None
        limit = state.spec.max_num_seqs + self.pool.staged_seqs + self.line
        lane = self._lanes[engine] = _Lane(limit=max(1, limit), pending={})
        return lane

    def _current(self, sent: Sent) -> bool:
        return self._lanes.get(sent.engine) is sent.lane

    def _foreign(self, engine: str, lane: _Lane, pending: int, started: int) -> tuple[int, int]:
        """Running and waiting sequences beyond this book's requests: as this book worked
        them out at the last scrape it was given, else (a worker that reads another's
        scrapes) from the pool's figures against the book's `pending` and decoding
        sequences now."""
        if lane.scraped:
            return lane.foreign_running, lane.foreign_waiting
        state = self.pool.get(engine)
        if state is None:
            return 0, 0
        return _beyond(pending, lane.decoding + started, state.running, state.waiting)

    def _foreign_prefills(self, engine: str, waiting: int) -> list[int]:
        """The foreign waiting requests as prefills of `foreign_prompt_tokens` each, at most
        `max_num_seqs` entries (the rest merged into the last)."""
        state = self.pool.get(engine)
        cap = max(1, state.spec.max_num_seqs if state is not None else 1)
        tokens = self.foreign_prompt_tokens
        if waiting <= cap:
            return [tokens] * waiting
        return [tokens] * (cap - 1) + [tokens * (waiting - cap + 1)]

    def _prefill_per_step(self, engine: str, lane: _Lane, decoding: int, now: float) -> float:
        """The engine's prefill tokens per step over its last scrape interval, if that is
        recent; else what this process sent over `rate_window_s`, per step at the current
        costs (`q = r × step(n, q)`, at most the step's budget)."""
        if lane.step_prefill is not None and now - lane.step_prefill_at <= self.rate_window_s:
            return lane.step_prefill
        rate = lane.rate * math.exp((lane.rate_at - now) / self.rate_window_s)
        per_s = rate / self.rate_window_s
        if per_s <= 0:
            return 0.0
        costs = self.models.costs(engine)
        room = max(0.0, float(costs.chunk_tokens - decoding))
        below = 1.0 - costs.per_prefill_token_s * per_s
        if below <= 0:
            return room
        step = (costs.base_s + costs.per_seq_s * (decoding + 1)) / below
        return min(room, per_s * step)

    def _batch(self, engine: str, lane: _Lane, now: float) -> float:
        """The sequences decoding on `engine` now, this book's and beyond."""
        pending, started = _seqs(lane, now)
        return lane.decoding + started + self._foreign(engine, lane, pending, started)[0]

    def _observe_decode(self, sent: Sent, lane: _Lane, output_tokens: int) -> None:
        """The decode observation at the end of a whole answer of one sequence."""
        if sent.seqs != 1 or output_tokens < 1:
            return
        now = self.clock()
        steps = output_tokens - 1
        batch = (sent.batch + self._batch(sent.engine, lane, now)) / 2
        chunk = self.models.costs(sent.engine).chunk_tokens
        # The prefill sent meanwhile, as far as it fits beside the decoders (the rest ran
        # after this request's end).
        prefill = min(lane.sent_tokens - sent.sent_tokens, steps * max(0.0, chunk - batch))
        others = lane.sent_seqs - sent.sent_seqs if prefill > 0 else 0
        if sent.streamed:
            if steps > 0:
                work = decode_work(steps, batch, prefill, others)
                self.models.observe(sent.engine, work, now - sent.first_at)
        elif sent.work is not None:
            work = sent.work + decode_work(steps, batch, prefill, others)
            self.models.observe(sent.engine, work, now - sent.at)


def _mine(lane: _Lane, now: float) -> tuple[list[int], int, int]:
    """The book's requests on a lane with no first token: their prefills in sending order
    and their sequences; and the sequences of those not streamed that are past their
    predicted first token (counted as decoding)."""
    if not lane.unstreamed:
        return [s.prefill for s in lane.pending], lane.pending_seqs, 0
    ahead, seqs, started = [], 0, 0
    for sent in lane.pending:
        if sent.due <= now:
            started += sent.seqs
        else:
            ahead.append(sent.prefill)
            seqs += sent.seqs
    return ahead, seqs, started


def _seqs(lane: _Lane, now: float) -> tuple[int, int]:
    """`_mine`'s sequences alone (O(1) while every request followed is streamed)."""
    if not lane.unstreamed:
        return lane.pending_seqs, 0
    _, seqs, started = _mine(lane, now)
    return seqs, started


def _beyond(
    pending: int, decoding: int, running: int | None, waiting: int | None
) -> tuple[int, int]:
    """An engine's `running` and `waiting` sequences less this book's: its `pending`
    sequences (no first token) taken to be waiting first, the rest of them prefilling (so
    running), its `decoding` ones running. 0 for a figure the engine did not report."""
    mine_waiting = min(pending, waiting or 0)
    foreign_waiting = max(0, (waiting or 0) - pending)
    foreign_running = max(0, (running or 0) - decoding - (pending - mine_waiting))
    return foreign_running, foreign_waiting


def _total(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any value is missing (or there is none)."""
    got = list(values)
    if not got or any(v is None for v in got):
        return None
    return sum(v for v in got if v is not None)


def _bound(errors: deque[float]) -> float:
    """`ERROR_QUANTILE` of observed over predicted, at least 1; 1 with too few."""
    if len(errors) < ERRORS_NEEDED:
        return 1.0
    ranked = sorted(errors)
    return max(1.0, ranked[min(len(ranked) - 1, int(ERROR_QUANTILE * len(ranked)))])
