"""The non-KV memory vLLM holds besides the weights — an ESTIMATE, not a measurement.

vLLM sizes the KV cache as `total × gpu_memory_utilization − (weights + activation peak +
non-torch memory) − CUDA-graph estimate`, where the last three are *profiled* at start-up
(a dummy forward pass of `max_num_batched_tokens` tokens, then a dummy sampler pass over
`max_num_seqs` rows of logits). The planner cannot run that profile, so it estimates each
term; every term can be overridden with a measured figure from vLLM's start-up log.

- Activation peak = the larger of
  - the sampler pass: about 10 float32 buffers of `max_num_seqs × vocab` (logits, their
    sorted copy and indices for top-k/top-p, probabilities...). The factor 10 is fitted to
    published H100 profiles with vLLM 0.11 at max_num_seqs 1024 — Llama-3.1-8B 4.76 GiB,
    Qwen3-0.6B 5.56 GiB, Qwen3-32B 5.64 GiB, gpt-oss-20b 7.38 GiB (ratios 9.6–9.7) — and
    rounded up;
  - the forward pass: `max_num_batched_tokens × (3 × intermediate / tp + 4 × hidden)`
    activations (the MLP's gate/up output and activation, plus residual, norm, attention
    buffers) in the model dtype.
  Multimodal models profile their encoder separately; this is not modelled.
- Non-torch memory (CUDA context, NCCL, cuBLAS workspaces): 0.15 GiB on one GPU, 0.6 GiB per
  GPU with tensor parallelism (profiles show 0.07–0.14 GiB and 0.54–0.55 GiB at TP 2).
- CUDA graphs: 0.5 GiB unless `--enforce-eager` (vLLM ≥ 0.21 estimates graph memory before
  sizing KV; reported figures range 0.36–1.03 GiB). Older vLLM captured graphs after
  sizing KV, out of the (1 − utilization) margin instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.planner.presets import ModelSpec

GIB = 1024**3
SAMPLER_FP32_COPIES = 10
NON_TORCH_SINGLE_GPU = int(0.15 * GIB)
NON_TORCH_TENSOR_PARALLEL = int(0.6 * GIB)
CUDA_GRAPHS = int(0.5 * GIB)


@dataclass(frozen=True, slots=True)
class Overhead:
    """Per-GPU bytes vLLM holds apart from weights and KV cache; `measured` names the terms
    given by the user instead of estimated."""

    activation: int
    non_torch: int
    cuda_graphs: int
    measured: frozenset[str] = frozenset()

    @property
    def total(self) -> int:
        return self.activation + self.non_torch + self.cuda_graphs


def estimate_activation(
    model: ModelSpec,
    *,
    tp: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    act_dtype_bytes: int,
) -> int:
    """The profiled activation peak, estimated (see the module docstring)."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    sampler = SAMPLER_FP32_COPIES * rows * model.vocab_size * 4
    per_token = 3 * model.intermediate_size // tp + 4 * model.hidden_size
    forward = max_num_batched_tokens * per_token * act_dtype_bytes
    return max(sampler, forward)


def estimate_overhead(
    model: ModelSpec,
    *,
    tp: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    act_dtype_bytes: int,
    enforce_eager: bool,
    activation: int | None = None,
    non_torch: int | None = None,
    cuda_graphs: int | None = None,
) -> Overhead:
    """The non-KV overhead per GPU; any term passed in (measured) replaces its estimate."""
    measured = frozenset(
        name
        for name, value in (
            ("activation", activation),
            ("non_torch", non_torch),
            ("cuda_graphs", cuda_graphs),
        )
        if value is not None
    )
    if activation is None:
        activation = estimate_activation(
            model,
            tp=tp,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            act_dtype_bytes=act_dtype_bytes,
        )
    if non_torch is None:
        non_torch = NON_TORCH_SINGLE_GPU if tp == 1 else NON_TORCH_TENSOR_PARALLEL
    if cuda_graphs is None:
        cuda_graphs = 0 if enforce_eager else CUDA_GRAPHS
    return Overhead(activation, non_torch, cuda_graphs, measured)
