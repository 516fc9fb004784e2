"""The module layers hold: `lint-imports` checks the contracts in pyproject.toml.

Which package may import which (docs/architecture.md): the request path's layers, a pure
core (no I/O libraries, no clock, no global randomness), the simulator and the planner
beside the request path, and the serving path free of the test harness. TYPE_CHECKING
imports count.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
