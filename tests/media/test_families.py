"""The per-family image token rules against the published processors.

The expected counts were produced with transformers 5.19's own processor (the vLLM
environment's, `Qwen2VLImageProcessorPil.get_number_of_image_patches(h, w) // merge_size²`,
which vLLM 0.32 calls for Qwen2-VL, Qwen2.5-VL and Qwen3-VL), configured as the published
checkpoints' `preprocessor_config.json` are:

- Qwen2-VL / Qwen2.5-VL: patch 14, merge 2, min_pixels 3,136, max_pixels 12,845,056;
- the same with a client's `min_pixels` 256·28², `max_pixels` 1280·28² (Qwen's README);
- Qwen3-VL: patch 16, merge 2, shortest_edge 65,536, longest_edge 16,777,216.

LLaVA-1.5 is (336 / 14)² = 576 tokens whatever the image (its processor resizes to 336²).
"""

from __future__ import annotations

import pytest

from gateway.media.families import FAMILIES, UncountableImage, smart_resize

SIZES = [
    (1, 1), (28, 28), (56, 56), (100, 100), (224, 224), (640, 480), (480, 640), (1024, 768),
    (1920, 1080), (3840, 2160), (4000, 3000), (12000, 9000), (300, 20), (20, 3000), (7, 1400),
]  # fmt: skip
QWEN2 = [4, 4, 4, 16, 64, 391, 391, 999, 2691, 10549, 15301, 16170, 11, 107, 29]
QWEN2_SMALL = [256, 256, 256, 256, 256, 391, 391, 999, 1222, 1222, 1230, 1230, 310, 392, 454]
QWEN3 = [64, 64, 64, 64, 64, 300, 300, 768, 2040, 8160, 11750, 16170, 93, 94, 114]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize(("size", "expected"), list(zip(SIZES, QWEN2, strict=True)))
def test_qwen2_vl_matches_its_processor(family: str, size: tuple[int, int], expected: int) -> None:
    assert FAMILIES[family].image_tokens(*size) == expected


@pytest.mark.parametrize(("size", "expected"), list(zip(SIZES, QWEN2_SMALL, strict=True)))
def test_qwen2_vl_with_client_pixel_bounds(size: tuple[int, int], expected: int) -> None:
    overrides = {"min_pixels": 256 * 28 * 28, "max_pixels": 1280 * 28 * 28}
    assert FAMILIES["qwen2_vl"].image_tokens(*size, overrides) == expected
    sized = {"size": {"shortest_edge": 256 * 28 * 28, "longest_edge": 1280 * 28 * 28}}
    assert FAMILIES["qwen2_vl"].image_tokens(*size, sized) == expected
    configured = FAMILIES["qwen2_vl"].with_settings(min_pixels=256 * 784, max_pixels=1280 * 784)
    assert configured.image_tokens(*size) == expected


@pytest.mark.parametrize(("size", "expected"), list(zip(SIZES, QWEN3, strict=True)))
def test_qwen3_vl_matches_its_processor(size: tuple[int, int], expected: int) -> None:
    assert FAMILIES["qwen3_vl"].image_tokens(*size) == expected


def test_worst_case_is_the_area_bound() -> None:
    assert FAMILIES["qwen2_vl"].worst_image_tokens() == 12845056 // 28**2 == 16384
    assert FAMILIES["qwen3_vl"].worst_image_tokens() == 16777216 // 32**2 == 16384
    assert FAMILIES["qwen2_vl"].worst_image_tokens({"max_pixels": 1280 * 784}) == 1280
    # No image ever counts more than the worst case.
    for family in ("qwen2_vl", "qwen3_vl"):
        worst = FAMILIES[family].worst_image_tokens()
        assert all(FAMILIES[family].image_tokens(*s) <= worst for s in SIZES)


def test_fixed_families_count_every_image_the_same() -> None:
    llava = FAMILIES["llava"]
    assert {llava.image_tokens(*s) for s in SIZES} == {576} == {llava.worst_image_tokens()}
    gemma = FAMILIES["fixed"].with_settings(image_tokens=256)
    assert gemma.image_tokens(4000, 3000) == gemma.worst_image_tokens() == 256


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (0, 5)])
def test_images_the_processor_refuses(size: tuple[int, int]) -> None:
    with pytest.raises(UncountableImage):
        FAMILIES["qwen2_vl"].image_tokens(*size)


def test_smart_resize_keeps_the_bounds() -> None:
    for width, height in SIZES:
        h, w = smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056)
        assert h % 28 == 0 and w % 28 == 0
        assert 3136 <= h * w <= 12845056
