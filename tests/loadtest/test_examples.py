"""The workloads shipped in loadtest/ stay readable by the tool."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.loadtest import compare, options, sweep
from gateway.loadtest.arrivals import Rate
from gateway.traces import read_trace

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"


@pytest.mark.parametrize("name", ["sweep-gpu-util", "sweep-kv-ceiling", "sweep-vllm-cpu"])
def test_sweep_specs(name: str) -> None:
    spec = sweep.read_spec(LOADTEST / f"{name}.yaml")
    assert spec.values


def test_compare_spec() -> None:
    args = argparse.Namespace(
        spec=LOADTEST / "compare-sim.yaml",
        target=[],
        rates=None,
        order=None,
        capacity_requests=None,
    )
    spec = compare.read_spec(args)
    assert [t.name for t in spec.targets] == ["direct", "gw-worst-case", "gw-predicted"]
    assert spec.rates == ["0.5x", "1x", "2x"]


def test_prefix_compare_spec_and_workload() -> None:
    parser = argparse.ArgumentParser()
    options.add_workload_arguments(parser)
    compare.add_arguments(parser)
    args = parser.parse_args(
        ["--spec", str(LOADTEST / "compare-prefix.yaml"), "--workload",
         str(LOADTEST / "prefix-chat.yaml"), "--rate", "4", "--requests", "10"]
    )  # fmt: skip
    spec = compare.read_spec(args)
    assert [t.name for t in spec.targets] == [
        "direct", "gw-most-free-blocks", "gw-most-free-after", "gw-mfa-w1", "gw-mfa-w16"
    ]  # fmt: skip
    routing = [(t.gateway or {}).get("routing", {}) for t in spec.targets]
    weights = [r.get("cached_block_weight") for r in routing]
    assert weights == [None, None, 4, 1, 16]
    assert spec.engines is not None and spec.engines["count"] == 4
    assert spec.engines["flags"]["prefill_ms_per_token"] >= 0.2
    assert spec.gateway["admission"]["reservation"] == "worst_case"
    sessions, one_off = options.run_config(args, "tiny", 2560).tenants
    assert (sessions.shape.turns, sessions.shape.prefix_tokens) == (4, 1024)
    assert sessions.shape.turn_input_len is not None and one_off.shape.prefix_groups == 0
    assert sessions.arrivals == one_off.arrivals == Rate(4.0)


def compare_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_workload_arguments(parser)
    compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_slo_compare_spec_and_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLO_INTERACTIVE_KEY", "slo-interactive-key")
    monkeypatch.setenv("SLO_RPM_PROBE_KEY", "slo-rpm-probe-key")
    args = compare_args(
        "--spec", str(LOADTEST / "compare-slo.yaml"),
        "--workload", str(LOADTEST / "compare-slo-tenants.yaml"),
        "--api-key-env", "SLO_INTERACTIVE_KEY",
        "--capacity", "slo", "--slo", "ttft=1s,tpot=50ms",
        "--input-len", "loguniform:128,2048", "--output-len", "loguniform:64,512",
        "--requests", "600", "--retry-429", "0", "--api", "completions",
    )  # fmt: skip
    spec = compare.read_spec(args)
    assert [t.name for t in spec.targets] == ["direct", "gateway-kv", "gateway-slo"]
    assert spec.rates == ["1.5x", "2x", "4x"]
    assert (spec.capacity, spec.capacity_quantile, spec.capacity_probes) == ("slo", 0.99, 6)
    assert spec.engines is not None
    flags = spec.engines["flags"]
    # The gateway-slo target's step costs are the engines' own.
    slo = (spec.targets[2].gateway or {})["slo"]
    assert slo["step_costs"] == {
        "base_ms": flags["decode_ms_base"],
        "per_seq_ms": flags["decode_ms_per_seq"],
        "per_prefill_token_ms": flags["prefill_ms_per_token"],
        "chunk_tokens": flags["max_num_batched_tokens"],
    }
    assert slo["classes"]["interactive"] == {"ttft_s": 1, "tpot_s": 0.05}
    # A full batch misses TPOT 50 ms before any prefill: both targets can bind.
    assert flags["decode_ms_base"] + flags["decode_ms_per_seq"] * flags["max_num_seqs"] >= 50
    assert spec.gateway["queue"] == {"max_wait_s": 1}
    interactive, probe = options.run_config(args, "tiny", 4096).tenants
    assert str(interactive.shape.input_len) == "loguniform:128,2048"
    assert interactive.arrivals is None and probe.arrivals == Rate(0.1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity", "slo"], "capacity slo needs --slo"),
        (["--capacity", "slo", "--slo", "ttft=1s", "--capacity-quantile", "1.5"], "quantile"),
        (["--capacity", "slo", "--slo", "ttft=1s", "--capacity-probes", "0"], "capacity_probes"),
        (["--capacity", "slo", "--slo", "ttft=1s", "--only", "gw-worst-case"], "'direct: true'"),
    ],
)
def test_bad_slo_capacity(argv: list[str], message: str) -> None:
    args = compare_args("--spec", str(LOADTEST / "compare-sim.yaml"), *argv)
    with pytest.raises(ValueError, match=message):
        compare.read_spec(args)


@pytest.mark.parametrize(
    ("only", "names"),
    [
        ("gw-most-free-after,direct", ["gw-most-free-after", "direct"]),  # in the order given
        ("gw-most-free-blocks", ["gw-most-free-blocks"]),
        ("direct,nope", None),
        (",", None),
    ],
)
def test_compare_only(only: str, names: list[str] | None) -> None:
    args = argparse.Namespace(
        spec=LOADTEST / "compare-prefix.yaml",
        target=[],
        rates=None,
        order=None,
        capacity_requests=None,
        only=only,
    )
    if names is None:
        with pytest.raises(ValueError, match="--only: unknown target"):
            compare.read_spec(args)
    else:
        assert [t.name for t in compare.read_spec(args).targets] == names


@pytest.mark.parametrize(
    ("name", "kind", "tenants"),
    [("mooncake-sample.jsonl", "mooncake", ()), ("two-tenants.csv", "csv", ("batch", "chat"))],
)
def test_traces(name: str, kind: str, tenants: tuple[str, ...]) -> None:
    trace = read_trace(LOADTEST / "traces" / name)
    assert trace.format == kind and trace.timed and trace.tenants == tenants


def test_tenants_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_KEY", "sk-chat")
    monkeypatch.setenv("BATCH_KEY", "sk-batch")
    parser = argparse.ArgumentParser()
    options.add_workload_arguments(parser)
    args = parser.parse_args(["--workload", str(LOADTEST / "tenants.yaml")])
    tenants = options.read_tenants(args.workload, args, None, 10)
    assert [(t.name, t.api_key) for t in tenants] == [("chat", "sk-chat"), ("batch", "sk-batch")]
    assert tenants[0].arrivals == Rate(3.0) and tenants[1].concurrency == 4


def test_the_fairness_scenario_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUIET_KEY", "sk-quiet")
    monkeypatch.setenv("FLOOD_KEY", "sk-flood")
    parser = argparse.ArgumentParser()
    options.add_workload_arguments(parser)
    args = parser.parse_args(["--workload", str(LOADTEST / "quiet-vs-flood.yaml")])
    quiet, flood = options.read_tenants(args.workload, args, None, 10)
    assert (quiet.name, flood.name) == ("quiet", "flood")
    assert flood.arrivals == Rate(10 * quiet.arrivals.rate)  # type: ignore[union-attr]
