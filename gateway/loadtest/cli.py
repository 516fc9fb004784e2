"""`kv-gateway loadtest run | compare | sweep`.

Bad input (an unknown or unreachable target, an unreadable trace, an impossible SLO or
length) is one line on stderr and exit code 2; a run in which no request succeeded exits 1
after its report; Ctrl-C stops the run, writes what it measured and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from gateway.loadtest import options, report
from gateway.loadtest.aggregate import parse_slo
from gateway.loadtest.measure import measure
from gateway.loadtest.prompts import PromptBuilder, PromptError
from gateway.loadtest.targets import TargetError, parse_target, read_secret, resolve
from gateway.traces import TraceError

PROG = "kv-gateway loadtest"
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class UsageError(ValueError):
    """Input the tool cannot use; one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="loadtest_command", required=True, metavar="MODE")
    run = sub.add_parser("run", help="one workload against one target")
    run.add_argument("--target", required=True, help="[NAME=]URL[,URL...] (several: round robin)")
    options.add_workload_arguments(run)
    compare = sub.add_parser("compare", help="one workload against several targets")
    from gateway.loadtest import compare as compare_mod

    compare_mod.add_arguments(compare)
    options.add_workload_arguments(compare)
    sweep = sub.add_parser("sweep", help="vary one setting, same workload at each value")
    from gateway.loadtest import sweep as sweep_mod

    sweep_mod.add_arguments(sweep)
    options.add_workload_arguments(sweep)


def run(args: argparse.Namespace) -> int:
    try:
        if args.plots is not None:
            require_matplotlib()
        if args.loadtest_command == "compare":
            from gateway.loadtest import compare as compare_mod

            return compare_mod.run(args)
        if args.loadtest_command == "sweep":
            from gateway.loadtest import sweep as sweep_mod

            return sweep_mod.run(args)
        return asyncio.run(_run_one(args))
    except (UsageError, ValueError, TargetError, TraceError, PromptError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def fail(message: str) -> int:
    first = message.strip().splitlines()[0] if message.strip() else "error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return EXIT_BAD_INPUT


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plots needs matplotlib: pip install 'kv-gateway[loadtest]'") from None


def admin_key(args: argparse.Namespace) -> str | None:
    return read_secret(args.admin_key_env, args.admin_key_file, "admin key")


def engine_metrics(args: argparse.Namespace) -> tuple[str, ...]:
    if not args.engine_metrics:
        return ()
    return tuple(u.strip().rstrip("/") for u in args.engine_metrics.split(",") if u.strip())


async def _run_one(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    name, urls = parse_target(args.target)
    api_key = read_secret(args.api_key_env, args.api_key_file, "API key")
    target = await resolve(
        name,
        urls,
        model=args.model,
        admin_key=admin_key(args),
        api_key=api_key,
        engine_metrics=engine_metrics(args),
    )
    assert target.model is not None
    cfg = options.run_config(args, target.model, target.max_model_len)
    builder = PromptBuilder.from_spec(args.tokenizer, target.model)
    result = await measure(
        target,
        cfg,
        builder,
        slo=slo,
        scrape_interval_s=args.scrape_interval,
        admin_key=admin_key(args),
        progress=not args.quiet,
        timeout_s=args.timeout,
    )
    return finish(args, result, [result])


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
