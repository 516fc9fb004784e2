"""Presets: bytes per token match vLLM's formulas; parameter counts agree with the shapes."""

from __future__ import annotations

import pytest

from gateway.core import kvmath
from gateway.planner import presets
from gateway.planner.hfconfig import estimate_params


@pytest.mark.parametrize(
    ("name", "bf16_bytes_per_token"),
    [
        ("llama-3.1-8b", 131_072),  # 2·32·8·128·2
        ("llama-3.1-70b", 327_680),  # 2·80·8·128·2
        ("qwen2.5-7b", 57_344),  # 2·28·4·128·2
        ("qwen2.5-14b", 196_608),  # 2·48·8·128·2
        ("qwen2.5-32b", 262_144),  # 2·64·8·128·2
        ("qwen2.5-72b", 327_680),  # 2·80·8·128·2
        ("qwen3-8b", 147_456),  # 2·36·8·128·2
        ("mistral-7b", 131_072),  # 2·32·8·128·2
        ("qwen2-vl-7b", 57_344),  # 2·28·4·128·2
        ("qwen3-vl-8b", 147_456),  # 2·36·8·128·2
        ("deepseek-v3", 70_272),  # 61·576·2 (MLA)
    ],
)
def test_bytes_per_token(name: str, bf16_bytes_per_token: int) -> None:
    geometry = presets.find_model(name).geometry
    assert kvmath.bytes_per_token(geometry, 2) == bf16_bytes_per_token
    assert kvmath.bytes_per_token(geometry, 1) == bf16_bytes_per_token // 2  # fp8 halves it


@pytest.mark.parametrize(
    ("name", "tp", "expected"),
    [
        ("llama-3.1-70b", 4, 81_920),
        ("llama-3.1-70b", 8, 40_960),
        ("qwen2.5-7b", 2, 28_672),
        ("qwen2.5-7b", 8, 14_336),  # 4 KV heads on 8 GPUs: one (replicated) per GPU
        ("deepseek-v3", 8, 70_272),  # MLA is not split
    ],
)
def test_tensor_parallel_division(name: str, tp: int, expected: int) -> None:
    assert kvmath.bytes_per_token(presets.find_model(name).geometry, 2, tp) == expected


TEXT_ONLY_DENSE = {
    "llama-3.1-8b": {"tie": False},
    "llama-3.1-70b": {"tie": False},
    "qwen2.5-7b": {"tie": False},
    "qwen2.5-14b": {"tie": False},
    "qwen2.5-32b": {"tie": False},
    "qwen2.5-72b": {"tie": False},
    "qwen3-8b": {"tie": False},
    "mistral-7b": {"tie": False},
}


@pytest.mark.parametrize("name", sorted(TEXT_ONLY_DENSE))
def test_published_params_agree_with_the_shapes(name: str) -> None:
    spec = presets.find_model(name)
    heads = spec.hidden_size // spec.geometry.head_dim
    if name == "qwen3-8b":
        heads = 32  # Qwen3 sets head_dim explicitly; hidden 4096 = 32 × 128 anyway
    estimate = estimate_params(
        {
            "hidden_size": spec.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": spec.geometry.num_kv_heads,
            "head_dim": spec.geometry.head_dim,
            "num_hidden_layers": spec.geometry.num_layers,
            "intermediate_size": spec.intermediate_size,
            "vocab_size": spec.vocab_size,
            "tie_word_embeddings": TEXT_ONLY_DENSE[name]["tie"],
        }
    )
    assert estimate == pytest.approx(spec.geometry.params, rel=0.02)


def test_every_preset_cites_its_config() -> None:
    for spec in presets.MODELS.values():
        assert spec.source.startswith("https://huggingface.co/")
        assert spec.source.endswith("/config.json")


@pytest.mark.parametrize(
    ("name", "key"),
    [("RTX 3060", "rtx3060"), ("4090", "rtx4090"), ("A100", "a100-80g"), ("h200", "h200")],
)
def test_gpu_lookup(name: str, key: str) -> None:
    assert presets.find_gpu(name) is presets.GPUS[key]


def test_every_required_gpu_is_known() -> None:
    for name in ["rtx3060", "rtx3090", "rtx4090", "a10", "l4", "l40s"]:
        assert not presets.GPUS[name].large
    for name in ["a100-40g", "a100-80g"]:
        assert not presets.GPUS[name].large  # vLLM keeps A100s on the small defaults
    assert presets.GPUS["h100"].large and presets.GPUS["h200"].large


def test_unknown_names() -> None:
    with pytest.raises(KeyError):
        presets.find_model("gpt-5")
    with pytest.raises(KeyError):
        presets.find_gpu("tpu")
