"""`kv-gateway loadtest compare`: one workload against several targets in one run.

A spec file (YAML) names the targets and, optionally, simulated engines the tool starts
itself; `--target` flags add targets that are already running:

    engines:                       # simulated engines (the harness starts them)
      count: 2
      flags: {num_gpu_blocks: 64, block_size: 16, max_num_seqs: 16, decode_ms_base: 10}
    targets:
      - name: direct               # the engines themselves, client-side round robin
        direct: true
      - name: gateway
        gateway: {admission: {reservation: worst_case}}   # merged into the generated config
      - name: remote
        url: http://10.0.0.5:8000
    rates: [0.5x, 1x, 2x]          # × capacity, or absolute req/s (then no capacity run)
    order: interleaved             # or sequential, or mixed
    capacity_requests: 200
    capacity: throughput           # or slo (needs --slo)
    capacity_quantile: 0.99        # capacity slo: the share of requests meeting every SLO
    capacity_probes: 6             # capacity slo: open-loop probes of capacity_requests each

Capacity is the direct target's saturated throughput (rate inf), measured first in the same
run. With `capacity: slo` it is then the **SLO capacity**: the highest open-loop rate at
which the direct target meets every `--slo` for at least `capacity_quantile` of its
requests, found by bisection between 0 and the throughput capacity (`capacity.SloSearch`),
each probe a run of `capacity_requests` on restarted engines; relative rates multiply it.
Before every run the simulated engines are restarted and a gateway target gets a fresh
gateway: each run starts from a clean state. Runs go rate by rate, the targets' order
rotating (interleaved), or target by target (sequential). `mixed` runs every target at
once, each rate one run whose requests go to the targets in turn (the rate is the total):
the targets share the engines and the machine at the same moments, so noise that swamps a
few per cent between runs (a loaded machine, an engine sharing cores with the client)
falls on each alike; a gateway then sees the others' requests as foreign load.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gateway.loadtest import options, report
from gateway.loadtest.aggregate import Slo, parse_slo
from gateway.loadtest.arrivals import Rate
from gateway.loadtest.capacity import SloSearch
from gateway.loadtest.measure import measure, measure_mixed
from gateway.loadtest.outcome import EXIT_FAILED, PROG, finish
from gateway.loadtest.prompts import PromptBuilder
from gateway.loadtest.runner import RunConfig
from gateway.loadtest.setups import ManagedGateway, SimFleet, merge
from gateway.loadtest.targets import Target, parse_target, read_secret, resolve

SPEC_KEYS = {
    "engines",
    "targets",
    "rates",
    "order",
    "capacity_requests",
    "gateway",
    "capacity",
    "capacity_quantile",
    "capacity_probes",
}
CAPACITIES = ("throughput", "slo")
TARGET_KEYS = {"name", "direct", "gateway", "url"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, help="compare spec (YAML), see the docs")
    parser.add_argument(
        "--target", action="append", default=[], help="[NAME=]URL[,URL...] (repeatable)"
    )
    parser.add_argument("--rates", help="comma-separated: 0.5x,1x,2x (× capacity) or req/s")
    parser.add_argument("--order", choices=("interleaved", "sequential", "mixed"))
    parser.add_argument(
        "--capacity-requests", type=int, help="requests of the capacity run (and of each probe)"
    )
    parser.add_argument(
        "--capacity",
        choices=CAPACITIES,
        help="what relative rates multiply: the direct target's saturated throughput "
        "(default) or its SLO capacity (needs --slo)",
    )
    parser.add_argument(
        "--capacity-quantile",
        type=float,
        help="--capacity slo: the share of requests that must meet every SLO (default 0.99)",
    )
    parser.add_argument(
        "--capacity-probes", type=int, help="--capacity slo: probes of the search (default 6)"
    )
    parser.add_argument(
        "--only", help="run only these targets of the spec, in this order (comma-separated)"
    )


@dataclass(frozen=True, slots=True)
class TargetSpec:
    name: str
    direct: bool = False
    gateway: dict[str, Any] | None = None
    url: str | None = None


@dataclass
class Spec:
    targets: list[TargetSpec]
    engines: dict[str, Any] | None = None
    rates: list[str] = field(default_factory=list)
    order: str = "interleaved"
    capacity_requests: int = 200
    gateway: dict[str, Any] = field(default_factory=dict)
    capacity: str = "throughput"
    capacity_quantile: float = 0.99
    capacity_probes: int = 6


def read_spec(args: argparse.Namespace) -> Spec:
    data: dict[str, Any] = {}
    if args.spec is not None:
        try:
            loaded = yaml.safe_load(args.spec.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read {args.spec}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{args.spec}: not YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.spec}: expected a mapping")
        unknown = sorted(set(loaded) - SPEC_KEYS)
        if unknown:
            raise ValueError(f"{args.spec}: unknown key(s) {', '.join(unknown)}")
        data = loaded
    targets = []
    for n, item in enumerate(data.get("targets") or [], start=1):
        if not isinstance(item, dict) or set(item) - TARGET_KEYS:
            raise ValueError(f"compare spec: target {n} must be a mapping of {TARGET_KEYS}")
        kinds = sum([bool(item.get("direct")), "gateway" in item, "url" in item])
        if kinds != 1:
            raise ValueError(f"compare spec: target {n} needs one of direct, gateway, url")
        targets.append(
            TargetSpec(
                str(item.get("name", f"target{n}")),
                bool(item.get("direct")),
                dict(item["gateway"] or {}) if "gateway" in item else None,
                item.get("url"),
            )
        )
    for text in args.target:
        name, urls = parse_target(text, f"target{len(targets) + 1}")
        targets.append(TargetSpec(name, url=",".join(urls)))
    if len(targets) < 1:
        raise ValueError("compare needs targets: --spec FILE and/or --target URL")
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("compare: target names must be unique")
    if getattr(args, "only", None):
        targets = _only(targets, args.only)
    engines = data.get("engines")
    if any(t.direct or t.gateway is not None for t in targets) and not engines:
        raise ValueError("compare spec: direct and gateway targets need 'engines:'")
    rates = args.rates.split(",") if args.rates else [str(r) for r in data.get("rates") or []]
    spec = Spec(
        targets,
        engines,
        [r.strip() for r in rates if r.strip()],
        args.order or str(data.get("order", "interleaved")),
        args.capacity_requests or int(data.get("capacity_requests", 200)),
        dict(data.get("gateway") or {}),
        _given(args, "capacity", str(data.get("capacity", "throughput"))),
        float(_given(args, "capacity_quantile", data.get("capacity_quantile", 0.99))),
        int(_given(args, "capacity_probes", data.get("capacity_probes", 6))),
    )
    if spec.order not in ("interleaved", "sequential", "mixed"):
        raise ValueError("compare: order is interleaved, sequential or mixed")
    _check_capacity(spec, args)
    if spec.order == "mixed" and len(spec.targets) < 2:
        raise ValueError("compare: order mixed needs at least two targets")
    for rate in spec.rates:
        _rate_value(rate, 1.0)
    return spec


def _given(args: argparse.Namespace, name: str, default: Any) -> Any:
    """The flag `name` when given, else `default` (the spec's value)."""
    value = getattr(args, name, None)
    return default if value is None else value


def _check_capacity(spec: Spec, args: argparse.Namespace) -> None:
    if spec.capacity not in CAPACITIES:
        raise ValueError(f"compare: capacity is {' or '.join(CAPACITIES)}, not {spec.capacity!r}")
    if spec.capacity_requests < 1:
        raise ValueError("compare: capacity_requests must be at least 1")
    if spec.capacity != "slo":
        return
    if not getattr(args, "slo", None):
        raise ValueError("compare: capacity slo needs --slo (the targets the direct one must meet)")
    if not 0 < spec.capacity_quantile <= 1:
        raise ValueError(f"compare: capacity_quantile {spec.capacity_quantile:g} is not in (0, 1]")
    if spec.capacity_probes < 1:
        raise ValueError("compare: capacity_probes must be at least 1")
    if not any(t.direct for t in spec.targets):
        raise ValueError("compare: capacity slo needs a 'direct: true' target")


def _only(targets: list[TargetSpec], names: str) -> list[TargetSpec]:
    """The targets named in `names` (comma-separated), in that order (a repeat of a
    comparison can run them in another order)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {t.name for t in targets}
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(
            f"--only: unknown target(s) {', '.join(unknown) or '(none given)'}; "
            f"the spec has {', '.join(sorted(known))}"
        )
    by_name = {t.name: t for t in targets}
    return [by_name[n] for n in dict.fromkeys(wanted)]


def _rate_value(text: str, capacity: float | None) -> float:
    relative = text.lower().endswith("x")
    try:
        number = float(text[:-1] if relative else text)
    except ValueError:
        raise ValueError(
            f"rate {text!r}: expected a number (req/s) or a multiple like 0.5x"
        ) from None
    if not number > 0:
        raise ValueError(f"rate {text!r} must be positive")
    if relative:
        if capacity is None:
            raise ValueError("relative rates need a direct target to measure capacity")
        return number * capacity
    return number


def run(args: argparse.Namespace) -> int:
    spec = read_spec(args)
    slo = parse_slo(args.slo)
    document = asyncio.run(_compare(args, spec, slo))
    runs = document["runs"]
    headers, rows = report.comparison_rows(runs)
    if document.get("capacity"):
        print(f"capacity (direct, rate inf): {document['capacity']['requests_per_s']:.2f} req/s")
    for line in report.slo_capacity_lines(document):
        print(line)
    report.print_table(headers, rows)
    refusal_headers, refusal_rows = report.refusal_rows(runs)
    if refusal_rows:
        print("429s by code (time from the attempt's send to the refusal):")
        report.print_table(refusal_headers, refusal_rows)
    for r in runs:
        for warning in r.get("warnings", []):
            print(f"WARNING ({r['label']}): {warning}")
    measured = [
        *([document["capacity_run"]] if "capacity_run" in document else []),
        *document.get("capacity_probes", []),
        *runs,
    ]
    code = finish(args, document, measured, single=False)
    found = document.get("slo_capacity")
    if found is not None and found["requests_per_s"] is None and code == 0:
        print(
            f"{PROG}: error: no probe met the SLOs for {found['quantile']:.1%} of its requests; "
            "the rates were not run",
            file=sys.stderr,
        )
        code = EXIT_FAILED
    if args.plots is not None and runs:
        from gateway.loadtest import plots

        for label, group in _groups(runs).items():
            for path in plots.write_run_plots(group, Path(args.plots), prefix=f"compare-{label}-"):
                print(f"wrote {path}")
    return code


def _groups(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs by rate, each group in the same target order (the same colour per target)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(str(r.get("rate_label", "run")), []).append(r)
    return {k: sorted(v, key=lambda r: str(r.get("label"))) for k, v in groups.items()}


async def _compare(args: argparse.Namespace, spec: Spec, slo: Slo) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgw-compare-"))
    fleet = None
    if spec.engines is not None:
        flags = dict(spec.engines.get("flags") or {})
        fleet = SimFleet(int(spec.engines.get("count", 1)), flags, workdir)
    builder = PromptBuilder.from_spec(args.tokenizer, args.model or "model")
    document: dict[str, Any] = {"spec": _spec_dict(spec), "runs": []}
    try:
        if fleet is not None:
            await fleet.start()
        capacity = None
        if any(r.lower().endswith("x") for r in spec.rates) or spec.capacity == "slo":
            direct = next((t for t in spec.targets if t.direct), None)
            if direct is None:
                raise ValueError("relative rates need a 'direct: true' target")
            capacity_run = await _one(
                args, spec, direct, fleet, workdir, builder, slo, math.inf, "capacity",
                requests=spec.capacity_requests,
            )  # fmt: skip
            document["capacity_run"] = capacity_run
            capacity = capacity_run["summary"]["throughput"]["requests_per_s"]
            document["capacity"] = {
                "requests_per_s": capacity,
                "output_tokens_per_s": capacity_run["summary"]["throughput"]["output_tokens_per_s"],
            }
            if capacity_run.get("interrupted") or not capacity:
                document["runs"].append(capacity_run)
                return document
            if spec.capacity == "slo":
                capacity = await _slo_capacity(
                    args, spec, direct, fleet, workdir, builder, slo, capacity, document
                )
                if capacity is None:
                    return document
        if spec.order == "mixed":
            for rate_text in spec.rates or [""]:
                rate = _rate_value(rate_text, capacity) if rate_text else None
                results = await _mixed(args, spec, fleet, workdir, builder, slo, rate, rate_text)
                document["runs"] += results
                if any(r.get("interrupted") for r in results):
                    break
            return document
        for rate_text, target in _plan(spec):
            rate = _rate_value(rate_text, capacity) if rate_text else None
            result = await _one(args, spec, target, fleet, workdir, builder, slo, rate, rate_text)
            document["runs"].append(result)
            if result.get("interrupted"):
                break
    finally:
        if fleet is not None:
            await fleet.stop()
    return document


async def _slo_capacity(
    args: argparse.Namespace,
    spec: Spec,
    direct: TargetSpec,
    fleet: SimFleet | None,
    workdir: Path,
    builder: PromptBuilder,
    slo: Slo,
    throughput: float,
    document: dict[str, Any],
) -> float | None:
    """The direct target's SLO capacity (None when no probe passed or one was interrupted);
    every probe's report goes to `document["capacity_probes"]`, the search to
    `document["slo_capacity"]`."""
    search = SloSearch(throughput, spec.capacity_quantile, spec.capacity_probes)
    probes: list[dict[str, Any]] = document.setdefault("capacity_probes", [])
    while (rate := search.next_rate()) is not None:
        probe = await _one(
            args, spec, direct, fleet, workdir, builder, slo, rate,
            f"slo-probe-{len(search.done) + 1}", requests=spec.capacity_requests,
        )  # fmt: skip
        probes.append(probe)
        if probe.get("interrupted"):
            document["runs"].append(probe)
            return None
        summary = probe["summary"]
        met = summary["slo_met"] / summary["requests"] if summary["requests"] else 0.0
        search = search.record(rate, met)
        document["slo_capacity"] = {**search.to_dict(), "slo": slo.describe()}
    return search.capacity


def _plan(spec: Spec) -> list[tuple[str, TargetSpec]]:
    rates = spec.rates or [""]
    if spec.order == "sequential":
        return [(rate, t) for t in spec.targets for rate in rates]
    plan = []
    for n, rate in enumerate(rates):
        k = n % len(spec.targets)
        plan += [(rate, t) for t in spec.targets[k:] + spec.targets[:k]]
    return plan


async def _mixed(
    args: argparse.Namespace,
    spec: Spec,
    fleet: SimFleet | None,
    workdir: Path,
    builder: PromptBuilder,
    slo: Slo,
    rate: float | None,
    rate_label: str,
) -> list[dict[str, Any]]:
    """Every target at once, one run, the requests in turn (`order: mixed`)."""
    if fleet is not None:
        await fleet.restart()
    gateways: list[ManagedGateway] = []
    try:
        resolved: list[Target] = []
        for target in spec.targets:
            resolved.append(await _resolve(args, spec, target, fleet, gateways, workdir))
        model = resolved[0].model
        assert model is not None
        max_len = min((t.max_model_len for t in resolved if t.max_model_len), default=None)
        cfg = _run_config(args, model, max_len, rate)
        labels = [_label(t.name, rate_label) for t in resolved]
        return await measure_mixed(
            resolved, cfg, builder, labels=labels, **_measuring(args, slo, rate, rate_label)
        )
    finally:
        for g in gateways:
            await g.stop()


async def _resolve(
    args: argparse.Namespace,
    spec: Spec,
    target: TargetSpec,
    fleet: SimFleet | None,
    gateways: list[ManagedGateway],
    workdir: Path,
) -> Target:
    """The target's URLs, a managed gateway started for it if it is one (kept in
    `gateways`, for the caller to stop)."""
    if target.direct:
        assert fleet is not None
        name, urls = target.name, tuple(fleet.urls)
    elif target.gateway is not None:
        assert fleet is not None
        config = ManagedGateway.config(
            fleet.gateway_engines(),
            args.model or fleet.model,
            args.tokenizer,
            merge(spec.gateway, target.gateway),
        )
        gateway = ManagedGateway(workdir)
        gateways.append(gateway)
        name, urls = target.name, (await gateway.start(config),)
    else:
        assert target.url is not None
        name, urls = parse_target(f"{target.name}={target.url}")
    return await resolve(
        name,
        urls,
        model=args.model,
        admin_key=options.admin_key(args),
        # A gateway with tenants lists its models only to one of them.
        api_key=read_secret(args.api_key_env, args.api_key_file, "API key"),
        engine_metrics=options.engine_metrics(args),
    )


def _label(name: str, rate_label: str) -> str:
    return f"{name} @ {rate_label}" if rate_label else name


def _measuring(
    args: argparse.Namespace, slo: Slo, rate: float | None, rate_label: str
) -> dict[str, Any]:
    """What `measure` and `measure_mixed` take from the command line, for one rate."""
    return {
        "slo": slo,
        "scrape_interval_s": args.scrape_interval,
        "admin_key": options.admin_key(args),
        "progress": not args.quiet,
        "timeout_s": args.timeout,
        "extra": {"rate_label": rate_label or "run", "rate": rate},
    }


def _run_config(
    args: argparse.Namespace, model: str, max_model_len: int | None, rate: float | None
) -> RunConfig:
    if rate is None:
        return options.run_config(args, model, max_model_len)
    arrivals = Rate(rate, 1.0 if math.isinf(rate) else args.burstiness)
    return options.run_config(args, model, max_model_len, arrivals=arrivals, override_load=True)


async def _one(
    args: argparse.Namespace,
    spec: Spec,
    target: TargetSpec,
    fleet: SimFleet | None,
    workdir: Path,
    builder: PromptBuilder,
    slo: Slo,
    rate: float | None,
    rate_label: str,
    *,
    requests: int | None = None,
) -> dict[str, Any]:
    if fleet is not None and (target.direct or target.gateway is not None):
        await fleet.restart()
    gateways: list[ManagedGateway] = []
    try:
        resolved = await _resolve(args, spec, target, fleet, gateways, workdir)
        assert resolved.model is not None
        cfg = _run_config(args, resolved.model, resolved.max_model_len, rate)
        if requests is not None:
            cfg = replace(cfg, max_requests=requests, duration_s=None, warmup=0)
        label = _label(target.name, rate_label)
        return await measure(
            resolved, cfg, builder, label=label, **_measuring(args, slo, rate, rate_label)
        )
    finally:
        for g in gateways:
            await g.stop()


def _spec_dict(spec: Spec) -> dict[str, Any]:
    return {
        "targets": [
            t.__dict__ if hasattr(t, "__dict__") else _target_dict(t) for t in spec.targets
        ],
        "engines": spec.engines,
        "rates": spec.rates,
        "order": spec.order,
        "capacity_requests": spec.capacity_requests,
        "gateway": spec.gateway,
        "capacity": spec.capacity,
        "capacity_quantile": spec.capacity_quantile,
        "capacity_probes": spec.capacity_probes,
    }


def _target_dict(t: TargetSpec) -> dict[str, Any]:
    return {"name": t.name, "direct": t.direct, "gateway": t.gateway, "url": t.url}
