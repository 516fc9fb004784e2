"""The real vLLM 0.32 `/metrics` captures, and pages derived from them by plain text edits."""

from __future__ import annotations

import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"
IDLE = "metrics-cpu-0.32.txt"  # idle after load, 1 GiB KV cache: 8192 blocks of 128 tokens
SATURATED = "metrics-cpu-0.32-saturated.txt"  # after the 6-block run: 17 preemptions


def capture(name: str) -> str:
    return (FIXTURES / name).read_text()


def set_value(page: str, series: str, value: str, engine: str = "0") -> str:
    """`page` with the value of `series{...engine="<engine>"...}` replaced (every model)."""
    pattern = re.compile(rf'^({re.escape(series)}\{{[^}}]*engine="{engine}"[^}}]*\}}) \S+$', re.M)
    edited, count = pattern.subn(rf"\g<1> {value}", page)
    assert count, f"{series} engine={engine} not in page"
    return edited


def set_label(page: str, series: str, label: str, value: str) -> str:
    """`page` with `label="..."` replaced on every sample of `series`."""
    lines = []
    for line in page.splitlines():
        if line.startswith(series + "{"):
            line = re.sub(rf'\b{label}="[^"]*"', f'{label}="{value}"', line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def add_dp_rank(page: str, engine: str) -> str:
    """`page` with every `engine="0"` sample of a vllm series also emitted for `engine`.

    The copy follows the original line, inside the same metric family, the way a
    data-parallel vLLM server writes one series per engine core.
    """
    lines = []
    for line in page.splitlines():
        lines.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            lines.append(line.replace('engine="0"', f'engine="{engine}"'))
    return "\n".join(lines) + "\n"


def drop_series(page: str, series: str) -> str:
    kept = [ln for ln in page.splitlines() if not ln.startswith((series + "{", series + " "))]
    return "\n".join(kept) + "\n"
