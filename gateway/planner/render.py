"""A plan as a readable table, as JSON-ready data, and as gateway `engines:` YAML."""

from __future__ import annotations

import re
from typing import Any

import yaml

from gateway.planner.overhead import GIB
from gateway.planner.plan import Plan

OVERHEAD_METHOD = (
    "ESTIMATE of what vLLM profiles at start-up. Activation peak: the larger of the sampler "
    "pass (~10 float32 buffers of max_num_seqs × vocab, fitted to published vLLM 0.11 "
    "profiles) and the forward pass (max_num_batched_tokens × (3 × intermediate / tp + "
    "4 × hidden) in the model dtype). Non-torch memory (CUDA context, NCCL, workspaces): "
    "0.15 GiB, 0.6 GiB with tensor parallelism. CUDA graphs: 0.5 GiB, 0 with "
    "--enforce-eager. Replace any term with the figure from vLLM's start-up log "
    "(--activation-gib, --non-torch-gib, --cudagraph-gib)."
)


def _gib(amount: int | float) -> float:
    return round(amount / GIB, 3)


def to_dict(plan: Plan) -> dict[str, Any]:
    """Every figure of the plan, JSON-serialisable. Sizes in GiB are per GPU."""
    inp, model = plan.inputs, plan.inputs.model
    geometry = model.geometry
    rec = plan.recommendation
    workload = inp.workload
    recommendation = None
    if rec is not None:
        recommendation = {
            "max_num_seqs": rec.max_num_seqs,
            "gateway": {
                "admission": {"kv_ceiling": rec.kv_ceiling},
                "queue": {
                    "max_length": rec.queue_max_length,
                    "max_wait_s": rec.queue_max_wait_s,
                },
            },
            "sized_for_len": rec.request_len,
            "sized_for_p95_len": rec.request_len_p95,
            "reasons": list(rec.reasons),
            "vllm_command": vllm_command(plan),
        }
    return {
        "model": {
            "name": model.name,
            "source": model.source,
            "attention": geometry.attention,
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "kv_lora_rank": geometry.kv_lora_rank,
            "qk_rope_head_dim": geometry.qk_rope_head_dim,
            "params": geometry.params,
            "max_position_embeddings": model.max_position_embeddings,
            "notes": list(plan.notes),
        },
        "inputs": {
            "gpu": inp.gpu_name,
            "gpu_memory_gib": _gib(inp.gpu_memory_bytes),
            "gpu_memory_utilization": inp.gpu_memory_utilization,
            "kv_cache_memory_bytes": inp.kv_cache_memory_bytes,
            "tensor_parallel_size": inp.tensor_parallel_size,
            "dtype": plan.dtype,
            "kv_cache_dtype": inp.kv_cache_dtype,
            "block_size": inp.block_size,
            "max_model_len": plan.max_model_len,
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "enforce_eager": inp.enforce_eager,
        },
        "memory_gib": {
            "total": _gib(inp.gpu_memory_bytes),
            "budget": _gib(plan.budget),
            "weights": _gib(plan.weights),
            "weight_bytes_per_param": plan.weight_bytes_per_param,
            "overhead": {
                "activation": _gib(plan.overhead.activation),
                "non_torch": _gib(plan.overhead.non_torch),
                "cuda_graphs": _gib(plan.overhead.cuda_graphs),
                "total": _gib(plan.overhead.total),
                "is_estimate": len(plan.overhead.measured) < 3,
                "measured": sorted(plan.overhead.measured),
                "method": OVERHEAD_METHOD,
            },
            "kv_cache": _gib(plan.kv_bytes),
            "kv_cache_source": plan.kv_source,
        },
        "kv": {
            "kv_cache_bytes": plan.kv_bytes,
            "bytes_per_token": plan.bytes_per_token,
            "block_bytes": plan.block_bytes,
            "num_gpu_blocks": plan.num_blocks,
            "kv_tokens": plan.kv_tokens,
            "max_concurrency_at_max_model_len": round(plan.concurrency_at_max_len, 2),
            "max_concurrency_at_mean_len": (
                None if plan.concurrency_at_mean is None else round(plan.concurrency_at_mean, 2)
            ),
        },
        "workload": None
        if workload is None
        else {
            "source": workload.source,
            "requests": workload.requests,
            "prompt_mean": round(workload.prompt_mean, 1),
            "prompt_p95": workload.prompt_p95,
            "output_mean": round(workload.output_mean, 1),
            "output_p95": workload.output_p95,
            "mean_len": workload.mean_len,
            "total_p95": workload.total_p95,
        },
        "startup": {
            "ok": plan.starts,
            "problems": [
                {"kind": p.kind, "message": p.message, "fix": p.fix} for p in plan.problems
            ],
        },
        "recommendation": recommendation,
        "inverse": None
        if plan.inverse is None
        else {
            "concurrency": plan.inverse.concurrency,
            "length": plan.inverse.length,
            "blocks_needed": plan.inverse.blocks_needed,
            "kv_cache_memory_bytes_needed": plan.inverse.kv_bytes_needed,
            "min_gpu_memory_utilization": plan.inverse.min_gpu_memory_utilization,
            "max_model_len_for_target": plan.inverse.max_model_len_for_target,
        },
        "warnings": list(plan.warnings),
    }


def vllm_command(plan: Plan) -> str:
    """The `vllm serve` flags this plan assumes, with the recommended max_num_seqs."""
    inp = plan.inputs
    parts = [f"vllm serve <{inp.model.name}>"]
    if inp.tensor_parallel_size > 1:
        parts.append(f"--tensor-parallel-size {inp.tensor_parallel_size}")
    if inp.kv_cache_memory_bytes is not None:
        parts.append(f"--kv-cache-memory-bytes {inp.kv_cache_memory_bytes}")
    else:
        parts.append(f"--gpu-memory-utilization {inp.gpu_memory_utilization}")
    parts.append(f"--max-model-len {plan.max_model_len}")
    seqs = inp.max_num_seqs or (plan.recommendation or plan).max_num_seqs
    parts.append(f"--max-num-seqs {seqs}")
    parts.append(f"--block-size {inp.block_size}")
    if inp.dtype:
        parts.append(f"--dtype {inp.dtype}")
    if inp.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {inp.kv_cache_dtype}")
    if inp.enforce_eager:
        parts.append("--enforce-eager")
    return " ".join(parts)


def engine_name(model_name: str) -> str:
    """A config-friendly engine name from a model name: lower case, `-` separated."""
    return re.sub(r"[^a-z0-9]+", "-", model_name.lower()).strip("-") or "engine"


def engines_yaml(plan: Plan, urls: list[str], name: str | None = None) -> str:
    """The gateway config's `engines:` entries for engines built to this plan, one per URL.

    Keys are exactly: name, url, num_gpu_blocks, block_size, max_num_seqs, max_model_len.
    """
    base = name or engine_name(plan.inputs.model.name)
    seqs = plan.inputs.max_num_seqs or (plan.recommendation or plan).max_num_seqs
    entries = [
        {
            "name": base if len(urls) == 1 else f"{base}-{i}",
            "url": url,
            "num_gpu_blocks": plan.num_blocks,
            "block_size": plan.inputs.block_size,
            "max_num_seqs": seqs,
            "max_model_len": plan.max_model_len,
        }
        for i, url in enumerate(urls)
    ]
    origin = (
        "exact for --kv-cache-memory-bytes"
        if plan.inputs.kv_cache_memory_bytes is not None
        else "estimated; replace with the engine's vllm:cache_config_info num_gpu_blocks"
    )
    header = f"# kv-gateway plan: {vllm_command(plan)}\n# num_gpu_blocks {origin}\n"
    body: str = yaml.safe_dump({"engines": entries}, sort_keys=False)
    return header + body


def table(plan: Plan) -> str:
    """The plan as aligned text for a terminal."""
    data = to_dict(plan)
    inp, mem, kv = plan.inputs, data["memory_gib"], data["kv"]
    rows: list[tuple[str, str]] = []

    def row(label: str, value: object) -> None:
        rows.append((label, str(value)))

    def gib(value: float) -> str:
        return f"{value:.2f} GiB"

    gpu = f"{inp.gpu_name} " if inp.gpu_name else ""
    row("model", f"{inp.model.name} ({data['model']['attention']} attention)")
    row("gpu", f"{gpu}{gib(mem['total'])} × {inp.tensor_parallel_size} (tensor parallel)")
    if inp.kv_cache_memory_bytes is None:
        row("budget", f"{gib(mem['budget'])} = total × {inp.gpu_memory_utilization}")
    row("weights", f"{gib(mem['weights'])} per GPU ({plan.weight_bytes_per_param:g} B/param)")
    over = mem["overhead"]
    label = "overhead (estimate)" if over["is_estimate"] else "overhead (measured)"
    row(
        label,
        f"{gib(over['total'])} = activation {gib(over['activation'])} + non-torch "
        f"{gib(over['non_torch'])} + CUDA graphs {gib(over['cuda_graphs'])}",
    )
    row("KV cache", f"{gib(mem['kv_cache'])} ({plan.kv_source})")
    row("bytes per token", f"{plan.bytes_per_token:,} ({inp.kv_cache_dtype} KV, per GPU)")
    row("blocks", f"{plan.num_blocks:,} × {inp.block_size} tokens ({plan.block_bytes:,} B each)")
    row("KV tokens", f"{plan.kv_tokens:,}")
    row(
        f"max concurrency @ {plan.max_model_len:,}",
        f"{kv['max_concurrency_at_max_model_len']:.2f}x (max_model_len)",
    )
    if plan.concurrency_at_mean is not None and inp.workload is not None:
        row(
            f"max concurrency @ {inp.workload.mean_len:,}",
            f"{kv['max_concurrency_at_mean_len']:.2f}x (workload mean)",
        )
    row("vLLM starts", "yes" if plan.starts else "NO")
    rec = plan.recommendation
    if rec is not None:
        row("recommended max_num_seqs", rec.max_num_seqs)
        row("admission.kv_ceiling", rec.kv_ceiling)
        row("queue.max_length", rec.queue_max_length)
        row("queue.max_wait_s", rec.queue_max_wait_s)
    if plan.inverse is not None:
        inv = plan.inverse
        util = inv.min_gpu_memory_utilization
        row(
            f"for {inv.concurrency} × {inv.length:,} tokens",
            f"{inv.blocks_needed:,} blocks = --kv-cache-memory-bytes {inv.kv_bytes_needed}",
        )
        row(
            "  smallest utilization",
            f"{util:.3f}" if util is not None else "none (more than the whole GPU)",
        )
        row("  largest max_model_len", f"{inv.max_model_len_for_target:,} (at this budget)")

    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}" for label, value in rows]
    for problem in plan.problems:
        lines.append(f"REFUSES TO START: {problem.message}\n  fix: {problem.fix}")
    for warning in plan.warnings:
        lines.append(f"WARNING: {warning}")
    lines.append(f"overhead: {OVERHEAD_METHOD}")
    if rec is not None:
        lines.extend(f"why: {reason}" for reason in rec.reasons)
    lines.extend(f"note: {note}" for note in plan.notes)
    lines.append(f"vLLM: {vllm_command(plan)}")
    return "\n".join(lines)
