"""The capacity plan: inputs → memory split, KV blocks, concurrency, start-up verdict,
recommended limits and the inverse questions. Pure: the CLI reads files and prints.

Memory follows vLLM (`../shared/VLLM.md` §1): the budget is `total × gpu_memory_utilization`
for weights, activation peak, non-torch memory, CUDA graphs *and* the KV cache; what is left
after the first four is the KV cache. `--kv-cache-memory-bytes` replaces that computation, as
in vLLM. KV arithmetic is `gateway.core.kvmath`, exactly vLLM's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.core import kvmath
from gateway.planner.overhead import GIB, Overhead, estimate_overhead
from gateway.planner.presets import ModelSpec
from gateway.planner.workload import Workload

# vLLM's defaults for the OpenAI server (VLLM.md §3): GPUs ≥ 70 GiB other than A100 get the
# large ones.
DEFAULT_SEQS = {True: 1024, False: 256}
DEFAULT_BATCHED_TOKENS = {True: 8192, False: 2048}
HIGH_UTILIZATION = 0.95
DEFAULT_KV_CEILING = 0.95


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything a plan depends on. Memory figures are bytes per GPU."""

    model: ModelSpec
    gpu_memory_bytes: int
    gpu_name: str | None = None
    large_gpu: bool = False
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    non_torch_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    workload: Workload | None = None
    target_concurrency: int | None = None
    target_len: int | None = None
    decode_tokens_per_s: float = 30.0

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for inputs vLLM itself would reject."""
        if self.gpu_memory_bytes <= 0:
            raise ValueError("GPU memory must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        for name, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--block-size", self.block_size),
            ("--max-model-len", self.max_model_len),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--target-concurrency", self.target_concurrency),
            ("--target-len", self.target_len),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        for name, amount in (
            ("--kv-cache-memory-bytes", self.kv_cache_memory_bytes),
            ("--weights-gib", self.weights_bytes),
            ("--activation-gib", self.activation_bytes),
            ("--non-torch-gib", self.non_torch_bytes),
            ("--cudagraph-gib", self.cuda_graph_bytes),
        ):
            if amount is not None and amount < 0:
                raise ValueError(f"{name} must not be negative")
        if self.decode_tokens_per_s <= 0:
            raise ValueError("--decode-tps must be positive")
        kvmath.dtype_bytes(self.dtype or self.model.dtype)
        kvmath.kv_cache_dtype_bytes(self.kv_cache_dtype, self.dtype or self.model.dtype)


@dataclass(frozen=True, slots=True)
class Problem:
    """Why vLLM would refuse to start (or crash while starting), and the fix."""

    kind: str
    message: str
    fix: str


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Limits for vLLM and the gateway, with the reasoning behind each."""

    request_len: int
    request_len_p95: int
    max_num_seqs: int
    kv_ceiling: float
    queue_max_length: int
    queue_max_wait_s: float
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Inverse:
    """Answers for N concurrent requests of L tokens."""

    concurrency: int
    length: int
    blocks_needed: int
    kv_bytes_needed: int
    min_gpu_memory_utilization: float | None
    max_model_len_for_target: int


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    weights: int
    overhead: Overhead
    budget: int
    kv_bytes: int
    kv_source: str
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    kv_tokens: int
    concurrency_at_max_len: float
    concurrency_at_mean: float | None
    problems: tuple[Problem, ...]
    warnings: tuple[str, ...]
    recommendation: Recommendation | None
    inverse: Inverse | None
    weight_bytes_per_param: float
    notes: tuple[str, ...] = field(default=())

    @property
    def starts(self) -> bool:
        return not self.problems


def make_plan(inputs: PlanInputs) -> Plan:
    """Compute the plan. `inputs.validate()` must pass (make_plan calls it)."""
    inputs.validate()
    model, tp = inputs.model, inputs.tensor_parallel_size
    dtype = inputs.dtype or model.dtype
    max_len = inputs.max_model_len or model.max_position_embeddings
    seqs = inputs.max_num_seqs or DEFAULT_SEQS[inputs.large_gpu]
    batched = inputs.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS[inputs.large_gpu]
    bs = inputs.block_size

    kv_elem = kvmath.kv_cache_dtype_bytes(inputs.kv_cache_dtype, dtype)
    bpt = kvmath.bytes_per_token(model.geometry, kv_elem, tp)
    weight_elem = model.weight_bytes_per_param or kvmath.dtype_bytes(dtype)
    weights = inputs.weights_bytes
    if weights is None:
        weights = kvmath.weight_bytes_per_gpu(model.geometry, weight_elem, tp)
    overhead = estimate_overhead(
        model,
        tp=tp,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        act_dtype_bytes=kvmath.dtype_bytes(dtype),
        enforce_eager=inputs.enforce_eager,
        activation=inputs.activation_bytes,
        non_torch=inputs.non_torch_bytes,
        cuda_graphs=inputs.cuda_graph_bytes,
    )
    total = inputs.gpu_memory_bytes
    budget = math.floor(total * inputs.gpu_memory_utilization)
    fixed = weights + overhead.total
    if inputs.kv_cache_memory_bytes is not None:
        kv_bytes, kv_source = inputs.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    else:
        kv_bytes, kv_source = budget - fixed, "total × utilization − weights − overhead"
    blocks = kvmath.num_blocks(kv_bytes, bpt, bs)
    mean_len = inputs.workload.mean_len if inputs.workload else None

    plan_core = _Core(inputs, dtype, max_len, bpt, weights, overhead, fixed, budget, blocks)
    problems = plan_core.problems()
    return Plan(
        inputs=inputs,
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        weights=weights,
        overhead=overhead,
        budget=budget,
        kv_bytes=max(0, kv_bytes),
        kv_source=kv_source,
        bytes_per_token=bpt,
        block_bytes=kvmath.block_bytes(bpt, bs),
        num_blocks=blocks,
        kv_tokens=kvmath.kv_tokens(blocks, bs),
        concurrency_at_max_len=kvmath.max_concurrency(blocks, max_len, bs),
        concurrency_at_mean=kvmath.max_concurrency(blocks, mean_len, bs) if mean_len else None,
        problems=problems,
        warnings=plan_core.warnings(),
        recommendation=None if problems else plan_core.recommend(),
        inverse=plan_core.inverse(),
        weight_bytes_per_param=weight_elem,
        notes=model.notes,
    )


@dataclass(frozen=True, slots=True)
class _Core:
    """The figures the verdict, the recommendations and the inverse share."""

    inputs: PlanInputs
    dtype: str
    max_len: int
    bpt: int
    weights: int
    overhead: Overhead
    fixed: int
    budget: int
    blocks: int

    @property
    def bs(self) -> int:
        return self.inputs.block_size

    @property
    def total(self) -> int:
        return self.inputs.gpu_memory_bytes

    def min_utilization(self, kv_bytes_needed: int) -> float | None:
        """Smallest utilization (to 0.001) leaving `kv_bytes_needed` for KV; None if > 1."""
        util = math.ceil((self.fixed + kv_bytes_needed) / self.total * 1000) / 1000
        # Rounding of `total × util` can fall a byte short; step up until it fits.
        while util <= 1 and math.floor(self.total * util) - self.fixed < kv_bytes_needed:
            util = round(util + 0.001, 3)
        return util if util <= 1 else None

    def problems(self) -> tuple[Problem, ...]:
        found: list[Problem] = []
        inp, tp = self.inputs, self.inputs.tensor_parallel_size
        one_request = kvmath.blocks_per_request(self.max_len, self.bs)
        one_request_bytes = kvmath.bytes_for_blocks(one_request, self.bpt, self.bs)
        if self.weights >= self.total:
            # Tensor-parallel sizes divide the head count: powers of two are the safe choice.
            need_tp = tp * 2 ** math.ceil(math.log2(self.weights / (self.total * 0.8)))
            found.append(
                Problem(
                    "weights-exceed-gpu",
                    f"the weights alone ({_gib(self.weights)} per GPU) exceed the GPU's "
                    f"{_gib(self.total)}: loading fails with CUDA out of memory",
                    f"spread the model over more GPUs (--tensor-parallel-size {need_tp} or "
                    "more) or serve a quantized checkpoint",
                )
            )
        elif inp.kv_cache_memory_bytes is None and self.budget <= self.fixed:
            util = self.min_utilization(one_request_bytes)
            fix = (
                f"raise --gpu-memory-utilization to at least {util:.3f}"
                if util is not None
                else f"use more GPUs (--tensor-parallel-size {tp * 2}) or a quantized model"
            )
            found.append(
                Problem(
                    "budget-below-weights",
                    f"the budget total × {inp.gpu_memory_utilization} = {_gib(self.budget)} "
                    f"does not cover weights {_gib(self.weights)} + overhead "
                    f"{_gib(self.overhead.total)}: vLLM stops with 'No available memory "
                    "for the cache blocks'",
                    fix,
                )
            )
        if self.max_len > inp.model.max_position_embeddings:
            found.append(
                Problem(
                    "max-model-len-above-model",
                    f"--max-model-len {self.max_len} is above the model's "
                    f"max_position_embeddings {inp.model.max_position_embeddings}: vLLM "
                    "refuses it",
                    f"use --max-model-len {inp.model.max_position_embeddings} or less",
                )
            )
        if not found and self.blocks < one_request:
            longest = self.blocks * self.bs
            util = self.min_utilization(one_request_bytes)
            fixes = [f"lower --max-model-len to {longest} or less"] if longest else []
            if inp.kv_cache_memory_bytes is not None:
                fixes.append(f"raise --kv-cache-memory-bytes to {one_request_bytes}")
            elif util is not None:
                fixes.append(f"raise --gpu-memory-utilization to {util:.3f}")
            found.append(
                Problem(
                    "one-request-does-not-fit",
                    f"one request of max_model_len {self.max_len} tokens needs "
                    f"{one_request} blocks ({_gib(one_request_bytes)}) but the KV cache has "
                    f"{self.blocks}: vLLM stops with a ValueError at start-up",
                    " or ".join(fixes) or "free GPU memory (more GPUs or a smaller model)",
                )
            )
        if inp.kv_cache_memory_bytes is not None:
            used = self.fixed + inp.kv_cache_memory_bytes
            if used > self.total and self.weights < self.total:
                found.append(
                    Problem(
                        "kv-cache-memory-exceeds-gpu",
                        f"weights + overhead + --kv-cache-memory-bytes = {_gib(used)} exceed "
                        f"the GPU's {_gib(self.total)}: allocation fails with out of memory",
                        f"use --kv-cache-memory-bytes {max(0, self.total - self.fixed)} or less",
                    )
                )
        return tuple(found)

    def warnings(self) -> tuple[str, ...]:
        found: list[str] = []
        util = self.inputs.gpu_memory_utilization
        if util >= HIGH_UTILIZATION and self.inputs.kv_cache_memory_bytes is None:
            margin = self.total - self.budget
            found.append(
                f"gpu_memory_utilization {util} leaves only {_gib(margin)} outside vLLM's "
                "budget. That margin must hold everything vLLM's profile does not see: the "
                "CUDA context and driver allocations made before start-up (vLLM refuses to "
                "start when free memory < total × utilization), other processes (a desktop "
                "on consumer GPUs), allocator fragmentation, and CUDA graphs on versions "
                "that capture them after sizing the KV cache. Expect start-up refusals or "
                "out-of-memory crashes under load; 0.90–0.92 is the usual ceiling."
            )
        if self.inputs.model.geometry.attention == "mla" and self.bs != 64:
            found.append(
                "MLA models run with FlashMLA on CUDA, which uses block size 64; "
                f"the plan uses --block-size {self.bs}"
            )
        return tuple(found)

    def recommend(self) -> Recommendation:
        workload = self.inputs.workload
        if workload is not None:
            mean_len = min(self.max_len, workload.mean_len)
            p95_len = min(self.max_len, workload.total_p95)
            service_s = max(workload.output_mean, 1.0) / self.inputs.decode_tokens_per_s
        else:
            mean_len = p95_len = self.max_len
            service_s = self.max_len / 2 / self.inputs.decode_tokens_per_s
        usable = max(0, self.blocks - 1)  # vLLM holds one block back as the null block
        mean_blocks = kvmath.blocks_per_request(mean_len, self.bs)
        p95_blocks = kvmath.blocks_per_request(p95_len, self.bs)
        reasons: list[str] = []
        if workload is None:
            reasons.append(
                "no workload given: sized for requests of max_model_len tokens (the worst "
                "case); pass --prompt-mean/--output-mean or --trace for realistic figures"
            )

        fit_mean = usable // mean_blocks
        default_seqs = DEFAULT_SEQS[self.inputs.large_gpu]
        seqs = max(1, min(fit_mean, default_seqs))
        reasons.append(
            f"max_num_seqs {seqs}: {fit_mean} requests of {mean_len} tokens fit in "
            f"{usable} usable blocks (capped at vLLM's default {default_seqs}); more running "
            "sequences than the KV cache holds only means preemptions, and a smaller value "
            "also shrinks the sampler's profiled activation memory"
        )

        ceiling = DEFAULT_KV_CEILING
        if usable and int(usable * ceiling) < p95_blocks:
            ceiling = min(1.0, math.ceil(p95_blocks / usable * 100) / 100)
            while ceiling < 1.0 and int(usable * ceiling) < p95_blocks:
                ceiling = round(ceiling + 0.01, 2)
            if int(usable * ceiling) >= p95_blocks:
                reasons.append(
                    f"kv_ceiling {ceiling}: raised from {DEFAULT_KV_CEILING} so that one p95 "
                    f"request ({p95_blocks} blocks) can still be admitted"
                )
            else:
                reasons.append(
                    f"kv_ceiling {ceiling}: even all {usable} usable blocks (vLLM keeps one "
                    f"back) cannot hold one p95 request of {p95_blocks} blocks; the gateway "
                    "will reject such requests: give the engine more KV memory or lower "
                    "max_model_len"
                )
        else:
            reasons.append(
                f"kv_ceiling {ceiling}: reserve up to {ceiling:.0%} of the blocks, keeping the "
                "rest as headroom for traffic that bypasses the gateway and for drift "
                "between reservations and what vLLM allocates"
            )

        slots = max(1, min(seqs, int(usable * ceiling) // mean_blocks))
        queue_len = 2 * slots
        max_wait = max(1.0, round(queue_len / slots * service_s, 1))
        reasons.append(
            f"queue.max_length {queue_len}: two engine-fulls of waiting requests "
            f"({slots} run at once at the mean length); a longer line only adds latency"
        )
        reasons.append(
            f"queue.max_wait_s {max_wait}: the time the engine needs to turn the line over "
            f"once at {self.inputs.decode_tokens_per_s:g} generated tokens/s per sequence "
            "(--decode-tps, an assumption: measure yours)"
        )
        return Recommendation(
            request_len=mean_len,
            request_len_p95=p95_len,
            max_num_seqs=seqs,
            kv_ceiling=ceiling,
            queue_max_length=queue_len,
            queue_max_wait_s=max_wait,
            reasons=tuple(reasons),
        )

    def inverse(self) -> Inverse | None:
        n = self.inputs.target_concurrency
        if n is None:
            return None
        length = self.inputs.target_len or self.max_len
        needed = kvmath.blocks_for_concurrency(n, length, self.bs)
        needed_bytes = kvmath.bytes_for_blocks(needed, self.bpt, self.bs)
        longest = kvmath.max_len_for_concurrency(self.blocks, n, self.bs)
        return Inverse(
            concurrency=n,
            length=length,
            blocks_needed=needed,
            kv_bytes_needed=needed_bytes,
            min_gpu_memory_utilization=self.min_utilization(needed_bytes),
            max_model_len_for_target=min(longest, self.inputs.model.max_position_embeddings),
        )


def _gib(amount: int | float) -> str:
    return f"{amount / GIB:.2f} GiB"
