"""An image part's bytes: decoded from a ``data:`` URL, or fetched (only when enabled, with a
size and a time limit). Nothing else is ever opened (no ``file:`` URLs)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp


class MediaSourceError(ValueError):
    """The part's data cannot be had (the message says why: the client's fault)."""


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """Whether remote media URLs are fetched to read their size, and within what limits."""

    enabled: bool = False
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 5.0


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 ``data:`` URL (RFC 2397), checked as strictly as vLLM decodes it;
    raises :class:`MediaSourceError` beyond ``max_bytes`` or for data that is not base64."""
    spec, sep, data = url[5:].partition(",")
    if not sep:
        raise MediaSourceError("invalid data URL: missing ',' separator")
    _, sep, encoding = spec.rpartition(";")
    if not sep or encoding != "base64":
        raise MediaSourceError("only base64 data URLs are supported")
    if len(data) * 3 // 4 > max_bytes:
        raise MediaSourceError(f"image data larger than {max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaSourceError(f"image data is not valid base64: {e}") from None


def is_remote(url: str) -> bool:
    return urlsplit(url).scheme in ("http", "https")


async def fetch_bytes(
    url: str,
    policy: FetchPolicy,
    session: aiohttp.ClientSession,
    enough: Callable[[bytes], bool] = lambda data: False,
) -> bytes:
    """The body at ``url`` — or its start, as soon as ``enough(start)`` holds (an image's size
    is in its header) — at most ``policy.max_bytes``, within ``policy.timeout_s``; raises
    :class:`MediaSourceError` when it cannot be had within them."""
    timeout = aiohttp.ClientTimeout(total=policy.timeout_s)
    try:
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                raise MediaSourceError(f"fetching the image answered HTTP {response.status}")
            declared = response.content_length
            if declared is not None and declared > policy.max_bytes:
                raise MediaSourceError(f"image larger than {policy.max_bytes} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > policy.max_bytes:
                    raise MediaSourceError(f"image larger than {policy.max_bytes} bytes")
                chunks.append(chunk)
                if enough(b"".join(chunks)):
                    break
            return b"".join(chunks)
    except TimeoutError:
        raise MediaSourceError(
            f"fetching the image took longer than {policy.timeout_s:g} s"
        ) from None
    except aiohttp.ClientError as e:
        raise MediaSourceError(f"cannot fetch the image: {type(e).__name__}") from None
