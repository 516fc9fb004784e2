"""Built-in models and GPUs the planner knows by name.

Every model number comes from the model's published Hugging Face `config.json` (the URL is
in the comment above each entry) and the parameter count from its model card. KV size only
needs layers, KV heads and head_dim (or the MLA latent); hidden size, intermediate size and
vocabulary feed the activation estimate; the parameter count gives the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.kvmath import ModelGeometry


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as the planner needs it.

    `dtype` is the checkpoint's `torch_dtype` (vLLM's `--dtype auto`). `weight_bytes_per_param`
    is set for checkpoints stored quantized (DeepSeek-V3 ships FP8 weights); None means the
    weights take the model dtype's size.
    """

    name: str
    geometry: ModelGeometry
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    weight_bytes_per_param: float | None = None
    source: str = ""
    notes: tuple[str, ...] = ()


def _standard(layers: int, kv_heads: int, head_dim: int, params: float) -> ModelGeometry:
    return ModelGeometry(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, params=int(params)
    )


MODELS: dict[str, ModelSpec] = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
    # 32 layers, 32 heads / 8 KV heads, hidden 4096 (head_dim 128), intermediate 14336,
    # vocab 128256, max_position_embeddings 131072, bfloat16; 8.03B parameters (model card).
    "llama-3.1-8b": ModelSpec(
        name="Llama-3.1-8B",
        geometry=_standard(32, 8, 128, 8.03e9),
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json
    # 80 layers, 64 heads / 8 KV heads, hidden 8192 (head_dim 128), intermediate 28672,
    # vocab 128256, max_position_embeddings 131072, bfloat16; 70.6B parameters (model card).
    "llama-3.1-70b": ModelSpec(
        name="Llama-3.1-70B",
        geometry=_standard(80, 8, 128, 70.6e9),
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
    # 28 layers, 28 heads / 4 KV heads, hidden 3584 (head_dim 128), intermediate 18944,
    # vocab 152064, max_position_embeddings 32768, bfloat16; 7.61B parameters (model card).
    "qwen2.5-7b": ModelSpec(
        name="Qwen2.5-7B",
        geometry=_standard(28, 4, 128, 7.61e9),
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2.5-14B-Instruct/blob/main/config.json
    # 48 layers, 40 heads / 8 KV heads, hidden 5120 (head_dim 128), intermediate 13824,
    # vocab 152064, max_position_embeddings 32768, bfloat16; 14.7B parameters (model card).
    "qwen2.5-14b": ModelSpec(
        name="Qwen2.5-14B",
        geometry=_standard(48, 8, 128, 14.7e9),
        hidden_size=5120,
        intermediate_size=13824,
        vocab_size=152064,
        max_position_embeddings=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-14B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2.5-32B-Instruct/blob/main/config.json
    # 64 layers, 40 heads / 8 KV heads, hidden 5120 (head_dim 128), intermediate 27648,
    # vocab 152064, max_position_embeddings 32768, bfloat16; 32.5B parameters (model card).
    "qwen2.5-32b": ModelSpec(
        name="Qwen2.5-32B",
        geometry=_standard(64, 8, 128, 32.5e9),
        hidden_size=5120,
        intermediate_size=27648,
        vocab_size=152064,
        max_position_embeddings=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-32B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json
    # 80 layers, 64 heads / 8 KV heads, hidden 8192 (head_dim 128), intermediate 29568,
    # vocab 152064, max_position_embeddings 32768, bfloat16; 72.7B parameters (model card).
    "qwen2.5-72b": ModelSpec(
        name="Qwen2.5-72B",
        geometry=_standard(80, 8, 128, 72.7e9),
        hidden_size=8192,
        intermediate_size=29568,
        vocab_size=152064,
        max_position_embeddings=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    # 36 layers, 32 heads / 8 KV heads, head_dim 128, hidden 4096, intermediate 12288,
    # vocab 151936, max_position_embeddings 40960, bfloat16; 8.2B parameters (model card).
    "qwen3-8b": ModelSpec(
        name="Qwen3-8B",
        geometry=_standard(36, 8, 128, 8.2e9),
        hidden_size=4096,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=40960,
        source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
    ),
    # https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/main/config.json
    # 32 layers, 32 heads / 8 KV heads, hidden 4096 (head_dim 128), intermediate 14336,
    # vocab 32768, max_position_embeddings 32768, sliding_window null, bfloat16;
    # 7.25B parameters (model card).
    "mistral-7b": ModelSpec(
        name="Mistral-7B-v0.3",
        geometry=_standard(32, 8, 128, 7.25e9),
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32768,
        max_position_embeddings=32768,
        source="https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/config.json
    # Language model: 28 layers, 28 heads / 4 KV heads, hidden 3584 (head_dim 128),
    # intermediate 18944, vocab 152064, max_position_embeddings 32768, bfloat16;
    # 8.29B parameters with the 675M-parameter vision tower (model card).
    "qwen2-vl-7b": ModelSpec(
        name="Qwen2-VL-7B",
        geometry=_standard(28, 4, 128, 8.29e9),
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        source="https://huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/config.json",
        notes=(
            "vision-language model: image tokens take KV like text tokens; the vision "
            "encoder's own activation peak (profiled by vLLM with a dummy image) is not "
            "modelled separately",
        ),
    ),
    # https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json
    # text_config: 36 layers, 32 heads / 8 KV heads, head_dim 128, hidden 4096,
    # intermediate 12288, vocab 151936, max_position_embeddings 262144, bfloat16;
    # 8.77B parameters with the vision tower (model card).
    "qwen3-vl-8b": ModelSpec(
        name="Qwen3-VL-8B",
        geometry=_standard(36, 8, 128, 8.77e9),
        hidden_size=4096,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=262144,
        source="https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json",
        notes=(
            "vision-language model: image tokens take KV like text tokens; the vision "
            "encoder's own activation peak (profiled by vLLM with a dummy image) is not "
            "modelled separately",
        ),
    ),
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    # MLA: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64 (576 latent per token and layer),
    # 128 heads, hidden 7168, intermediate 18432 (3 dense layers), moe_intermediate 2048 with
    # 256 routed + 1 shared experts, vocab 129280, max_position_embeddings 163840,
    # torch_dtype bfloat16 with FP8 (e4m3) weights (quantization_config). 671B parameters
    # in the main model; the 11.5B-parameter multi-token-prediction module is not loaded
    # unless speculative decoding asks for it
    # (model card, README_WEIGHTS.md).
    "deepseek-v3": ModelSpec(
        name="DeepSeek-V3",
        geometry=ModelGeometry(
            num_layers=61,
            attention="mla",
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            params=671_000_000_000,
        ),
        hidden_size=7168,
        intermediate_size=18432,
        vocab_size=129280,
        max_position_embeddings=163840,
        weight_bytes_per_param=1.0,
        source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        notes=(
            "MLA: KV is one 576-wide latent per token and layer, identical on every GPU "
            "(tensor parallelism does not split it)",
            "FlashMLA on CUDA uses block size 64; pass --block-size 64 to match",
            "mixture of experts: activation estimate uses the dense intermediate size",
        ),
    ),
}

# Short names people type.
MODEL_ALIASES: dict[str, str] = {
    "llama3.1-8b": "llama-3.1-8b",
    "llama-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "llama-70b": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen3-vl": "qwen3-vl-8b",
    "qwen2-vl": "qwen2-vl-7b",
    "mistral-7b-v0.3": "mistral-7b",
    "deepseek-v3-671b": "deepseek-v3",
}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU by name. `memory_gib` is the total vLLM sees (`torch.cuda.mem_get_info`).

    Where no measured figure is cited, it is the vendor's nominal capacity; the driver
    reports 1–3 % less (ECC, reserved memory), so pass `--gpu-memory-gib` with the total from
    `nvidia-smi --query-gpu=memory.total --format=csv` for an exact plan. `large` says vLLM
    picks its large defaults (max_num_seqs 1024) there: at least 70 GiB and not an A100.
    """

    name: str
    memory_gib: float
    large: bool
    source: str


GPUS: dict[str, GpuSpec] = {
    # Vendor specifications (nominal capacity) unless a measured total is cited.
    "rtx3060": GpuSpec("RTX 3060 12G", 12.0, False, "NVIDIA spec: 12 GB GDDR6"),
    "rtx3090": GpuSpec("RTX 3090 24G", 24.0, False, "NVIDIA spec: 24 GB GDDR6X"),
    "rtx4090": GpuSpec("RTX 4090 24G", 24.0, False, "NVIDIA spec: 24 GB GDDR6X"),
    # 23,028 MiB total as reported by nvidia-smi on an A10 (nominal 24 GB GDDR6).
    "a10": GpuSpec("A10 24G", 23028 / 1024, False, "nvidia-smi total 23,028 MiB"),
    "l4": GpuSpec("L4 24G", 24.0, False, "NVIDIA spec: 24 GB GDDR6"),
    "l40s": GpuSpec("L40S 48G", 48.0, False, "NVIDIA spec: 48 GB GDDR6"),
    "a100-40g": GpuSpec("A100 40G", 40.0, False, "NVIDIA spec: 40 GB HBM2"),
    # vLLM keeps an A100 80G on the small defaults (its check excludes "a100" by name).
    "a100-80g": GpuSpec("A100 80G", 80.0, False, "NVIDIA spec: 80 GB HBM2e"),
    # 79.18 GiB: the total vLLM reported on an H100 80GB in published profiling runs.
    "h100": GpuSpec("H100 80G", 79.18, True, "vLLM-reported total 79.18 GiB"),
    "h200": GpuSpec("H200 141G", 141.0, True, "NVIDIA spec: 141 GB HBM3e"),
}

GPU_ALIASES: dict[str, str] = {
    "3060": "rtx3060",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "a100": "a100-80g",
    "a100-40": "a100-40g",
    "a100-80": "a100-80g",
    "h100-80g": "h100",
    "h200-141g": "h200",
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def find_model(name: str) -> ModelSpec:
    """The preset called `name` (case-insensitive, aliases accepted); KeyError if none."""
    key = _key(name)
    key = MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise KeyError(f"unknown model preset {name!r} (known: {', '.join(MODELS)})")
    return MODELS[key]


def find_gpu(name: str) -> GpuSpec:
    """The GPU preset called `name` (case-insensitive, aliases accepted); KeyError if none."""
    key = _key(name).replace("rtx-", "rtx")
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise KeyError(f"unknown GPU preset {name!r} (known: {', '.join(GPUS)})")
    return GPUS[key]
