"""A Hugging Face `config.json` → the planner's `ModelSpec`.

Reads what vLLM reads for KV sizing: `num_hidden_layers`, `num_key_value_heads` (default:
`num_attention_heads`), `head_dim` (default: `hidden_size // num_attention_heads`), and for
MLA models (DeepSeek V2/V3, `kv_lora_rank` set) the latent width
`kv_lora_rank + qk_rope_head_dim`. Vision-language configs keep the language model under
`text_config`; its fields win over the top level. The parameter count is estimated from the
shapes (dense, MoE and MLA layers) unless overridden: it ignores vision towers, so pass
`--params-b` for an exact count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.core.kvmath import ModelGeometry
from gateway.planner.presets import ModelSpec


class ConfigError(ValueError):
    """The file is not a usable model config; the message says what is missing."""


def load_config(path: Path) -> ModelSpec:
    """Read `path` (a config.json, or a model directory holding one) into a ModelSpec."""
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return spec_from_config(raw, name=path.parent.name or path.stem)


def spec_from_config(raw: dict[str, Any], *, name: str) -> ModelSpec:
    """Build a ModelSpec from a parsed config (see the module docstring for the rules)."""
    text = dict(raw)
    nested = raw.get("text_config") or raw.get("language_config") or raw.get("llm_config")
    if isinstance(nested, dict):
        text.update(nested)

    layers = _int(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    heads = _int(text, "num_attention_heads", "n_head")
    kv_heads = _opt_int(text, "num_key_value_heads", "n_kv_heads") or heads
    head_dim = _opt_int(text, "head_dim") or hidden // heads
    vocab = _opt_int(text, "vocab_size") or 32000
    intermediate = _opt_int(text, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
    max_pos = (
        _opt_int(text, "max_position_embeddings", "max_sequence_length", "seq_length")
        or _opt_int(raw, "max_position_embeddings")
        or 2048
    )
    dtype = str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or "")
    dtype = dtype or "bfloat16"
    if dtype == "float32":
        # vLLM's `--dtype auto` serves float32 checkpoints in float16 on GPUs.
        dtype = "float16"

    kv_lora_rank = _opt_int(text, "kv_lora_rank")
    notes: list[str] = []
    if kv_lora_rank:
        rope = _opt_int(text, "qk_rope_head_dim") or 0
        geometry = ModelGeometry(
            num_layers=layers,
            attention="mla",
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            params=estimate_params(text),
        )
        notes.append(f"MLA: {kv_lora_rank + rope}-wide latent per token and layer, not split by TP")
    else:
        geometry = ModelGeometry(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            params=estimate_params(text),
        )
    if text.get("sliding_window") and text.get("use_sliding_window", True):
        notes.append("sliding-window attention treated as full attention (an upper bound)")
    if any(key in text for key in ("layer_types", "mamba_d_state", "ssm_cfg", "linear_attn")):
        notes.append("hybrid layers treated as full attention (an upper bound)")
    if isinstance(nested, dict) or "vision_config" in raw:
        notes.append("parameter estimate covers the language model only; pass --params-b")
    notes.append("parameter count estimated from the config's shapes")

    return ModelSpec(
        name=name,
        geometry=geometry,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        dtype=dtype,
        weight_bytes_per_param=_quantized_bytes(raw.get("quantization_config")),
        source="config.json",
        notes=tuple(notes),
    )


def estimate_params(cfg: dict[str, Any]) -> int:
    """Parameters of the language model from its shapes: embeddings, attention, MLP/MoE.

    Norms and biases are left out (well under 0.1 %). Reproduces the published counts of
    dense Llama/Qwen/Mistral models and of DeepSeek-V3 (671B) to within about 1 %.
    """
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "num_attention_heads", "n_head")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _opt_int(cfg, "vocab_size") or 32000
    kv_heads = _opt_int(cfg, "num_key_value_heads") or heads
    head_dim = _opt_int(cfg, "head_dim") or hidden // heads
    intermediate = _opt_int(cfg, "intermediate_size") or 4 * hidden

    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)

    kv_lora_rank = _opt_int(cfg, "kv_lora_rank")
    if kv_lora_rank:
        rope = _opt_int(cfg, "qk_rope_head_dim") or 0
        nope = _opt_int(cfg, "qk_nope_head_dim") or head_dim
        v_dim = _opt_int(cfg, "v_head_dim") or head_dim
        q_lora = _opt_int(cfg, "q_lora_rank")
        q_out = heads * (nope + rope)
        q = hidden * q_lora + q_lora * q_out if q_lora else hidden * q_out
        attention = (
            q
            + hidden * (kv_lora_rank + rope)
            + kv_lora_rank * heads * (nope + v_dim)
            + heads * v_dim * hidden
        )
    else:
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim

    dense_mlp = 3 * hidden * intermediate
    experts = _opt_int(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    if experts:
        moe_inter = _opt_int(cfg, "moe_intermediate_size") or intermediate
        shared = _opt_int(cfg, "n_shared_experts") or 0
        shared_inter = _opt_int(cfg, "shared_expert_intermediate_size") or 0
        moe_mlp = (
            (experts + shared) * 3 * hidden * moe_inter
            + 3 * hidden * shared_inter
            + hidden * experts  # the router
        )
        dense_layers = min(layers, _opt_int(cfg, "first_k_dense_replace") or 0)
        mlp = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp = layers * dense_mlp
    return embeddings + layers * attention + mlp


def _quantized_bytes(quant: object) -> float | None:
    """Bytes per parameter of a quantized checkpoint, or None when it is not quantized."""
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower()
    bits = quant.get("bits") or quant.get("w_bit") or quant.get("weight_bits")
    if isinstance(bits, int) and bits > 0:
        return bits / 8
    if "fp8" in method or "fbgemm" in method:
        return 1.0
    if method in {"awq", "gptq", "marlin", "bitsandbytes"}:
        return 0.5
    return None


def _int(cfg: dict[str, Any], *keys: str) -> int:
    value = _opt_int(cfg, *keys)
    if not value:
        raise ConfigError(f"config has no positive {keys[0]!r}")
    return value


def _opt_int(cfg: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config field {key!r} must be a whole number, got {value!r}")
        return value
    return None
