"""Request traces: the one reader behind `kv-gateway loadtest` (replay) and `kv-gateway plan`
(sizing from a workload).

Three line formats, told apart by the first line that is not blank:

- **Mooncake JSONL** (the format of the Mooncake/Kimi traces): one object per line with
  `timestamp` (milliseconds from the trace's start), `input_length`, `output_length` and
  optionally `hash_ids` — equal ids mean equal prefix blocks of `MOONCAKE_BLOCK_TOKENS` tokens.
- **Planner JSONL**: `{"prompt_tokens": P, "output_tokens": O}` per line, no timestamps (the
  form `kv-gateway plan --trace` has always read).
- **CSV** with a header line `timestamp,input_tokens,output_tokens[,tenant]` (timestamp in
  milliseconds, like Mooncake's).

Contract: pure parsing (no I/O beyond `read_trace` reading one file); every malformed line
raises `TraceError` naming `source:line`; a trace has at least one request; timestamps, when
present, are ≥ 0 and given on every line (a trace is replayed on them or not at all). Requests
keep the file's order.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` block in Mooncake traces."""

CSV_COLUMNS = ("timestamp", "input_tokens", "output_tokens")


class TraceError(ValueError):
    """The trace cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `at_s` is seconds from the trace's start (None: no timestamp)."""

    at_s: float | None
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    source: str
    format: str  # "mooncake" | "planner" | "csv"

    @property
    def timed(self) -> bool:
        return self.requests[0].at_s is not None

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0 for an untimed trace)."""
        if not self.timed:
            return 0.0
        times = [r.at_s or 0.0 for r in self.requests]
        return max(times) - min(times)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({r.tenant for r in self.requests if r.tenant is not None}))


def read_trace(path: str | Path) -> Trace:
    """Read and parse one trace file; an unreadable file is a `TraceError` too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"cannot read trace {path}: not UTF-8 text") from None
    return parse_trace(text.splitlines(), source=str(path))


def parse_trace(lines: Iterable[str], *, source: str = "trace") -> Trace:
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise TraceError(f"{source}: no requests in the trace")
    if numbered[0][1].lstrip().startswith(("{", "[")) or _looks_like_json(numbered[0][1]):
        return _parse_jsonl(numbered, source)
    return _parse_csv(numbered, source)


def _looks_like_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _parse_jsonl(numbered: Sequence[tuple[int, str]], source: str) -> Trace:
    requests: list[TraceRequest] = []
    kind: str | None = None
    for number, line in numbered:
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"{where}: not JSON") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object")
        line_kind = "mooncake" if "input_length" in record or "timestamp" in record else "planner"
        if kind is None:
            kind = line_kind
        elif line_kind != kind:
            raise TraceError(f"{where}: mixes the Mooncake and the planner's JSONL fields")
        if kind == "mooncake":
            requests.append(_mooncake(record, where))
        else:
            requests.append(_planner(record, where))
    assert kind is not None
    return Trace(tuple(requests), source, kind)


def _mooncake(record: dict[str, object], where: str) -> TraceRequest:
    inp, out = _count(record.get("input_length")), _count(record.get("output_length"))
    if inp is None or out is None:
        raise TraceError(f"{where}: input_length and output_length must be whole numbers ≥ 0")
    stamp = _timestamp(record.get("timestamp"), where)
    raw_hashes = record.get("hash_ids", [])
    hashes = [_count(h) for h in raw_hashes] if isinstance(raw_hashes, list) else [None]
    tenant = record.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise TraceError(f"{where}: tenant must be a string")
    ids = tuple(h for h in hashes if h is not None)
    if len(ids) != len(hashes):
        raise TraceError(f"{where}: hash_ids must be a list of whole numbers ≥ 0")
    return TraceRequest(stamp, inp, out, ids, tenant)


def _planner(record: dict[str, object], where: str) -> TraceRequest:
    prompt, output = _count(record.get("prompt_tokens")), _count(record.get("output_tokens"))
    if prompt is None or output is None:
        raise TraceError(f"{where}: prompt_tokens and output_tokens must be whole numbers ≥ 0")
    return TraceRequest(None, prompt, output)


def _parse_csv(numbered: Sequence[tuple[int, str]], source: str) -> Trace:
    header = [c.strip().lower() for c in next(csv.reader([numbered[0][1]]))]
    if tuple(header[:3]) != CSV_COLUMNS or len(header) > 4 or header[3:] not in ([], ["tenant"]):
        raise TraceError(
            f"{source}:{numbered[0][0]}: expected a JSONL trace or a CSV header "
            "'timestamp,input_tokens,output_tokens[,tenant]'"
        )
    requests: list[TraceRequest] = []
    for number, line in numbered[1:]:
        where = f"{source}:{number}"
        cells = [c.strip() for c in next(csv.reader([line]))]
        if len(cells) != len(header):
            raise TraceError(f"{where}: expected {len(header)} columns, found {len(cells)}")
        stamp = _timestamp(_number(cells[0], where), where)
        inp, out = _whole(cells[1], where), _whole(cells[2], where)
        tenant = cells[3] or None if len(cells) == 4 else None
        requests.append(TraceRequest(stamp, inp, out, (), tenant))
    if not requests:
        raise TraceError(f"{source}: no requests in the trace")
    return Trace(tuple(requests), source, "csv")


def _timestamp(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: timestamp must be a number of milliseconds ≥ 0")
    if value < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds ≥ 0")
    return float(value) / 1000.0


def _number(cell: str, where: str) -> float:
    try:
        return float(cell)
    except ValueError:
        raise TraceError(f"{where}: {cell!r} is not a number") from None


def _whole(cell: str, where: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise TraceError(f"{where}: {cell!r} is not a whole number ≥ 0") from None
    if value < 0:
        raise TraceError(f"{where}: {cell!r} is not a whole number ≥ 0")
    return value


def _count(value: object) -> int | None:
    """`value` if it is a whole number ≥ 0 (not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
