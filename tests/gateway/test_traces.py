"""The one trace reader: Mooncake JSONL, the planner's JSONL, CSV; errors name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.planner.workload import from_trace
from gateway.traces import TraceError, TraceRequest, parse_trace, read_trace

MOONCAKE = [
    '{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1, 2]}',
    "",
    '{"timestamp": 1500, "input_length": 100, "output_length": 7, "hash_ids": [0, 9]}',
]


def test_mooncake_lines() -> None:
    trace = parse_trace(MOONCAKE, source="m.jsonl")
    assert trace.format == "mooncake" and trace.timed and trace.duration_s == 1.5
    assert trace.requests[1] == TraceRequest(1.5, 100, 7, (0, 9), None)


def test_planner_lines_have_no_timestamps() -> None:
    trace = parse_trace(['{"prompt_tokens": 5, "output_tokens": 3}'])
    assert trace.format == "planner" and not trace.timed
    assert trace.requests == (TraceRequest(None, 5, 3),)


def test_csv_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,input_tokens,output_tokens,tenant\n0,10,5,a\n250,20,6,b\n")
    trace = read_trace(path)
    assert trace.format == "csv" and trace.tenants == ("a", "b")
    assert trace.requests[1] == TraceRequest(0.25, 20, 6, (), "b")


def test_the_planner_reads_every_form() -> None:
    assert from_trace(MOONCAKE).requests == 2
    assert from_trace(["timestamp,input_tokens,output_tokens", "0,10,5"]).prompt_mean == 10


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["nope"], "t:1: expected a JSONL trace or a CSV header"),
        (['{"timestamp": -1, "input_length": 1, "output_length": 1}'], "t:1: timestamp"),
        (['{"timestamp": 0, "input_length": 1.5, "output_length": 1}'], "t:1: input_length"),
        (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}'], "hash_ids"),
        ([MOONCAKE[0], '{"prompt_tokens": 1, "output_tokens": 1}'], "t:2: mixes"),
        (["timestamp,input_tokens,output_tokens", "0,1"], "t:2: expected 3 columns"),
        (["timestamp,input_tokens,output_tokens", "x,1,1"], "t:2: 'x' is not a number"),
        (["timestamp,input_tokens,output_tokens", "0,-1,1"], "t:2: '-1' is not a whole"),
        (["timestamp,input_tokens,output_tokens"], "no requests"),
        ([" "], "no requests"),
    ],
)
def test_bad_traces_name_the_line(lines: list[str], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(lines, source="t")


def test_unreadable_file() -> None:
    with pytest.raises(TraceError, match="cannot read trace /no/such"):
        read_trace("/no/such")
