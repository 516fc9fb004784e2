"""`kv-gateway loadtest run | compare | sweep`.

Bad input (an unknown or unreachable target, an unreadable trace, an impossible SLO or
length) is one line on stderr and exit code 2; a run in which no request succeeded exits 1
after its report; Ctrl-C stops the run, writes what it measured and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from gateway.loadtest import compare, options, sweep
from gateway.loadtest.aggregate import parse_slo
from gateway.loadtest.measure import measure
from gateway.loadtest.outcome import EXIT_INTERRUPTED, PROG, fail, finish
from gateway.loadtest.prompts import PromptBuilder, PromptError
from gateway.loadtest.targets import TargetError, parse_target, read_secret, resolve
from gateway.traces import TraceError


class UsageError(ValueError):
    """Input the tool cannot use; one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="loadtest_command", required=True, metavar="MODE")
    run = sub.add_parser("run", help="one workload against one target")
    run.add_argument("--target", required=True, help="[NAME=]URL[,URL...] (several: round robin)")
    options.add_workload_arguments(run)
    compare_parser = sub.add_parser("compare", help="one workload against several targets")
    compare.add_arguments(compare_parser)
    options.add_workload_arguments(compare_parser)
    sweep_parser = sub.add_parser("sweep", help="vary one setting, same workload at each value")
    sweep.add_arguments(sweep_parser)
    options.add_workload_arguments(sweep_parser)


def run(args: argparse.Namespace) -> int:
    try:
        if args.plots is not None:
            require_matplotlib()
        if args.loadtest_command == "compare":
            return compare.run(args)
        if args.loadtest_command == "sweep":
            return sweep.run(args)
        return asyncio.run(_run_one(args))
    except (UsageError, ValueError, TargetError, TraceError, PromptError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plots needs matplotlib: pip install 'kv-gateway[loadtest]'") from None


async def _run_one(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    name, urls = parse_target(args.target)
    api_key = read_secret(args.api_key_env, args.api_key_file, "API key")
    target = await resolve(
        name,
        urls,
        model=args.model,
        admin_key=options.admin_key(args),
        api_key=api_key,
        engine_metrics=options.engine_metrics(args),
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
        admin_key=options.admin_key(args),
        progress=not args.quiet,
        timeout_s=args.timeout,
    )
    return finish(args, result, [result])
