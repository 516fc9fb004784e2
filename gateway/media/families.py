"""Per-family rules: the tokens one image becomes, from its size, as the model's processor
computes them.

- **Qwen2-VL, Qwen2.5-VL** (``Qwen2VLImageProcessor``): the image is resized so both sides
  are multiples of ``patch_size × merge_size`` (14 × 2 = 28) and its area lies within
  ``[min_pixels, max_pixels]`` (``smart_resize``); it is cut into 14 × 14 patches and each
  2 × 2 of them merged into one token: ``tokens = (h' / 28) × (w' / 28)``. The published
  checkpoints' ``preprocessor_config.json``: ``min_pixels`` 3,136, ``max_pixels`` 12,845,056.
- **Qwen3-VL**: the same rule with 16-pixel patches (factor 32), ``shortest_edge`` 65,536,
  ``longest_edge`` 16,777,216.
- **fixed** (LLaVA-1.5: 576 = (336 / 14)², Gemma 3: 256, …): every image is resized to one
  size, so every image is the same number of tokens, ``image_tokens``.

A request's ``mm_processor_kwargs`` may override ``min_pixels``/``max_pixels`` (or
``size: {shortest_edge, longest_edge}``) for the Qwen families, as it does in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.tokens.chat import MediaTemplate, Modality

MAX_ASPECT_RATIO = 200
"""Qwen's processors refuse an image whose long side is more than 200× its short side."""


class UncountableImage(ValueError):
    """The model's processor would refuse this image (the message says why)."""


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` (transformers ``image_processing_qwen2_vl.py``): the size
    the processor resizes a ``height × width`` image to."""
    if min(height, width) <= 0:
        raise UncountableImage(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise UncountableImage(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width):g}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class Family:
    """How one model family turns an image into tokens.

    ``patch_size``/``merge_size``/``min_pixels``/``max_pixels`` for the Qwen rule
    (``fixed_tokens`` None); ``fixed_tokens`` for families of one size per image. ``template``
    says where vLLM writes a media part into the prompt (:class:`MediaTemplate`).
    """

    name: str
    template: MediaTemplate
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    fixed_tokens: int | None = None

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_tokens(
        self, width: int, height: int, overrides: Mapping[str, Any] | None = None
    ) -> int:
        """Tokens of one ``width × height`` image (``overrides``: a request's
        ``mm_processor_kwargs``). Raises :class:`UncountableImage`."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        low, high = self._bounds(overrides)
        h, w = smart_resize(height, width, factor=self.factor, min_pixels=low, max_pixels=high)
        return (h // self.factor) * (w // self.factor)

    def worst_image_tokens(self, overrides: Mapping[str, Any] | None = None) -> int:
        """The most tokens any image can become (the area bound reached)."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        _, high = self._bounds(overrides)
        return max(1, high // (self.factor * self.factor))

    def _bounds(self, overrides: Mapping[str, Any] | None) -> tuple[int, int]:
        low, high = self.min_pixels, self.max_pixels
        if overrides:
            size = overrides.get("size")
            if isinstance(size, Mapping):
                low = _positive(size.get("shortest_edge"), low)
                high = _positive(size.get("longest_edge"), high)
            low = _positive(overrides.get("min_pixels"), low)
            high = _positive(overrides.get("max_pixels"), high)
        return low, high

    def with_settings(
        self,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        image_tokens: int | None = None,
    ) -> Family:
        return Family(
            self.name,
            self.template,
            self.patch_size,
            self.merge_size,
            min_pixels if min_pixels is not None else self.min_pixels,
            max_pixels if max_pixels is not None else self.max_pixels,
            image_tokens if image_tokens is not None else self.fixed_tokens,
        )


def _positive(value: object, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return default


_QWEN_TEMPLATE = MediaTemplate(
    placeholders={
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
    },
    pad_tokens={"image": "<|image_pad|>", "video": "<|video_pad|>"},
)
_LLAVA_TEMPLATE = MediaTemplate(placeholders={"image": "<image>"}, pad_tokens={"image": "<image>"})

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("qwen2_vl", _QWEN_TEMPLATE),
    "qwen2_5_vl": Family("qwen2_5_vl", _QWEN_TEMPLATE),
    "qwen3_vl": Family(
        "qwen3_vl", _QWEN_TEMPLATE, patch_size=16, min_pixels=65536, max_pixels=16777216
    ),
    "llava": Family("llava", _LLAVA_TEMPLATE, fixed_tokens=576),
    "fixed": Family("fixed", MediaTemplate(), fixed_tokens=1),
}
"""The families the gateway counts images of, by the name ``models[].media.family`` takes."""

MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")
