"""Per model: the tokens each media part of a chat becomes, or the 400 that says why the
gateway cannot tell.

For each media part, in order:

- an image with its bytes in the request (a base64 ``data:`` URL) is read (header only) and
  counted by the model's family rule; unreadable data, an image larger than ``max_image_bytes``
  or ``max_image_pixels`` (vLLM's ``VLLM_MAX_IMAGE_PIXELS``) or one the processor refuses is a
  400;
- an image behind an ``http(s)`` URL is fetched only when ``fetch.enabled`` (its start, until
  the size can be read; limits ``fetch.max_bytes``, ``fetch.timeout_s``), else counted at the
  worst case;
- everything else (video, audio, embeddings, ``file:`` URLs) is counted at the configured
  worst case for its modality.

The worst case of an image is ``worst_case.image`` if configured, else the family's largest
image (its area bound). A part with no worst case is refused (400): it is never counted as 0.

With the ``engine`` counter (whose ``/tokenize`` counts media itself in vLLM 0.32) the parts
are only checked: data URLs must hold readable images within the limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.media.families import Family, UncountableImage
from gateway.media.images import UnreadableImage, image_size
from gateway.media.sources import (
    FetchPolicy,
    MediaSourceError,
    data_url_bytes,
    fetch_bytes,
    is_remote,
)
from gateway.tokens.chat import (
    MEDIA_PART_TYPES,
    UNCOUNTABLE_PART_TYPES,
    MediaCount,
    Modality,
)
from gateway.tokens.errors import InvalidChatRequest

VLLM_MAX_IMAGE_PIXELS = 178_956_970
"""vLLM 0.32's default ``VLLM_MAX_IMAGE_PIXELS``: larger images are refused by the engine."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """One model's media settings (``models[].media``)."""

    family: Family | None = None
    worst_case: Mapping[Modality, int] = field(default_factory=dict)
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = VLLM_MAX_IMAGE_PIXELS
    fetch: FetchPolicy = field(default_factory=FetchPolicy)

    def worst(self, modality: Modality, overrides: Mapping[str, Any] | None) -> int | None:
        configured = self.worst_case.get(modality)
        if configured is not None:
            return configured
        if modality == "image" and self.family is not None:
            return self.family.worst_image_tokens(overrides)
        return None


class MediaCounter:
    """Counts (or only checks, ``counts=False``) the media parts of one model's chats.
    ``session`` gives the HTTP session remote images are fetched with (when enabled)."""

    def __init__(
        self,
        model: str,
        policy: MediaPolicy,
        *,
        counts: bool = True,
        session: Callable[[], aiohttp.ClientSession] | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.counts = counts
        self._session = session

    async def count(
        self,
        messages: Sequence[Mapping[str, Any]],
        overrides: Mapping[str, Any] | None = None,
    ) -> tuple[MediaCount, ...]:
        """One :class:`MediaCount` per media part, in order; raises
        :class:`InvalidChatRequest` (a 400) for a part that is bad or cannot be counted."""
        counted: list[MediaCount] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if not isinstance(part, Mapping):
                    continue
                kind = part.get("type")
                if not isinstance(kind, str):
                    continue
                modality = MEDIA_PART_TYPES.get(kind) or UNCOUNTABLE_PART_TYPES.get(kind)
                if kind in MEDIA_PART_TYPES or kind in UNCOUNTABLE_PART_TYPES:
                    where = f"messages[{i}].content[{j}]"
                    counted.append(await self._part(part, kind, modality, where, overrides))
        return tuple(counted)

    async def _part(
        self,
        part: Mapping[str, Any],
        kind: str,
        modality: Modality | None,
        where: str,
        overrides: Mapping[str, Any] | None,
    ) -> MediaCount:
        if modality is None:  # prompt_embeds: its length is in the tensor, not readable here
            raise InvalidChatRequest(
                f"{where}: the gateway cannot count {kind} parts", param="messages"
            )
        if modality == "image" and kind in MEDIA_PART_TYPES:
            url = _image_url(part, where)
            if url[:5].lower() == "data:":
                return self._of_size(self._read(url, where), where, overrides)
            if is_remote(url) and self.policy.fetch.enabled and self._session is not None:
                return self._of_size(await self._fetch(url, where), where, overrides)
        if not self.counts:
            return MediaCount(modality, 0, "engine")
        worst = self.policy.worst(modality, overrides)
        if worst is None:
            raise InvalidChatRequest(
                f"{where}: the gateway cannot count this {modality} part for model "
                f"`{self.model}`: configure models[].media (a family, or worst_case.{modality})",
                param="messages",
            )
        return MediaCount(modality, worst, "worst_case")

    def _read(self, url: str, where: str) -> tuple[int, int]:
        try:
            data = data_url_bytes(url, self.policy.max_image_bytes)
            return self._size(data)
        except (MediaSourceError, UnreadableImage) as e:
            raise InvalidChatRequest(f"{where}: {e}", param="messages") from None

    async def _fetch(self, url: str, where: str) -> tuple[int, int]:
        assert self._session is not None

        def readable(data: bytes) -> bool:
            try:
                image_size(data)
            except UnreadableImage:
                return False
            return True

        try:
            data = await fetch_bytes(url, self.policy.fetch, self._session(), readable)
            return self._size(data)
        except (MediaSourceError, UnreadableImage) as e:
            raise InvalidChatRequest(f"{where}: {e}", param="messages") from None

    def _size(self, data: bytes) -> tuple[int, int]:
        width, height = image_size(data)
        if width * height > self.policy.max_image_pixels:
            raise UnreadableImage(
                f"image dimensions {width}x{height} ({width * height} pixels) exceed the "
                f"maximum of {self.policy.max_image_pixels} pixels"
            )
        return width, height

    def _of_size(
        self, size: tuple[int, int], where: str, overrides: Mapping[str, Any] | None
    ) -> MediaCount:
        family = self.policy.family
        if family is None:
            if not self.counts:
                return MediaCount("image", 0, "engine")
            worst = self.policy.worst("image", overrides)
            if worst is None:
                raise InvalidChatRequest(
                    f"{where}: the gateway cannot count images for model `{self.model}`: "
                    "configure models[].media (a family, or worst_case.image)",
                    param="messages",
                )
            return MediaCount("image", worst, "worst_case")
        try:
            tokens = family.image_tokens(*size, overrides)
        except UncountableImage as e:
            raise InvalidChatRequest(f"{where}: {e}", param="messages") from None
        return MediaCount("image", tokens, "size")


def _image_url(part: Mapping[str, Any], where: str) -> str:
    value = part.get("image_url")
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise InvalidChatRequest(
            f"{where}: image_url.url must be a non-empty string", param="messages"
        )
    return value
