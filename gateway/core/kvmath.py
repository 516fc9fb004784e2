"""vLLM's KV-cache arithmetic: model geometry → bytes per token → blocks → concurrency.

Pure and exact: integers in, integers out (concurrency is the one float, as vLLM logs it).
The formulas are vLLM's (v1 engine), so a block count computed here for a KV byte budget is
the `num_gpu_blocks` a real engine reports for `--kv-cache-memory-bytes` of that size:

- standard attention, per GPU: `2 × layers × max(1, kv_heads // tp) × head_dim × dtype_bytes`
  (K and V; with tensor parallelism each GPU holds its share of the KV heads, at least one);
- MLA (DeepSeek V2/V3): `layers × (kv_lora_rank + qk_rope_head_dim) × dtype_bytes` — one
  latent vector per token and layer, no factor 2, the same on every GPU (not split by TP);
- `num_blocks = available_bytes // (block_size × bytes_per_token)`;
- a request of `tokens` tokens holds `ceil(tokens / block_size)` blocks, so the maximum
  concurrency at a length is `num_blocks / ceil(length / block_size)`.

Sliding-window and hybrid (Mamba) layers are treated as full attention: an upper bound.
The planner and the gateway share this module; it does no I/O and reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["standard", "mla"]

# Bytes per element of the dtypes vLLM accepts for `--dtype` and `--kv-cache-dtype`.
_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a model or KV dtype name (`bfloat16`, `fp16`, `fp8_e4m3`, ...).

    Raises ValueError for a name vLLM would not accept as a dense dtype.
    """
    try:
        return _DTYPE_BYTES[dtype.strip().lower()]
    except KeyError:
        known = ", ".join(sorted(_DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r} (known: {known})") from None


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element: `auto` means the model's dtype, every `fp8*` variant is 1 byte."""
    if kv_cache_dtype.strip().lower() == "auto":
        return dtype_bytes(model_dtype)
    return dtype_bytes(kv_cache_dtype)


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` for a non-negative `a` and positive `b`, without floats."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What the KV cache and the weights of a decoder model depend on.

    MUST hold: `num_layers ≥ 1`; for `standard` attention `num_kv_heads ≥ 1` and
    `head_dim ≥ 1`; for `mla`, `kv_lora_rank + qk_rope_head_dim ≥ 1`. The size of the
    weights is given as `params` (a count; bytes follow from the dtype) or as `weight_bytes`
    (total bytes, for quantized checkpoints); `weight_bytes` wins when both are set.
    """

    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    attention: AttentionKind = "standard"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    params: int = 0
    weight_bytes: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers must be at least 1")
        if self.attention == "standard":
            if self.num_kv_heads < 1 or self.head_dim < 1:
                raise ValueError("standard attention needs num_kv_heads ≥ 1 and head_dim ≥ 1")
        elif self.attention == "mla":
            if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
                raise ValueError("kv_lora_rank and qk_rope_head_dim must not be negative")
            if self.kv_lora_rank + self.qk_rope_head_dim < 1:
                raise ValueError("MLA needs kv_lora_rank + qk_rope_head_dim ≥ 1")
        else:
            raise ValueError(f"unknown attention kind {self.attention!r}")
        if self.params < 0 or self.weight_bytes < 0:
            raise ValueError("params and weight_bytes must not be negative")


def kv_heads_per_gpu(geometry: ModelGeometry, tp: int = 1) -> int:
    """KV heads one GPU holds under tensor parallelism `tp`: `max(1, kv_heads // tp)`.

    With fewer KV heads than GPUs vLLM replicates heads, so each GPU still holds one.
    """
    _check_tp(tp)
    return max(1, geometry.num_kv_heads // tp)


def bytes_per_token(geometry: ModelGeometry, kv_dtype_bytes: int, tp: int = 1) -> int:
    """KV bytes one token takes on one GPU, all layers together (vLLM's formula, see module)."""
    _check_tp(tp)
    if kv_dtype_bytes < 1:
        raise ValueError("kv_dtype_bytes must be at least 1")
    if geometry.attention == "mla":
        latent = geometry.kv_lora_rank + geometry.qk_rope_head_dim
        return geometry.num_layers * latent * kv_dtype_bytes
    heads = kv_heads_per_gpu(geometry, tp)
    return 2 * geometry.num_layers * heads * geometry.head_dim * kv_dtype_bytes


def block_bytes(bytes_per_token: int, block_size: int) -> int:
    """Bytes of one KV block on one GPU (all layers): `block_size × bytes_per_token`."""
    _check_positive(bytes_per_token=bytes_per_token, block_size=block_size)
    return block_size * bytes_per_token


def num_blocks(available_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Blocks vLLM carves out of `available_bytes` of KV memory; 0 when nothing is available.

    `available_bytes // (block_size × bytes_per_token)` — exactly what a real engine reports
    as `num_gpu_blocks` for `--kv-cache-memory-bytes available_bytes`.
    """
    if available_bytes <= 0:
        return 0
    return available_bytes // block_bytes(bytes_per_token, block_size)


def kv_tokens(blocks: int, block_size: int) -> int:
    """Tokens the cache holds: `blocks × block_size` (vLLM's "GPU KV cache size")."""
    _check_positive(block_size=block_size)
    return max(0, blocks) * block_size


def blocks_per_request(tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` tokens holds: `ceil(tokens / block_size)`."""
    _check_positive(block_size=block_size)
    if tokens < 0:
        raise ValueError("tokens must not be negative")
    return ceil_div(tokens, block_size)


def max_concurrency(blocks: int, tokens: int, block_size: int) -> float:
    """Requests of `tokens` tokens that fit at once: `blocks / ceil(tokens / block_size)`.

    vLLM's "Maximum concurrency for N tokens per request" figure; a float, as vLLM logs it.
    `tokens` must be at least 1.
    """
    if tokens < 1:
        raise ValueError("tokens must be at least 1")
    return max(0, blocks) / blocks_per_request(tokens, block_size)


# --- the inverse questions -------------------------------------------------------------------


def blocks_for_concurrency(concurrency: int, tokens: int, block_size: int) -> int:
    """Smallest block count that holds `concurrency` requests of `tokens` tokens at once."""
    if concurrency < 0:
        raise ValueError("concurrency must not be negative")
    return concurrency * blocks_per_request(tokens, block_size)


def bytes_for_blocks(blocks: int, bytes_per_token: int, block_size: int) -> int:
    """Smallest KV byte budget that yields `blocks` blocks (the inverse of `num_blocks`)."""
    if blocks < 0:
        raise ValueError("blocks must not be negative")
    return blocks * block_bytes(bytes_per_token, block_size)


def max_len_for_concurrency(blocks: int, concurrency: int, block_size: int) -> int:
    """Longest request length (a multiple of `block_size`) of which `concurrency` fit at once.

    0 when not even one block per request is available.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    _check_positive(block_size=block_size)
    return (max(0, blocks) // concurrency) * block_size


def weight_bytes_per_gpu(geometry: ModelGeometry, weight_dtype_bytes: float, tp: int = 1) -> int:
    """Bytes of weights one GPU loads: total weights split evenly over `tp` GPUs (rounded up).

    Total weights are `geometry.weight_bytes` when set, else `params × weight_dtype_bytes`
    (`weight_dtype_bytes` may be fractional, e.g. 0.5 for 4-bit). Replicated tensors (norms,
    small biases) are ignored: they are a rounding error next to the matrices.
    """
    _check_tp(tp)
    if weight_dtype_bytes <= 0:
        raise ValueError("weight_dtype_bytes must be positive")
    total = geometry.weight_bytes or round(geometry.params * weight_dtype_bytes)
    return ceil_div(total, tp)


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError("tensor-parallel size must be at least 1")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1")
