"""The plan: memory split, vLLM's verdict, recommendations, the inverse questions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import kvmath
from gateway.planner import presets
from gateway.planner.overhead import GIB
from gateway.planner.plan import PlanInputs, make_plan
from gateway.planner.workload import from_figures, from_trace, percentile

LLAMA_8B = presets.find_model("llama-3.1-8b")
H100 = int(presets.find_gpu("h100").memory_gib * GIB)


def llama_on_h100(**overrides: object) -> PlanInputs:
    fields: dict[str, object] = {
        "model": LLAMA_8B,
        "gpu_memory_bytes": H100,
        "large_gpu": True,
        "max_model_len": 16000,
        "block_size": 128,
    }
    fields.update(overrides)
    return PlanInputs(**fields)  # type: ignore[arg-type]


def test_measured_overhead_reproduces_vllm() -> None:
    # Published vLLM 0.11 profile, Llama-3.1-8B on an H100 (79.18 GiB), utilization 0.9:
    # weights 14.99, activation 4.76, non-torch 0.13 GiB → "Available KV cache memory:
    # 51.38 GiB" (CUDA graphs were captured after sizing KV in that version).
    plan = make_plan(
        llama_on_h100(
            weights_bytes=int(14.99 * GIB),
            activation_bytes=int(4.76 * GIB),
            non_torch_bytes=int(0.13 * GIB),
            cuda_graph_bytes=0,
        )
    )
    assert plan.kv_bytes / GIB == pytest.approx(51.38, abs=0.01)
    assert plan.num_blocks == plan.kv_bytes // (128 * 131_072)


def test_estimated_overhead_is_close_to_the_profile() -> None:
    plan = make_plan(llama_on_h100())
    assert plan.weights / GIB == pytest.approx(14.99, rel=0.01)
    assert plan.overhead.activation / GIB == pytest.approx(4.76, rel=0.05)
    assert plan.kv_bytes / GIB == pytest.approx(51.38, rel=0.03)


@pytest.mark.parametrize(
    ("budget", "blocks", "concurrency"),
    [(786_432, 6, 1.5), (1_572_864, 12, 3.0), (4_194_304, 32, 8.0)],
)
def test_kv_cache_memory_bytes_gives_the_real_engines_blocks(
    budget: int, blocks: int, concurrency: float
) -> None:
    tiny = presets.ModelSpec(
        name="tiny",
        geometry=kvmath.ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=32, params=400_000),
        hidden_size=128,
        intermediate_size=256,
        vocab_size=2048,
        max_position_embeddings=512,
        dtype="float32",
    )
    plan = make_plan(
        PlanInputs(
            model=tiny,
            gpu_memory_bytes=24 * GIB,
            block_size=128,
            max_model_len=512,
            kv_cache_memory_bytes=budget,
            gpu_memory_utilization=0.1,  # ignored with --kv-cache-memory-bytes, as in vLLM
        )
    )
    assert (plan.num_blocks, plan.concurrency_at_max_len) == (blocks, concurrency)
    assert plan.kv_tokens == blocks * 128
    assert plan.starts


def test_budget_below_weights_refuses_with_a_fix() -> None:
    plan = make_plan(llama_on_h100(gpu_memory_utilization=0.2))
    kinds = [p.kind for p in plan.problems]
    assert kinds == ["budget-below-weights"]
    assert "--gpu-memory-utilization" in plan.problems[0].fix
    assert plan.recommendation is None


def test_full_length_request_that_does_not_fit_refuses_with_a_fix() -> None:
    plan = make_plan(
        PlanInputs(
            model=presets.find_model("qwen3-8b"),
            gpu_memory_bytes=int(presets.find_gpu("rtx4090").memory_gib * GIB),
            max_model_len=40960,
            gpu_memory_utilization=0.8,
        )
    )
    (problem,) = plan.problems
    assert problem.kind == "one-request-does-not-fit"
    # vLLM's own message for Qwen3-8B at 40,960 tokens: "5.62 GiB KV cache is needed".
    assert "needs 2560 blocks (5.62 GiB)" in problem.message
    assert f"--max-model-len to {plan.num_blocks * 16}" in problem.fix
    # Following the fix makes the engine start.
    fixed = make_plan(
        PlanInputs(
            model=presets.find_model("qwen3-8b"),
            gpu_memory_bytes=int(presets.find_gpu("rtx4090").memory_gib * GIB),
            max_model_len=plan.num_blocks * 16,
            gpu_memory_utilization=0.8,
        )
    )
    assert fixed.starts


def test_weights_larger_than_the_gpu() -> None:
    plan = make_plan(PlanInputs(model=presets.find_model("qwen2.5-72b"), gpu_memory_bytes=24 * GIB))
    assert plan.problems[0].kind == "weights-exceed-gpu"
    assert "--tensor-parallel-size" in plan.problems[0].fix


def test_max_model_len_above_the_model() -> None:
    plan = make_plan(llama_on_h100(max_model_len=200_000))
    assert "max-model-len-above-model" in [p.kind for p in plan.problems]


def test_high_utilization_warns_and_explains() -> None:
    plan = make_plan(llama_on_h100(gpu_memory_utilization=0.95))
    assert any("free memory < total × utilization" in w for w in plan.warnings)
    assert not make_plan(llama_on_h100(gpu_memory_utilization=0.94)).warnings


def test_inverse_smallest_utilization_is_exact() -> None:
    plan = make_plan(llama_on_h100(target_concurrency=16, target_len=8192))
    inv = plan.inverse
    assert inv is not None and inv.min_gpu_memory_utilization is not None
    at = make_plan(llama_on_h100(gpu_memory_utilization=inv.min_gpu_memory_utilization))
    below = make_plan(
        llama_on_h100(gpu_memory_utilization=round(inv.min_gpu_memory_utilization - 0.001, 3))
    )
    assert kvmath.max_concurrency(at.num_blocks, 8192, 128) >= 16
    assert kvmath.max_concurrency(below.num_blocks, 8192, 128) < 16


def test_inverse_largest_max_model_len() -> None:
    plan = make_plan(llama_on_h100(target_concurrency=64))
    inv = plan.inverse
    assert inv is not None
    assert kvmath.max_concurrency(plan.num_blocks, inv.max_model_len_for_target, 128) >= 64
    assert inv.min_gpu_memory_utilization is None  # 64 × 16,000 tokens exceed the H100


def test_recommendations_follow_the_workload() -> None:
    workload = from_figures(prompt_mean=1000, output_mean=300, prompt_p95=3000, output_p95=1000)
    plan = make_plan(llama_on_h100(workload=workload))
    rec = plan.recommendation
    assert rec is not None
    usable = plan.num_blocks - 1
    assert rec.max_num_seqs == min(1024, usable // kvmath.blocks_per_request(1300, 128))
    assert 0 < rec.kv_ceiling <= 1
    assert rec.queue_max_length >= 2
    assert plan.concurrency_at_mean == plan.num_blocks / kvmath.blocks_per_request(1300, 128)


def test_kv_ceiling_rises_to_admit_a_p95_request() -> None:
    plan = make_plan(
        llama_on_h100(
            kv_cache_memory_bytes=11 * 128 * 131_072,  # 11 blocks, 10 usable
            max_model_len=1280,
            workload=from_figures(100, 100, 600, 600),
        )
    )
    rec = plan.recommendation
    assert rec is not None
    assert int((plan.num_blocks - 1) * rec.kv_ceiling) >= 10
    assert rec.kv_ceiling == 1.0


def test_p95_request_larger_than_the_cache_is_explained() -> None:
    plan = make_plan(
        llama_on_h100(
            kv_cache_memory_bytes=10 * 128 * 131_072,  # vLLM starts: 10 blocks ≥ 10 needed
            max_model_len=1280,
            workload=from_figures(100, 100, 600, 600),
        )
    )
    assert plan.starts and plan.recommendation is not None
    assert any("cannot hold one p95 request" in r for r in plan.recommendation.reasons)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_splits_weights_and_kv(tp: int) -> None:
    plan = make_plan(
        PlanInputs(
            model=presets.find_model("llama-3.1-70b"),
            gpu_memory_bytes=80 * GIB,
            tensor_parallel_size=tp,
            max_model_len=8192,
        )
    )
    assert plan.bytes_per_token == 327_680 // tp
    assert plan.weights == pytest.approx(70.6e9 * 2 / tp, rel=1e-6)


def test_fp8_kv_doubles_the_blocks() -> None:
    auto = make_plan(llama_on_h100(kv_cache_memory_bytes=GIB))
    fp8 = make_plan(llama_on_h100(kv_cache_memory_bytes=GIB, kv_cache_dtype="fp8"))
    assert fp8.num_blocks == 2 * auto.num_blocks


@pytest.mark.parametrize(
    "overrides",
    [
        {"gpu_memory_utilization": 0},
        {"gpu_memory_utilization": 1.01},
        {"block_size": 0},
        {"kv_cache_dtype": "int2"},
        {"kv_cache_memory_bytes": -1},
    ],
)
def test_invalid_inputs(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_plan(llama_on_h100(**overrides))


@settings(max_examples=50, deadline=None)
@given(st.floats(0.3, 0.99), st.floats(0.0, 0.2))
def test_more_utilization_never_fewer_blocks(util: float, extra: float) -> None:
    low = make_plan(llama_on_h100(gpu_memory_utilization=util))
    high = make_plan(llama_on_h100(gpu_memory_utilization=min(1.0, util + extra)))
    assert high.num_blocks >= low.num_blocks


@settings(max_examples=50, deadline=None)
@given(st.integers(12, 200), st.integers(0, 100))
def test_more_gpu_memory_never_fewer_blocks(gib: int, extra: int) -> None:
    low = make_plan(llama_on_h100(gpu_memory_bytes=gib * GIB))
    high = make_plan(llama_on_h100(gpu_memory_bytes=(gib + extra) * GIB))
    assert high.num_blocks >= low.num_blocks


def test_trace_statistics() -> None:
    lines = [f'{{"prompt_tokens": {p}, "output_tokens": {o}}}' for p, o in [(10, 5)] * 19]
    lines += ["", '{"prompt_tokens": 1000, "output_tokens": 500}']
    workload = from_trace(lines)
    assert workload.requests == 20
    assert workload.prompt_mean == pytest.approx((19 * 10 + 1000) / 20)
    assert (workload.prompt_p95, workload.total_p95) == (10, 15)
    assert percentile([1, 2, 3, 4], 50) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("nope", "not JSON"),
        ("[1]", "JSON object"),
        ('{"prompt_tokens": -1, "output_tokens": 2}', "whole numbers"),
        ('{"prompt_tokens": 1}', "whole numbers"),
    ],
)
def test_bad_trace_lines_name_the_line(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"t.jsonl:2: .*{message}"):
        from_trace(['{"prompt_tokens": 1, "output_tokens": 1}', line], source="t.jsonl")
