"""An image's size from its header, read as vLLM reads images (Pillow, the same formats).

``Image.open`` parses only the header (pixels are decoded on ``load()``, which never runs
here); an EXIF orientation that turns the picture by 90° swaps width and height, as vLLM's
``exif_transpose`` does before the processor sees it.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF",
    "ICNS", "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX",
    "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM",
    "XPM", "XVTHUMB",
)  # fmt: skip
"""vLLM 0.32's allowlist (``vllm/multimodal/image.py``): no EPS, WMF or stub drivers."""
_TURNED = frozenset({5, 6, 7, 8})  # EXIF orientations that rotate by 90 or 270 degrees
_ORIENTATION = 0x0112


class UnreadableImage(ValueError):
    """The bytes are no image vLLM would open (the message says why)."""


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of the image in ``data`` as the model will see it; raises
    :class:`UnreadableImage`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's DecompressionBombWarning: ours to judge
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as image:
                width, height = image.size
                try:
                    orientation = image.getexif().get(_ORIENTATION)
                except Exception:  # a broken EXIF block: vLLM ignores it too
                    orientation = None
    except Image.DecompressionBombError as e:
        raise UnreadableImage(f"image is too large: {e}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise UnreadableImage(f"cannot read the image: {e}") from None
    if orientation in _TURNED:
        width, height = height, width
    return width, height
