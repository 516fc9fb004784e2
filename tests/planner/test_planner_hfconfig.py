"""Reading HF config.json files: plain, vision-language (text_config) and MLA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.core import kvmath
from gateway.planner.hfconfig import ConfigError, load_config, spec_from_config
from tests.planner import TINY_CONFIG

# The real-vLLM issue's tiny model (REAL-VLLM.md).

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
}

QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "vision_config": {"depth": 27, "hidden_size": 1152},
    "text_config": {
        "model_type": "qwen3_vl_text",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
    },
}


def test_tiny_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    spec = load_config(tmp_path)
    assert kvmath.bytes_per_token(spec.geometry, 4) == 1024
    assert spec.max_position_embeddings == 512


def test_mla_config() -> None:
    spec = spec_from_config(DEEPSEEK_V3, name="dsv3")
    assert spec.geometry.attention == "mla"
    assert kvmath.bytes_per_token(spec.geometry, 2, tp=8) == 70_272
    assert spec.weight_bytes_per_param == 1.0
    # 671B parameters in the main model (DeepSeek's README_WEIGHTS.md).
    assert spec.geometry.params == pytest.approx(671e9, rel=0.01)


def test_vision_language_config_reads_text_config() -> None:
    spec = spec_from_config(QWEN3_VL_8B, name="qwen3-vl")
    assert spec.geometry.num_layers == 36
    assert kvmath.bytes_per_token(spec.geometry, 2) == 147_456
    assert spec.max_position_embeddings == 262144
    assert any("--params-b" in note for note in spec.notes)


def test_defaults_for_missing_fields() -> None:
    raw = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4}
    spec = spec_from_config(raw, name="mha")
    assert spec.geometry.num_kv_heads == 4  # MHA: KV heads = attention heads
    assert spec.geometry.head_dim == 64


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"hidden_size": 8, "num_attention_heads": 2}), "num_hidden_layers"),
        (json.dumps({**TINY_CONFIG, "num_key_value_heads": "two"}), "whole number"),
    ],
)
def test_bad_configs(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.json")
