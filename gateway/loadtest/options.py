"""The workload and run options every loadtest command shares: flags, and a tenants file.

`run_config(args, model, max_model_len)` turns them into a `RunConfig` (validated); a
tenants file (`--workload FILE`, YAML) gives several tenants, each with its own key, load
and shape:

    tenants:
      - name: chat-app
        api_key_env: CHAT_APP_KEY        # or api_key_file: path
        rate: 4                          # or concurrency: 8, or ramp: "1:10:60"
        burstiness: 1
        api: chat
        input_len: "uniform:100,400"
        output_len: 64
        prefix_groups: 4
        prefix_tokens: 256
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import yaml

from gateway.loadtest.arrivals import Arrivals, Ramp, Rate, Replay
from gateway.loadtest.lengths import parse_lengths
from gateway.loadtest.runner import RunConfig
from gateway.loadtest.targets import TargetError, read_secret
from gateway.loadtest.workload import APIS, RequestSpec, Shape, TenantLoad, from_trace
from gateway.traces import MOONCAKE_BLOCK_TOKENS, read_trace

TENANT_KEYS = {
    "name",
    "api_key_env",
    "api_key_file",
    "rate",
    "burstiness",
    "concurrency",
    "ramp",
    "max_concurrency",
    "api",
    "stream",
    "input_len",
    "output_len",
    "ignore_eos",
    "token_ids",
    "prefix_groups",
    "prefix_tokens",
    "turns",
    "turn_input_len",
    "think_time_s",
}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("requests")
    shape.add_argument("--model", help="model id (default: the target's first)")
    shape.add_argument(
        "--tokenizer",
        default="hf:@tiny",
        help="the engine's tokenizer as a gateway spec: hf:<dir> (default hf:@tiny, the "
        "simulator's); prompts are built to exact lengths with it",
    )
    shape.add_argument("--api", choices=APIS, default="chat")
    shape.add_argument("--no-stream", action="store_true", help="whole answers, no TTFT")
    shape.add_argument("--input-len", default="128", help="e.g. 128, uniform:64,256, ...")
    shape.add_argument("--output-len", default="64", help="max_tokens: same forms")
    shape.add_argument(
        "--no-ignore-eos", action="store_true", help="let the model stop before max_tokens"
    )
    shape.add_argument("--token-ids", action="store_true", help="completions: token-id prompts")
    shape.add_argument("--prefix-groups", type=int, default=0, help="G shared system prompts")
    shape.add_argument("--prefix-tokens", type=int, default=0, help="... of P tokens each")
    shape.add_argument("--turns", type=int, default=1, help="turns per multi-turn session")
    shape.add_argument(
        "--turn-input-len", help="tokens each later turn adds (default: --input-len's)"
    )
    shape.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")

    load = parser.add_argument_group("load (one of)")
    load.add_argument("--rate", type=float, help="open loop: requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="1 Poisson, inf constant")
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    load.add_argument("--ramp", help="START:END:SECONDS, an open loop whose rate ramps")
    load.add_argument("--trace", type=Path, help="replay a trace (Mooncake JSONL or CSV)")
    load.add_argument("--time-scale", type=float, default=1.0, help="trace time × this")
    load.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    load.add_argument("--workload", type=Path, help="tenants file (YAML), see the docs")
    load.add_argument("--max-concurrency", type=int, help="cap in-flight requests (open loop)")

    run = parser.add_argument_group("run")
    run.add_argument("--requests", type=int, help="stop after this many requests")
    run.add_argument("--duration", type=float, help="stop starting requests after S seconds")
    run.add_argument("--warmup", type=int, default=0, help="first N requests not counted")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--retry-429", type=int, default=2, help="retries of a 429, as the SDKs (default 2)"
    )
    run.add_argument("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt")

    keys = parser.add_argument_group("keys (never on the command line)")
    keys.add_argument("--api-key-env", help="environment variable holding the API key")
    keys.add_argument("--api-key-file", help="file holding the API key")
    keys.add_argument("--admin-key-env", help="variable holding the gateway's admin key")
    keys.add_argument("--admin-key-file", help="file holding the gateway's admin key")

    out = parser.add_argument_group("output")
    out.add_argument("--engine-metrics", help="engine base URLs to scrape, comma-separated")
    out.add_argument("--scrape-interval", type=float, default=1.0, help="seconds")
    out.add_argument("--json", type=Path, help="write every aggregate and record here")
    out.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    out.add_argument("--quiet", action="store_true", help="no progress display")


def admin_key(args: argparse.Namespace) -> str | None:
    return read_secret(args.admin_key_env, args.admin_key_file, "admin key")


def engine_metrics(args: argparse.Namespace) -> tuple[str, ...]:
    if not args.engine_metrics:
        return ()
    return tuple(u.strip().rstrip("/") for u in args.engine_metrics.split(",") if u.strip())


def load_of(args: argparse.Namespace) -> tuple[Arrivals | None, int | None]:
    """The flags' load: (arrivals, None) for an open loop, (None, concurrency) for closed."""
    given = [x is not None for x in (args.rate, args.concurrency, args.ramp)]
    if sum(given) > 1:
        raise ValueError("give one of --rate, --concurrency and --ramp")
    if args.concurrency is not None:
        return None, args.concurrency
    if args.ramp is not None:
        parts = args.ramp.split(":")
        try:
            start, end, over = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--ramp {args.ramp!r}: expected START:END:SECONDS") from None
        return Ramp(start, end, over, args.burstiness), None
    if args.rate is not None:
        return Rate(args.rate, args.burstiness), None
    return None, 10  # the tuning method's baseline: 10 concurrent requests


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        api=args.api,
        stream=not args.no_stream,
        input_len=parse_lengths(args.input_len),
        output_len=parse_lengths(args.output_len),
        ignore_eos=not args.no_ignore_eos,
        token_ids=args.token_ids,
        prefix_groups=args.prefix_groups,
        prefix_tokens=args.prefix_tokens,
        turns=args.turns,
        think_time_s=args.think_time,
        turn_input_len=parse_lengths(args.turn_input_len) if args.turn_input_len else None,
    )


def run_config(
    args: argparse.Namespace,
    model: str,
    max_model_len: int | None,
    *,
    arrivals: Arrivals | None = None,
    concurrency: int | None = None,
    override_load: bool = False,
) -> RunConfig:
    """The run the flags describe (`override_load`: use `arrivals`/`concurrency` instead of
    the load flags, as compare and sweep do per run)."""
    api_key = read_secret(args.api_key_env, args.api_key_file, "API key")
    if not override_load:
        arrivals, concurrency = load_of(args)
    if args.workload is not None:
        tenants = tuple(read_tenants(args.workload, args, arrivals, concurrency))
    else:
        if args.max_concurrency is not None and arrivals is None:
            raise ValueError("--max-concurrency caps an open loop: give --rate or --ramp")
        tenants = (
            TenantLoad(
                "default",
                shape_of(args),
                arrivals,
                concurrency,
                args.max_concurrency,
                api_key,
            ),
        )
    trace: tuple[RequestSpec, ...] = ()
    replay: Replay | None = None
    if args.trace is not None:
        if args.workload is None and (args.rate or args.concurrency or args.ramp):
            raise ValueError("--trace sets the arrivals: drop --rate/--concurrency/--ramp")
        parsed = read_trace(args.trace)
        if not parsed.timed:
            raise ValueError(f"{args.trace}: the trace has no timestamps to replay")
        if args.trace_block_tokens < 1:
            raise ValueError("--trace-block-tokens must be at least 1")
        trace = tuple(from_trace(parsed, tenants[0].name, args.trace_block_tokens))
        replay = Replay(tuple(r.at_s or 0.0 for r in parsed.requests), args.time_scale)
        # The tenants still decide shapes and keys; the trace decides lengths and times.
        tenants = tuple(
            TenantLoad(t.name, t.shape, Rate(math.inf), None, None, t.api_key) for t in tenants
        )
    cfg = RunConfig(
        tenants=tenants,
        model=model,
        max_requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        retry_429=args.retry_429,
        seed=args.seed,
        max_model_len=max_model_len,
        drain_s=args.timeout,
        trace=trace,
        trace_arrivals=replay,
    )
    cfg.validate()
    return cfg


def read_tenants(
    path: Path,
    args: argparse.Namespace,
    arrivals: Arrivals | None,
    concurrency: int | None,
) -> list[TenantLoad]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    items = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a 'tenants:' list")
    tenants = []
    base = shape_of(args)
    for n, item in enumerate(items, start=1):
        where = f"{path}: tenant {n}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = sorted(set(item) - TENANT_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
        tenants.append(_tenant(item, where, base, arrivals, concurrency, args))
    return tenants


def _tenant(
    item: dict[str, Any],
    where: str,
    base: Shape,
    arrivals: Arrivals | None,
    concurrency: int | None,
    args: argparse.Namespace,
) -> TenantLoad:
    try:
        key = read_secret(item.get("api_key_env"), item.get("api_key_file"), f"{where} key")
    except TargetError as exc:
        raise ValueError(str(exc)) from None
    if key is None:
        key = read_secret(args.api_key_env, args.api_key_file, "API key")
    shape = Shape(
        api=str(item.get("api", base.api)),
        stream=bool(item.get("stream", base.stream)),
        input_len=parse_lengths(str(item["input_len"])) if "input_len" in item else base.input_len,
        output_len=parse_lengths(str(item["output_len"]))
        if "output_len" in item
        else base.output_len,
        ignore_eos=bool(item.get("ignore_eos", base.ignore_eos)),
        token_ids=bool(item.get("token_ids", base.token_ids)),
        prefix_groups=int(item.get("prefix_groups", base.prefix_groups)),
        prefix_tokens=int(item.get("prefix_tokens", base.prefix_tokens)),
        turns=int(item.get("turns", base.turns)),
        think_time_s=float(item.get("think_time_s", base.think_time_s)),
        turn_input_len=parse_lengths(str(item["turn_input_len"]))
        if "turn_input_len" in item
        else base.turn_input_len,
    )
    burst = float(item.get("burstiness", 1.0))
    own: tuple[Arrivals | None, int | None]
    if sum(k in item for k in ("rate", "concurrency", "ramp")) > 1:
        raise ValueError(f"{where}: give one of rate, concurrency and ramp")
    if "rate" in item:
        own = (Rate(float(item["rate"]), burst), None)
    elif "concurrency" in item:
        own = (None, int(item["concurrency"]))
    elif "ramp" in item:
        start, end, over = (float(p) for p in str(item["ramp"]).split(":"))
        own = (Ramp(start, end, over, burst), None)
    else:
        own = (arrivals, concurrency)
    max_conc = item.get("max_concurrency")
    tenant = TenantLoad(
        str(item.get("name", where)),
        shape,
        own[0],
        own[1],
        int(max_conc) if max_conc is not None else None,
        key,
    )
    tenant.validate()
    return tenant
