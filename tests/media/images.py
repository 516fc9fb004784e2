"""Images made in memory for the media tests (Pillow), as data URLs or raw bytes."""

from __future__ import annotations

import base64
import io

from PIL import Image


def image_bytes(width: int, height: int, fmt: str = "PNG", orientation: int | None = None) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", (width, height), (200, 30, 30))
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(buffer, fmt, exif=exif)
    else:
        image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}
