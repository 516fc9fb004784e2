"""`kv-gateway plan`: GPU memory and `--gpu-memory-utilization` → KV blocks, concurrency and
gateway limits. Bad input is a one-line error and exit code 2; `--emit-config` for an engine
vLLM would refuse to start exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.planner import hfconfig, presets, render
from gateway.planner.overhead import GIB
from gateway.planner.plan import PlanInputs, make_plan
from gateway.planner.presets import ModelSpec
from gateway.planner.workload import Workload, WorkloadError, from_figures, from_requests
from gateway.traces import TraceError, read_trace


class UsageError(ValueError):
    """Input the planner cannot use; printed as one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help=f"a preset ({', '.join(presets.MODELS)}) or a path to a HF config.json/model dir",
    )
    model.add_argument("--list-presets", action="store_true", help="list presets and exit")
    model.add_argument("--dtype", help="model dtype (default: the checkpoint's, like vLLM)")
    model.add_argument("--kv-cache-dtype", default="auto", help="auto (model dtype) or fp8")
    model.add_argument("--params-b", type=float, help="parameter count in billions (override)")
    model.add_argument("--weights-gib", type=float, help="weights per GPU in GiB (override)")

    gpu = parser.add_argument_group("GPU and vLLM")
    gpu.add_argument("--gpu", help=f"a GPU preset ({', '.join(presets.GPUS)})")
    gpu.add_argument("--gpu-memory-gib", type=float, help="total GPU memory in GiB")
    gpu.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    gpu.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="KV cache size in bytes; overrides the utilization computation, as in vLLM",
    )
    gpu.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    gpu.add_argument("--max-model-len", type=int, help="default: the model's context length")
    gpu.add_argument("--block-size", type=int, default=16)
    gpu.add_argument("--max-num-seqs", type=int, help="default: vLLM's for the GPU")
    gpu.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's for the GPU")
    gpu.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    gpu.add_argument("--activation-gib", type=float, help="measured activation peak")
    gpu.add_argument("--non-torch-gib", type=float, help="measured non-torch memory")
    gpu.add_argument("--cudagraph-gib", type=float, help="measured CUDA graph memory")

    load = parser.add_argument_group("workload")
    load.add_argument("--prompt-mean", type=float, help="mean prompt tokens")
    load.add_argument("--prompt-p95", type=int, help="95th percentile prompt tokens")
    load.add_argument("--output-mean", type=float, help="mean output tokens")
    load.add_argument("--output-p95", type=int, help="95th percentile output tokens")
    load.add_argument(
        "--trace",
        type=Path,
        help="a trace: JSONL (prompt_tokens/output_tokens, or Mooncake's input_length/"
        "output_length) or CSV timestamp,input_tokens,output_tokens[,tenant]",
    )
    load.add_argument(
        "--decode-tps", type=float, default=30.0, help="generated tokens/s per sequence"
    )

    inverse = parser.add_argument_group("inverse question")
    inverse.add_argument("--target-concurrency", type=int, help="N concurrent requests ...")
    inverse.add_argument("--target-len", type=int, help="... of L tokens (default max_model_len)")

    out = parser.add_argument_group("output")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the plan as JSON")
    fmt.add_argument("--emit-config", action="store_true", help="print gateway engines: YAML")
    out.add_argument("--url", action="append", help="engine URL for --emit-config (repeatable)")
    out.add_argument("--name", help="engine name for --emit-config")


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print(_presets_listing())
        return 0
    try:
        inputs = _inputs(args)
        plan = make_plan(inputs)
    except (UsageError, ValueError, KeyError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        print(f"kv-gateway plan: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(render.to_dict(plan), indent=2))
    elif args.emit_config:
        if not plan.starts:
            reason = plan.problems[0]
            print(
                f"kv-gateway plan: error: vLLM would not start ({reason.message}); "
                f"fix: {reason.fix}",
                file=sys.stderr,
            )
            return 1
        print(render.engines_yaml(plan, args.url or ["http://127.0.0.1:8001"], args.name), end="")
    else:
        print(render.table(plan))
    return 0


def inputs_from_argv(argv: list[str]) -> PlanInputs:
    """The plan inputs of `kv-gateway plan` flags (for `kv-gateway loadtest sweep`); raises
    UsageError or ValueError with a one-line reason."""
    parser = argparse.ArgumentParser(prog="kv-gateway plan", add_help=False, exit_on_error=False)
    add_arguments(parser)
    try:
        args, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise UsageError(str(exc)) from None
    if rest:
        raise UsageError(f"unknown planner option(s): {' '.join(rest)}")
    inputs = _inputs(args)
    inputs.validate()
    return inputs


def _inputs(args: argparse.Namespace) -> PlanInputs:
    model = _model(args)
    memory, gpu_name, large = _gpu(args)
    return PlanInputs(
        model=model,
        gpu_memory_bytes=memory,
        gpu_name=gpu_name,
        large_gpu=large,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enforce_eager=args.enforce_eager,
        weights_bytes=_bytes(args.weights_gib, "--weights-gib"),
        activation_bytes=_bytes(args.activation_gib, "--activation-gib"),
        non_torch_bytes=_bytes(args.non_torch_gib, "--non-torch-gib"),
        cuda_graph_bytes=_bytes(args.cudagraph_gib, "--cudagraph-gib"),
        workload=_workload(args),
        target_concurrency=args.target_concurrency,
        target_len=args.target_len,
        decode_tokens_per_s=args.decode_tps,
    )


def _model(args: argparse.Namespace) -> ModelSpec:
    if not args.model:
        raise UsageError("--model is required (a preset name or a config.json path)")
    candidate = Path(args.model)
    if candidate.exists():
        try:
            spec = hfconfig.load_config(candidate)
        except hfconfig.ConfigError as exc:
            raise UsageError(str(exc)) from None
    elif args.model.endswith(".json") or "/" in args.model:
        raise UsageError(f"no such file: {args.model}")
    else:
        spec = presets.find_model(args.model)
    if args.params_b is not None:
        if args.params_b <= 0:
            raise UsageError("--params-b must be positive")
        geometry = spec.geometry
        spec = _replace_params(spec, int(args.params_b * 1e9), geometry.weight_bytes)
    return spec


def _replace_params(spec: ModelSpec, params: int, weight_bytes: int) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, geometry=replace(spec.geometry, params=params, weight_bytes=weight_bytes))


def _gpu(args: argparse.Namespace) -> tuple[int, str | None, bool]:
    if args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            raise UsageError("--gpu-memory-gib must be positive")
        name = presets.find_gpu(args.gpu).name if args.gpu else None
        large = args.gpu_memory_gib >= 70 and not (name or "").startswith("A100")
        return int(args.gpu_memory_gib * GIB), name, large
    if args.gpu:
        gpu = presets.find_gpu(args.gpu)
        return int(gpu.memory_gib * GIB), gpu.name, gpu.large
    if args.kv_cache_memory_bytes is not None:
        # With an explicit KV size the GPU only matters for the start-up checks.
        raise UsageError("give --gpu or --gpu-memory-gib (needed for the weights check)")
    raise UsageError("give --gpu (a preset) or --gpu-memory-gib")


def _workload(args: argparse.Namespace) -> Workload | None:
    figures = (args.prompt_mean, args.output_mean, args.prompt_p95, args.output_p95)
    try:
        if args.trace is not None:
            if any(value is not None for value in figures):
                raise UsageError("give either --trace or the --prompt-/--output- figures")
            try:
                trace = read_trace(args.trace)
            except TraceError as exc:
                raise UsageError(str(exc)) from None
            return from_requests(trace.requests, source=str(args.trace))
        if args.prompt_mean is None and args.output_mean is None:
            if args.prompt_p95 is not None or args.output_p95 is not None:
                raise UsageError("p95 figures need --prompt-mean and --output-mean")
            return None
        if args.prompt_mean is None or args.output_mean is None:
            raise UsageError("give both --prompt-mean and --output-mean")
        return from_figures(args.prompt_mean, args.output_mean, args.prompt_p95, args.output_p95)
    except WorkloadError as exc:
        raise UsageError(str(exc)) from None


def _bytes(gib: float | None, flag: str) -> int | None:
    if gib is None:
        return None
    if gib < 0:
        raise UsageError(f"{flag} must not be negative")
    return int(gib * GIB)


def _presets_listing() -> str:
    lines = ["models:"]
    for key, spec in presets.MODELS.items():
        g = spec.geometry
        shape = (
            f"MLA {g.kv_lora_rank}+{g.qk_rope_head_dim}"
            if g.attention == "mla"
            else f"{g.num_kv_heads} KV heads × {g.head_dim}"
        )
        lines.append(
            f"  {key:<14} {spec.name:<16} {g.num_layers} layers, {shape}, "
            f"{g.params / 1e9:g}B params, context {spec.max_position_embeddings:,}"
        )
    lines.append("gpus:")
    for key, gpu in presets.GPUS.items():
        lines.append(f"  {key:<14} {gpu.name:<16} {gpu.memory_gib:.2f} GiB ({gpu.source})")
    return "\n".join(lines)
