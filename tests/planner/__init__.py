"""Tests of `kv-gateway plan`.

`TINY_CONFIG` is the HF config.json of the tiny model the real-vLLM tests build
(tools/vllm/build_tiny_model.py), whose block counts a real engine reported."""

from tools.vllm.build_tiny_model import GEOMETRY

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **GEOMETRY,
    "torch_dtype": "float32",
}
