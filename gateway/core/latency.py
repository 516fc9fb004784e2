"""A request's TTFT and TPOT on one engine, from vLLM's step model, with costs learned online.

vLLM v1 runs each engine step over every running sequence's next token plus up to the rest of
its `max_num_batched_tokens` budget in prefill, first come first served; a step costs
`base_s + per_seq_s × sequences + per_prefill_token_s × prefill tokens` (the simulator's
`StepTiming` term for term). A prediction is a `StepWork` (how many steps, sequence-steps,
prefill tokens, per-request overheads) priced by `StepCosts`; because the price is linear in
the costs, every measurement — a request's TTFT or decode seen by the gateway, a delta of the
engine's histograms — is a linear observation of them, and `Calibrator` fits them per engine.
`LatencyModels` holds one calibrator per engine name. Pure: durations come in as numbers.
docs/latency.md has the equations, the calibration and what the model cannot know.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BatchSnapshot",
    "CalibrationPolicy",
    "Calibrator",
    "LatencyModels",
    "StepCosts",
    "StepWork",
    "decode_work",
    "predict_tpot",
    "predict_ttft",
    "prefill_after_credit",
    "tpot_work",
    "ttft_work",
]


@dataclass(frozen=True, slots=True)
class StepWork:
    """A stretch of engine steps in the terms the step model prices: `steps`, `seq_steps`
    (the sequences scheduled, summed over the steps), `prefill_tokens` (prompt tokens
    computed in them) and `requests` (per-request overheads paid: 1 for a TTFT seen by the
    gateway, 0 for decode). Floats: an observation from histograms is a mean."""

    steps: float
    seq_steps: float
    prefill_tokens: float
    requests: float = 0.0

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(
            self.steps + other.steps,
            self.seq_steps + other.seq_steps,
            self.prefill_tokens + other.prefill_tokens,
            self.requests + other.requests,
        )


@dataclass(frozen=True, slots=True)
class StepCosts:
    """One engine's step costs, in seconds: `base_s` per step, `per_seq_s` per sequence in a
    step, `per_prefill_token_s` per prompt token computed; `overhead_s` per request outside
    the steps (the API server, the network: in a TTFT, never in a TPOT). `chunk_tokens` is
    the engine's `max_num_batched_tokens`. Every cost MUST be finite and >= 0."""

    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    chunk_tokens: int
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_seq_s", "per_prefill_token_s", "overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {value}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, not {self.chunk_tokens}")

    def step_s(self, seqs: float, prefill_tokens: float) -> float:
        """One step of `seqs` sequences computing `prefill_tokens` prompt tokens."""
        return self.base_s + self.per_seq_s * seqs + self.per_prefill_token_s * prefill_tokens

    def seconds(self, work: StepWork) -> float:
        """How long `work` takes at these costs."""
        return (
            self.overhead_s * work.requests
            + self.base_s * work.steps
            + self.per_seq_s * work.seq_steps
            + self.per_prefill_token_s * work.prefill_tokens
        )


@dataclass(frozen=True, slots=True)
class BatchSnapshot:
    """An engine as a request would find it: `decoding` sequences past their first token;
    `prefills_ahead`, the prompt tokens each sequence the engine will prefill before this
    one still has to compute, in the engine's (first come, first served) order;
    `prefill_per_step`, the prompt tokens later requests are expected to add to each step
    while this one decodes (the engine's recent rate; 0 for none)."""

    decoding: int
    prefills_ahead: tuple[int, ...] = ()
    prefill_per_step: float = 0.0

    def __post_init__(self) -> None:
        if self.decoding < 0 or any(tokens < 0 for tokens in self.prefills_ahead):
            raise ValueError(f"negative sequences or tokens in {self}")
        if not (math.isfinite(self.prefill_per_step) and self.prefill_per_step >= 0):
            raise ValueError(f"prefill_per_step must be finite and >= 0 in {self}")


def prefill_after_credit(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """The prompt tokens the engine computes when `cached_blocks` leading blocks of the
    prompt are in its prefix cache: vLLM computes at least the last token, so at most
    `(prompt_tokens − 1) // block_size` blocks can hit. At least 1."""
    hit = max(0, min(cached_blocks, (prompt_tokens - 1) // block_size))
    return max(1, prompt_tokens - hit * block_size)


def request_prefill(
    prompts: Sequence[int], n: int, cached_blocks: int, block_size: int, caches: bool
) -> int:
    """The prefill a request costs an engine: its first prompt less the blocks expected
    cached there, its other prompts whole; each further sequence of `n` again, or only its
    last block where the engine caches prefixes (vLLM caches a prompt's blocks as it
    schedules them). 0 without prompts."""
    if not prompts:
        return 0
    first, *rest = prompts
    prefill = prefill_after_credit(first, cached_blocks, block_size) + sum(rest)
    again = min(prefill, block_size) if caches else prefill
    return prefill + again * (n - 1)


def ttft_work(batch: BatchSnapshot, prefill_tokens: int, chunk_tokens: int) -> StepWork | None:
    """The steps up to and including the one that computes the last of this request's
    `prefill_tokens` (its first token comes at that step's end), with its overhead; None
    when the decoders take the whole budget (no prefill runs while the batch stays).

    The prefills ahead and then this one are laid into steps in order: a step opened with
    `d` decoders takes `chunk_tokens − d` prompt tokens; a sequence that ends inside a step
    leaves the rest to the next one and decodes from the next step on. Whole steps of one
    sequence are counted at once, so this is O(sequences ahead), not O(steps)."""
    if prefill_tokens < 1:
        raise ValueError(f"a request computes at least one prompt token, not {prefill_tokens}")
    decoding = batch.decoding
    steps = seq_steps = 0
    room = 0  # prompt tokens the step opened last can still take
    joining = 0  # sequences whose prefill ended in that step: decoders from the next one
    for need in (*batch.prefills_ahead, prefill_tokens):
        if need == 0:
            continue
        if room > 0:  # the open step takes what it can
            take = min(need, room)
            need -= take
            room -= take
            seq_steps += 1
            if need == 0:
                joining += 1
                continue
        decoding += joining  # new steps: the sequences finished meanwhile decode in them
        budget = chunk_tokens - decoding
        if budget <= 0:
            return None
        span = -(-need // budget)  # ⌈need / budget⌉ steps, every one with this sequence
        steps += span
        seq_steps += span * (decoding + 1)
        room = span * budget - need
        joining = 1
    total = sum(batch.prefills_ahead) + prefill_tokens
    return StepWork(steps, seq_steps, total, requests=1)


def predict_ttft(costs: StepCosts, batch: BatchSnapshot, prefill_tokens: int) -> float:
    """Seconds from the request reaching the engine to its first token (`ttft_work` at
    `costs`, overhead included); infinite when no prefill can run."""
    work = ttft_work(batch, prefill_tokens, costs.chunk_tokens)
    return math.inf if work is None else costs.seconds(work)


def decode_work(
    steps: float, batch: float, prefill_tokens: float = 0.0, prefill_seqs: float = 0.0
) -> StepWork:
    """`steps` decode steps in a batch of `batch` sequences (a mean, for an observation),
    sharing them with `prefill_tokens` prompt tokens of `prefill_seqs` other sequences."""
    return StepWork(steps, steps * batch + prefill_seqs, prefill_tokens)


def tpot_work(batch: BatchSnapshot) -> StepWork:
    """One step of this request's decode: it runs with the decoders, the sequences ahead
    (decoding by then) and itself, and shares the step with `prefill_per_step` prompt
    tokens of one later sequence. Not capped at the step's budget: past it the engine falls
    behind on prefill, and TPOT then never falls as the batch grows."""
    seqs = batch.decoding + sum(1 for tokens in batch.prefills_ahead if tokens > 0) + 1
    rate = batch.prefill_per_step
    return decode_work(1, seqs, rate, 1.0 if rate > 0 else 0.0)


def predict_tpot(costs: StepCosts, batch: BatchSnapshot) -> float:
    """Seconds per output token once the request decodes (`tpot_work` at `costs`)."""
    return costs.seconds(tpot_work(batch))


# -- calibration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CalibrationPolicy:
    """How a `Calibrator` learns. `window`: each observation is forgotten by `1 − 1/window`
    per later one (a memory of about `window` observations). `min_observations`: until then
    the configured costs are used. `damping`: the pull towards the configured costs, as a
    fraction of each coefficient's own data. `outlier_ratio`: an observation more than this
    factor off the current prediction (either way) counts with weight `(outlier_ratio /
    ratio)²`. `refit_every`: the costs are solved again after this many new observations (a
    solve takes tens of microseconds; a fit a few observations old differs by little from
    one that remembers `window`)."""

    window: float = 500.0
    min_observations: int = 20
    damping: float = 1e-6
    outlier_ratio: float = 2.0
    refit_every: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window) and self.window >= 1):
            raise ValueError(f"window must be >= 1, not {self.window}")
        if self.min_observations < 1:
            raise ValueError(f"min_observations must be >= 1, not {self.min_observations}")
        if not (math.isfinite(self.damping) and self.damping > 0):
            raise ValueError(f"damping must be > 0, not {self.damping}")
        if not (math.isfinite(self.outlier_ratio) and self.outlier_ratio > 1):
            raise ValueError(f"outlier_ratio must be > 1, not {self.outlier_ratio}")
        if self.refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, not {self.refit_every}")


_N = 4  # coefficients: overhead_s, base_s, per_seq_s, per_prefill_token_s
_UPPER = tuple((i, j) for i in range(_N) for j in range(i, _N))  # the order `observe` keeps
_UNSEEN = 1e-300  # a coefficient's own data below this: never observed (or long forgotten)


def _coefficients(costs: StepCosts) -> list[float]:
    return [costs.overhead_s, costs.base_s, costs.per_seq_s, costs.per_prefill_token_s]


class Calibrator:
    """One engine's step costs, fitted online from `(StepWork, seconds)` observations.

    Weighted least squares over exponentially forgotten sufficient statistics (a 4×4 matrix
    and a 4-vector: fixed memory), each observation taken per step; solved on demand,
    damped towards the configured costs in each coefficient's own scale, coefficients kept
    >= 0. Contract: `costs` is the configured costs until `min_observations` observations
    were accepted, then the fit, solved again every `refit_every` observations. An
    observation with a NaN, an infinity, a negative or zero duration, a negative feature, no
    steps, more prefill than `chunk_tokens` a step, a weight not > 0, or numbers so large
    that the statistics would overflow is refused (`observe` returns False, `rejected` counts
    it) and changes nothing."""

    __slots__ = (
        "_a",
        "_b",
        "_fitted",
        "_stale",
        "configured",
        "observations",
        "policy",
        "rejected",
    )

    def __init__(self, configured: StepCosts, policy: CalibrationPolicy | None = None) -> None:
        self.configured = configured
        self.policy = policy or CalibrationPolicy()
        self.observations = 0
        self.rejected = 0
        self._a = [0.0] * len(_UPPER)  # Σ w·x·xᵀ, its upper triangle (symmetric)
        self._b = [0.0] * _N  # Σ w·x·t
        self._fitted: StepCosts | None = None  # none solved yet
        self._stale = 0  # observations since it was

    @property
    def calibrated(self) -> bool:
        """Enough observations were accepted for the fit to replace the configured costs."""
        return self.observations >= self.policy.min_observations

    @property
    def costs(self) -> StepCosts:
        """The costs to predict with now."""
        if not self.calibrated:
            return self.configured
        if self._fitted is None or self._stale >= self.policy.refit_every:
            self._fitted = self._fit()
            self._stale = 0
        return self._fitted

    def observe(self, work: StepWork, seconds: float, weight: float = 1.0) -> bool:
        """Learn that `work` took `seconds`; False (and counted) when it is refused."""
        steps, requests = work.steps, work.requests
        seq_steps, prefill = work.seq_steps, work.prefill_tokens
        # Comparisons are False for NaN; a sum of finite numbers is finite (or overflows).
        if not (
            steps > 0
            and seconds > 0
            and weight > 0
            and requests >= 0
            and seq_steps >= 0
            and prefill >= 0
            and math.isfinite(steps + requests + seq_steps + prefill + seconds + weight)
            and prefill <= steps * self.configured.chunk_tokens  # no step computes more
        ):
            self.rejected += 1
            return False
        # Per step, so that a long stretch counts as one observation; the base's feature is 1.
        x0, x2, x3 = requests / steps, seq_steps / steps, prefill / steps
        t = seconds / steps
        if not math.isfinite(x0 * x0 + x2 * x2 + x3 * x3 + t * t):  # would overflow the sums
            self.rejected += 1
            return False
        w = weight
        if self.calibrated:
            c = self.costs
            predicted = c.overhead_s * x0 + c.base_s + c.per_seq_s * x2 + c.per_prefill_token_s * x3
            w *= _outlier_weight(predicted, t, self.policy.outlier_ratio)
        k = 1.0 - 1.0 / self.policy.window
        a, b = self._a, self._b
        w0, w2, w3 = w * x0, w * x2, w * x3
        a = [
            k * a[0] + w0 * x0,
            k * a[1] + w0,
            k * a[2] + w0 * x2,
            k * a[3] + w0 * x3,
            k * a[4] + w,
            k * a[5] + w2,
            k * a[6] + w3,
            k * a[7] + w2 * x2,
            k * a[8] + w2 * x3,
            k * a[9] + w3 * x3,
        ]
        b = [k * b[0] + w0 * t, k * b[1] + w * t, k * b[2] + w2 * t, k * b[3] + w3 * t]
        if not math.isfinite(sum(a) + sum(b)):  # a huge weight overflowed them
            self.rejected += 1
            return False
        self._a, self._b = a, b
        self.observations += 1
        self._stale += 1
        return True

    def _fit(self) -> StepCosts:
        """The damped least-squares costs, each >= 0; a coefficient never observed (its
        feature always 0, or long forgotten) keeps its configured value."""
        prior = _coefficients(self.configured)
        a = _square(self._a)
        m, v = _damped(a, self._b, prior, self.policy.damping)
        seen = [i for i in range(_N) if a[i * _N + i] > _UNSEEN]
        best = _solve(m, v, seen, prior)
        if any(best[i] < 0 for i in seen):
            # The least-squares optimum under >= 0 is the unconstrained optimum of one face:
            # try every subset of the seen coefficients left free (the rest at 0).
            best, lowest = prior, math.inf
            for mask in range(1 << len(seen)):
                free = [c for k, c in enumerate(seen) if mask >> k & 1]
                trial = _solve(m, v, free, [0.0 if i in seen else prior[i] for i in range(_N)])
                if any(trial[i] < 0 for i in free):
                    continue
                value = _objective(m, v, trial)
                if value < lowest:
                    best, lowest = trial, value
        overhead, base, per_seq, per_token = best
        return StepCosts(base, per_seq, per_token, self.configured.chunk_tokens, overhead)


def _outlier_weight(predicted: float, observed: float, limit: float) -> float:
    """1 within `limit` times the prediction either way, `(limit / ratio)²` beyond."""
    if predicted <= 0:
        return 1.0
    ratio = max(observed / predicted, predicted / observed)
    return 1.0 if ratio <= limit else (limit / ratio) ** 2


def _square(upper: list[float]) -> list[float]:
    """The full row-major matrix of an upper triangle kept as `_UPPER` lists it."""
    full = [0.0] * (_N * _N)
    for value, (i, j) in zip(upper, _UPPER, strict=True):
        full[i * _N + j] = full[j * _N + i] = value
    return full


def _damped(
    a: list[float], b: list[float], prior: list[float], rho: float
) -> tuple[list[float], list[float]]:
    """The normal equations `a θ = b` with `rho × diag(a)` towards `prior` (Levenberg–
    Marquardt's scaling: the same pull whatever each feature's unit)."""
    m, v = [*a], [*b]
    for i in range(_N):
        diagonal = a[i * _N + i]
        m[i * _N + i] += rho * diagonal
        v[i] += rho * diagonal * prior[i]
    return m, v


def _objective(m: list[float], v: list[float], theta: list[float]) -> float:
    """`θᵀ m θ − 2 vᵀ θ`: the damped squared error, less a constant."""
    quadratic = sum(theta[i] * m[i * _N + j] * theta[j] for i in range(_N) for j in range(_N))
    return quadratic - 2 * sum(v[i] * theta[i] for i in range(_N))


def _solve(m: list[float], v: list[float], free: list[int], theta: list[float]) -> list[float]:
    """`m θ = v` for the coefficients in `free`, the others held at `theta`."""
    theta = [*theta]
    if not free:
        return theta
    held = [j for j in range(_N) if j not in free]
    # Jacobi scaling: unit diagonal, so elimination works on numbers of one size.
    scale = [math.sqrt(m[i * _N + i]) for i in free]
    rows = [
        [m[i * _N + j] / (scale[r] * scale[c]) for c, j in enumerate(free)]
        + [(v[i] - sum(m[i * _N + k] * theta[k] for k in held)) / scale[r]]
        for r, i in enumerate(free)
    ]
    for r, y in enumerate(_gauss(rows)):
        theta[free[r]] = y / scale[r]
    return theta


def _gauss(rows: list[list[float]]) -> list[float]:
    """Solve the augmented system `rows` (n × n+1) by elimination with partial pivoting.
    The damped, scaled matrix is positive definite (eigenvalues >= damping / (1 + damping))."""
    n = len(rows)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / head[col]
            if factor:
                rows[r] = [a - factor * h for a, h in zip(rows[r], head, strict=True)]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        tail = sum(rows[r][c] * out[c] for c in range(r + 1, n))
        out[r] = (rows[r][n] - tail) / rows[r][r]
    return out


class LatencyModels:
    """One `Calibrator` per engine name, created on first use from the engine's configured
    costs (`per_engine`, else `default`); an engine that left the set is forgotten
    (`retain`, `forget`), and one that comes back starts from its configured costs again."""

    def __init__(
        self,
        default: StepCosts,
        *,
        per_engine: Mapping[str, StepCosts] | None = None,
        policy: CalibrationPolicy | None = None,
    ) -> None:
        self.default = default
        self.per_engine = dict(per_engine or {})
        self.policy = policy or CalibrationPolicy()
        self._engines: dict[str, Calibrator] = {}

    def calibrator(self, engine: str) -> Calibrator:
        """The engine's calibrator, created from its configured costs if it has none."""
        found = self._engines.get(engine)
        if found is None:
            configured = self.per_engine.get(engine, self.default)
            found = self._engines[engine] = Calibrator(configured, self.policy)
        return found

    def costs(self, engine: str) -> StepCosts:
        """The costs to predict with on `engine` now."""
        return self.calibrator(engine).costs

    def observe(self, engine: str, work: StepWork, seconds: float, weight: float = 1.0) -> bool:
        """`Calibrator.observe` on the engine's calibrator."""
        return self.calibrator(engine).observe(work, seconds, weight)

    def retain(self, engines: Iterable[str]) -> None:
        """Forget every engine not in `engines` (the pool's set after a change)."""
        keep = set(engines)
        for name in [name for name in self._engines if name not in keep]:
            del self._engines[name]

    def forget(self, engine: str) -> None:
        """Forget one engine (gone, or restarted as another identity); no error if unknown."""
        self._engines.pop(engine, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine: object) -> bool:
        return engine in self._engines
