"""Image decoding for `RecordDataset`: libjpeg-turbo through simplejpeg for JPEGs, Pillow for the rest."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

DECODE_OUTPUTS = ("pil", "tensor")
JPEG_MAGIC = b"\xff\xd8\xff"  # how every JPEG file starts


def dct_factor(width: int, height: int, size: tuple[int, int] | None) -> int:
    """The largest of 1, 2, 4, 8 that keeps a (width, height) image at least `size` (w, h) when divided by it.

    Powers of two only: libjpeg-turbo's other M/8 scales decode slower than full size.
    """
    if size is None:
        return 1
    for factor in (8, 4, 2):
        if -(-width // factor) >= size[0] and -(-height // factor) >= size[1]:
            return factor
    return 1


def decode_image(encoded: bytes, output: str = "tensor", size: tuple[int, int] | None = None) -> Any:
    """RGB image from encoded bytes: a uint8 CHW tensor (channels-last in memory) or a PIL image.

    `size=(w, h)`: JPEGs are scaled down by 2, 4 or 8 in the DCT domain, while decoding, as far
    as the result stays at least that size; other formats decode at full size.
    """
    if output not in DECODE_OUTPUTS:
        raise ValueError(f"invalid output={output!r}; accepted: {', '.join(DECODE_OUTPUTS)}")
    # Pillow keeps RGB images 4 bytes a pixel: decoded as RGBX, its copy in is a straight one (a third cheaper).
    colorspace = "RGBX" if output == "pil" else "RGB"
    pixels = decode_jpeg(encoded, size, colorspace) if encoded[:3] == JPEG_MAGIC else None
    if pixels is None:
        return decode_pillow(encoded, output, size)
    if output == "pil":
        from PIL import Image

        return Image.frombytes("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGBX")
    return torch.from_numpy(pixels).permute(2, 0, 1)


def decode_jpeg(encoded: bytes, size: tuple[int, int] | None, colorspace: str = "RGB") -> np.ndarray | None:
    """HWC uint8 pixels (RGB, or RGBX) through simplejpeg, or None where it cannot (not installed, damaged data)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(encoded)
        factor = dct_factor(width, height, size)
        # Asking for at least 1/factor of the size makes libjpeg-turbo pick exactly that scale.
        return simplejpeg.decode_jpeg(
            encoded, colorspace=colorspace, min_height=-(-height // factor), min_width=-(-width // factor)
        )
    except ValueError:  # Pillow decodes what libjpeg-turbo refuses in strict mode, or says why it cannot
        return None


def decode_pillow(encoded: bytes, output: str, size: tuple[int, int] | None) -> Any:
    """RGB image through Pillow: a PIL image or a uint8 CHW tensor; `size` scales JPEGs down while decoding."""
    from PIL import Image

    image = Image.open(io.BytesIO(encoded))
    if size is not None:
        image.draft("RGB", size)  # JPEG only: the same DCT-domain scaling, by Pillow
    image = image.convert("RGB")
    if output == "pil":
        return image
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
