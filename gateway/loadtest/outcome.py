"""How a loadtest command ends: the report it prints and writes last, and its exit code
(bad input 2, no request succeeded 1, interrupted 130: the contract is in cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gateway.loadtest import report

PROG = "kv-gateway loadtest"
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def fail(message: str) -> int:
    first = message.strip().splitlines()[0] if message.strip() else "error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return EXIT_BAD_INPUT


def finish(
    args: argparse.Namespace,
    document: dict[str, Any],
    runs: list[dict[str, Any]],
    *,
    single: bool = True,
) -> int:
    """Print (`single`: the one run's summary), write the JSON and the plots of a single run;
    the exit code of the whole command from its runs."""
    if single:
        report.print_summary(runs[0])
    if args.json is not None:
        report.write_json(args.json, document)
        print(f"wrote {args.json}")
    if single and args.plots is not None:
        from gateway.loadtest import plots

        for path in plots.write_run_plots(runs, Path(args.plots)):
            print(f"wrote {path}")
    if any(r.get("interrupted") for r in runs):
        return EXIT_INTERRUPTED
    failed = [r for r in runs if r["summary"]["requests"] and not r["summary"]["outcomes"]["ok"]]
    if failed:
        worst = failed[0]["summary"]["failures"]
        detail = ", ".join(f"{k} ×{v}" for k, v in worst.items()) or "no answer"
        print(
            f"{PROG}: error: no request succeeded against {failed[0]['label']} ({detail})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0
