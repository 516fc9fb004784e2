"""`kv-gateway loadtest sweep`: the tuning method's third step — change one value, rerun the
same workload, tabulate value → TTFT mean and p95, E2E p95, success rate, peak KV usage,
preemptions, goodput — and recommend: the best goodput among the values whose run succeeded
throughout, met the SLOs (≥ 95 % of requests) and saw no preemption.

A spec file (YAML):

    parameter: gpu_memory_utilization   # or kv_cache_memory_bytes, max_num_seqs,
                                        # max_model_len, max_num_batched_tokens,
                                        # admission.kv_ceiling, admission.reservation, or any
                                        # gateway config key as gateway.<a.b.c>
    values: [0.80, 0.85, 0.90, 0.95]
    planner:                            # kv-gateway plan's flags: the value becomes
      model: llama-3.1-8b               # --<parameter> when it is a planner flag, and the
      gpu: l4                           # plan's KV blocks size the simulated engine
      max-model-len: 8192
    engine:                             # the simulated engine (flags as `kv-gateway sim`)
      flags: {decode_ms_base: 8}
    # or a real engine, restarted per value by a command template ({value}, {port}):
    # command: "vllm serve /models/m --kv-cache-memory-bytes {value} --port {port}"
    # url: "http://127.0.0.1:{port}"
    # env: {VLLM_NO_USAGE_STATS: "1", VLLM_CPU_KVCACHE_SPACE: null}   # null: unset
    # startup_timeout_s: 300
    through: direct                     # or gateway (gateway: config overrides)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.loadtest import options, report
from gateway.loadtest.aggregate import Slo, parse_slo
from gateway.loadtest.measure import measure
from gateway.loadtest.outcome import finish
from gateway.loadtest.prompts import PromptBuilder
from gateway.loadtest.setups import CommandEngine, ManagedGateway, SetupError, SimFleet, set_dotted
from gateway.loadtest.targets import resolve
from gateway.planner.cli import UsageError as PlannerUsageError
from gateway.planner.cli import inputs_from_argv
from gateway.planner.plan import Plan, make_plan

SPEC_KEYS = {
    "parameter",
    "values",
    "planner",
    "engine",
    "command",
    "url",
    "env",
    "startup_timeout_s",
    "through",
    "gateway",
}
PLANNER_PARAMETERS = {
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
}
SIM_PARAMETERS = {"max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_gpu_blocks"}
SLO_SHARE = 0.95


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, required=True, help="sweep spec (YAML)")
    parser.add_argument("--values", help="override the spec's values (comma-separated)")


@dataclass
class SweepSpec:
    parameter: str
    values: list[Any]
    planner: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    command: str | None = None
    url: str = "http://127.0.0.1:{port}"
    env: dict[str, str | None] = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    through: str = "direct"
    gateway: dict[str, Any] = field(default_factory=dict)

    @property
    def gateway_key(self) -> str | None:
        if self.parameter.startswith("gateway."):
            return self.parameter.removeprefix("gateway.")
        if self.parameter.startswith("admission."):
            return self.parameter
        return None


def read_spec(path: Path, values: str | None = None) -> SweepSpec:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    unknown = sorted(set(data) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}")
    if not isinstance(data.get("parameter"), str):
        raise ValueError(f"{path}: 'parameter' is required")
    given = [v.strip() for v in values.split(",")] if values else data.get("values")
    if not isinstance(given, list) or not given:
        raise ValueError(f"{path}: 'values' must be a non-empty list")
    spec = SweepSpec(
        parameter=data["parameter"],
        values=[_number(v) for v in given],
        planner=dict(data.get("planner") or {}),
        engine=dict(data.get("engine") or {}),
        command=data.get("command"),
        url=str(data.get("url", "http://127.0.0.1:{port}")),
        env={str(k): None if v is None else str(v) for k, v in (data.get("env") or {}).items()},
        startup_timeout_s=float(data.get("startup_timeout_s", 300.0)),
        through=str(data.get("through", "direct")),
        gateway=dict(data.get("gateway") or {}),
    )
    _check(spec, path)
    return spec


def _check(spec: SweepSpec, path: Path) -> None:
    p = spec.parameter
    if spec.through not in ("direct", "gateway"):
        raise ValueError(f"{path}: through is direct or gateway")
    if spec.gateway_key is not None:
        if spec.through != "gateway":
            raise ValueError(f"{path}: {p} is a gateway setting: set through: gateway")
    elif spec.command is None:
        if p in ("gpu_memory_utilization", "kv_cache_memory_bytes") and not spec.planner:
            raise ValueError(f"{path}: {p} on simulated engines goes through 'planner:'")
        if p not in PLANNER_PARAMETERS | SIM_PARAMETERS:
            raise ValueError(f"{path}: cannot sweep {p!r} on a simulated engine")
    if spec.command is not None and "{value}" not in spec.command and spec.gateway_key is None:
        raise ValueError(f"{path}: the command template needs {{value}}")


def _number(value: Any) -> Any:
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def run(args: argparse.Namespace) -> int:
    spec = read_spec(args.spec, args.values)
    slo = parse_slo(args.slo)
    document = asyncio.run(_sweep(args, spec, slo))
    print_table(document)
    code = finish(args, document, [r for r in document["runs"] if r is not None], single=False)
    if args.plots is not None and document["rows"]:
        from gateway.loadtest import plots

        out = Path(args.plots)
        print(
            f"wrote {plots.write_sweep_plot(spec.parameter, document['rows'], out / 'sweep.png')}"
        )
        runs = [r for r in document["runs"] if r is not None]
        for path in plots.write_run_plots(runs, out, prefix="sweep-"):
            print(f"wrote {path}")
    return code


def print_table(document: dict[str, Any]) -> None:
    headers, rows = table(document)
    report.print_table(headers, rows)
    print(document["recommendation"]["text"])


def table(document: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = [
        document["parameter"],
        "blocks plan/engine",
        "TTFT mean",
        "TTFT p95",
        "E2E p95",
        "success",
        "peak KV",
        "preempt",
        "goodput",
        "SLO met",
    ]
    rows = []
    for row in document["rows"]:
        if row.get("skipped"):
            rows.append([str(row["value"]), _blocks(row), row["skipped"], *[""] * 7])
            continue
        rows.append(
            [
                str(row["value"]),
                _blocks(row),
                report.fmt(row["ttft_mean_ms"]),
                report.fmt(row["ttft_p95_ms"]),
                report.fmt(row["e2e_p95_ms"]),
                report.pct(row["success_rate"]),
                report.pct(row["peak_kv_usage"]),
                str(row["preemptions"]),
                report.fmt(row["goodput"], 2),
                report.pct(row["slo_share"]),
            ]
        )
    return headers, rows


def _blocks(row: dict[str, Any]) -> str:
    planned, reported = row.get("planned_blocks"), row.get("reported_blocks")
    return (
        f"{planned if planned is not None else '-'} / {reported if reported is not None else '-'}"
    )


async def _sweep(args: argparse.Namespace, spec: SweepSpec, slo: Slo) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgw-sweep-"))
    builder = PromptBuilder.from_spec(args.tokenizer, args.model or "model")
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any] | None] = []
    for value in spec.values:
        plan = _plan(spec, value)
        row: dict[str, Any] = {"value": value}
        if plan is not None:
            row["planned_blocks"] = plan.num_blocks
            row["plan_warnings"] = list(plan.warnings)
            if not plan.starts:
                row["skipped"] = f"vLLM would not start: {plan.problems[0].kind}"
                rows.append(row)
                runs.append(None)
                continue
        result = await _one(args, spec, value, plan, builder, slo, workdir, row)
        runs.append(result)
        rows.append(row)
        if result is not None and result.get("interrupted"):
            break
    document = {
        "parameter": spec.parameter,
        "values": spec.values,
        "slo": slo.describe(),
        "rows": rows,
        "recommendation": recommend(spec.parameter, rows),
        "runs": runs,
    }
    return document


def _plan(spec: SweepSpec, value: Any) -> Plan | None:
    if not spec.planner:
        return None
    argv: list[str] = []
    for key, given in spec.planner.items():
        flag = "--" + str(key).replace("_", "-")
        if given is True:
            argv.append(flag)
        elif given not in (None, False):
            argv += [flag, str(given)]
    if spec.parameter in PLANNER_PARAMETERS:
        argv += ["--" + spec.parameter.replace("_", "-"), str(value)]
    try:
        return make_plan(inputs_from_argv(argv))
    except (PlannerUsageError, ValueError, KeyError) as exc:
        raise ValueError(f"sweep planner: {exc.args[0] if exc.args else exc}") from None


async def _one(
    args: argparse.Namespace,
    spec: SweepSpec,
    value: Any,
    plan: Plan | None,
    builder: PromptBuilder,
    slo: Slo,
    workdir: Path,
    row: dict[str, Any],
) -> dict[str, Any] | None:
    engine_urls: list[str]
    fleet: SimFleet | None = None
    command: CommandEngine | None = None
    gateway = ManagedGateway(workdir)
    max_num_seqs = None
    try:
        if spec.command is not None:
            command = CommandEngine(
                spec.command,
                url_template=spec.url,
                env=spec.env,
                startup_timeout_s=spec.startup_timeout_s,
                workdir=workdir,
            )
            await command.start(value=value)
            engine_urls = [command.url]
        else:
            flags = dict(spec.engine.get("flags") or {})
            if plan is not None:
                flags.update(
                    num_gpu_blocks=plan.num_blocks,
                    block_size=plan.inputs.block_size,
                    max_model_len=plan.max_model_len,
                    max_num_seqs=plan.max_num_seqs,
                    max_num_batched_tokens=max(plan.max_num_batched_tokens, plan.max_model_len),
                )
            if spec.parameter in SIM_PARAMETERS:
                flags[spec.parameter] = value
            max_num_seqs = flags.get("max_num_seqs")
            fleet = SimFleet(int(spec.engine.get("count", 1)), flags, workdir)
            await fleet.start()
            engine_urls = fleet.urls
        urls = engine_urls
        if spec.through == "gateway":
            engines = (
                fleet.gateway_engines()
                if fleet is not None
                else [{"name": f"e{i}", "url": u} for i, u in enumerate(engine_urls)]
            )
            if max_num_seqs is None and spec.parameter == "max_num_seqs":
                for e in engines:
                    e["max_num_seqs"] = value
            config = ManagedGateway.config(
                engines, args.model or "tiny", args.tokenizer, spec.gateway
            )
            if spec.gateway_key is not None:
                config = set_dotted(config, spec.gateway_key, value)
            urls = [await gateway.start(config)]
        target = await resolve(
            f"{spec.parameter}={value}",
            tuple(urls),
            model=args.model,
            admin_key=options.admin_key(args),
            engine_metrics=tuple(engine_urls),
        )
        assert target.model is not None
        cfg = options.run_config(args, target.model, target.max_model_len)
        result = await measure(
            target,
            cfg,
            builder,
            slo=slo,
            label=f"{spec.parameter}={value}",
            scrape_interval_s=args.scrape_interval,
            admin_key=options.admin_key(args),
            progress=not args.quiet,
            timeout_s=args.timeout,
            extra={"sweep": {"parameter": spec.parameter, "value": value}},
        )
    except SetupError as exc:
        row["skipped"] = f"did not start: {exc}"[:120]
        return None
    finally:
        await gateway.stop()
        if fleet is not None:
            await fleet.stop()
        if command is not None:
            await command.stop()
    row.update(_row_figures(result))
    return result


def _row_figures(result: dict[str, Any]) -> dict[str, Any]:
    s = result["summary"]
    lat = s["latency_ms"]
    m = result["metrics"]["summary"]
    reported = m.get("num_gpu_blocks", {})
    finished = s["requests"] - s["outcomes"]["cancelled"]
    return {
        "ttft_mean_ms": lat["ttft"]["mean"] if lat["ttft"] else None,
        "ttft_p50_ms": lat["ttft"]["p50"] if lat["ttft"] else None,
        "ttft_p95_ms": lat["ttft"]["p95"] if lat["ttft"] else None,
        "e2e_p50_ms": lat["e2e"]["p50"] if lat["e2e"] else None,
        "e2e_p95_ms": lat["e2e"]["p95"] if lat["e2e"] else None,
        "success_rate": s["success_rate"],
        "failures": s["failures"],
        "peak_kv_usage": m.get("peak_kv_usage"),
        "preemptions": m.get("preemptions"),
        "goodput": s["throughput"]["goodput_requests_per_s"],
        "slo_share": round(s["slo_met"] / finished, 4) if finished else None,
        "reported_blocks": sum(reported.values()) if reported else None,
        "interrupted": result.get("interrupted", False),
    }


def recommend(parameter: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best goodput among the values that ran without failures, met the SLOs for at
    least SLO_SHARE of their requests, and saw no preemption (the first of equals)."""
    ran = [r for r in rows if not r.get("skipped") and not r.get("interrupted")]
    fit = [
        r
        for r in ran
        if r["success_rate"] == 1.0
        and (r["preemptions"] or 0) == 0
        and (r["slo_share"] or 0) >= SLO_SHARE
    ]
    if fit:
        best = max(fit, key=lambda r: (r["goodput"], -rows.index(r)))
        text = (
            f"recommendation: {parameter} = {best['value']} — goodput {best['goodput']:.2f} "
            f"req/s with every request answered, no preemption and the SLOs met by "
            f"{best['slo_share']:.0%} of requests"
        )
        if best.get("plan_warnings"):
            # A simulated engine cannot run out of memory: the planner's caution still holds.
            warning = best["plan_warnings"][0].split(". ")[0]
            text += f"; but the planner warns at this value: {warning}"
        return {"value": best["value"], "text": text}
    if not ran:
        return {"value": None, "text": "recommendation: none (no value ran)"}
    best = max(ran, key=lambda r: (r["goodput"], -rows.index(r)))
    text = (
        f"recommendation: none — no value ran without failures and preemptions while meeting "
        f"the SLOs; the best goodput was {parameter} = {best['value']} "
        f"({best['goodput']:.2f} req/s, {best['preemptions']} preemptions, success "
        f"{best['success_rate']:.0%})"
    )
    return {"value": None, "text": text}
