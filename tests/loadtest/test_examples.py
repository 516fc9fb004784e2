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
