"""Transforms that decode: JPEG decoding fused with the crop, at the smallest DCT scale the output allows.

Given to `RecordDataset(..., transform=RandomResizedCrop(224))`, they receive the stored bytes:
the crop box is drawn from the image's header, the JPEG is decoded scaled down by 2, 4 or 8
where the crop still covers the output size, and the crop is resized with torch's antialiased
bilinear kernel for uint8 channels-last images. They also take a decoded image (a PIL image or a
uint8 CHW tensor), as torchvision's transforms do. The result is uint8 for the accelerator to
convert (`dtype=torch.float32` gives [0, 1] here instead), CHW as torchvision's (`layout="chw"`),
or HWC (`layout="hwc"`): batches are then NHWC, collated without a transposing copy, and
`batch.permute(0, 3, 1, 2)` is a channels-last NCHW view, as FFCV and DALI hand batches over.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from trainaccel.data.decode import JPEG_MAGIC, dct_factor, decode_image

_DTYPES = (torch.uint8, torch.float32)
LAYOUTS = ("chw", "hwc")


def _size_pair(size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) from N or (height, width), as torchvision takes sizes."""
    pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair):
        raise ValueError(f"invalid size={size!r}; accepted: an integer N >= 1 or (height, width)")
    return pair  # type: ignore[return-value]


class _DecodingCrop:
    """What both transforms share: a crop box from the image's size, decoded and resized at once."""

    def __init__(self, size: int | tuple[int, int], flip: float, dtype: torch.dtype, layout: str):
        self.size = _size_pair(size)
        if layout not in LAYOUTS:
            raise ValueError(f"invalid layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
        self.layout = layout
        if isinstance(flip, bool) or not isinstance(flip, (int, float)) or not 0 <= flip <= 1:
            raise ValueError(f"invalid flip={flip!r}; accepted: a probability from 0 to 1")
        if dtype not in _DTYPES:
            raise ValueError(f"invalid dtype={dtype!r}; accepted: torch.uint8, torch.float32")
        self.flip, self.dtype = float(flip), dtype

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the crop in an image of this size."""
        raise NotImplementedError

    def from_encoded(self, encoded: bytes) -> torch.Tensor:
        """The transformed image, straight from the stored bytes (JPEGs at a reduced DCT scale)."""
        import simplejpeg

        if encoded[:3] == JPEG_MAGIC:
            try:
                height, width, _, _ = simplejpeg.decode_jpeg_header(encoded)
            except ValueError:  # simplejpeg cannot read it: Pillow decodes it whole, below
                pass
            else:
                left, top, w, h = self.box(width, height)
                factor = dct_factor(w, h, (self.size[1], self.size[0]))
                try:
                    pixels = simplejpeg.decode_jpeg(
                        encoded,
                        colorspace="RGB",
                        min_height=-(-height // factor),
                        min_width=-(-width // factor),
                    )
                except ValueError:
                    pass
                else:
                    scale_y, scale_x = pixels.shape[0] / height, pixels.shape[1] / width
                    box = (
                        round(left * scale_x),
                        round(top * scale_y),
                        max(1, round(w * scale_x)),
                        max(1, round(h * scale_y)),
                    )
                    return self._finish(torch.from_numpy(pixels).permute(2, 0, 1), box)
        return self(decode_image(encoded, "tensor"))

    def __call__(self, image: Any) -> torch.Tensor:
        if not isinstance(image, torch.Tensor):  # a PIL image
            image = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        if image.dtype != torch.uint8 or image.dim() != 3:
            raise ValueError(f"expected a uint8 CHW image tensor, got {image.dtype} of shape {tuple(image.shape)}")
        height, width = image.shape[1:]
        return self._finish(image, self.box(width, height))

    def _finish(self, chw: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
        left, top, w, h = box
        # The resize's fast uint8 kernel wants channels-last memory without gaps.
        crop = chw[None, :, top : top + h, left : left + w].contiguous(memory_format=torch.channels_last)
        if (h, w) != self.size:
            crop = torch.nn.functional.interpolate(
                crop, size=self.size, mode="bilinear", antialias=True, align_corners=False
            )
        if self.flip and random.random() < self.flip:
            crop = crop.flip(-1).contiguous(memory_format=torch.channels_last)
        out = crop[0].permute(1, 2, 0) if self.layout == "hwc" else crop[0].contiguous()  # its memory was HWC
        if self.dtype == torch.float32:
            return out.float().div_(255)
        return out


class RandomResizedCrop(_DecodingCrop):
    """torchvision's RandomResizedCrop (same scale, ratio, fallback), then a horizontal flip with probability `flip`."""

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        dtype: torch.dtype = torch.uint8,
        layout: str = "chw",
    ):
        super().__init__(size, flip, dtype, layout)
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"invalid scale={scale!r}; accepted: (low, high) with 0 < low <= high <= 1")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"invalid ratio={ratio!r}; accepted: (low, high) with 0 < low <= high")
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):  # Python's generator: DataLoader seeds it in each worker, and it is 5x cheaper here
            target = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, width - w), random.randint(0, height - h), w, h
        # As torchvision: a central crop with the ratio clamped to the accepted range.
        if width / height < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif width / height > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h


class CenterCrop(_DecodingCrop):
    """The validation crop: the largest central box of the output's shape, shrunk by `crop_fraction`, resized to `size`.

    With the default 0.875 and a square size 224, it is torchvision's Resize(256) then CenterCrop(224).
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        crop_fraction: float = 0.875,
        dtype: torch.dtype = torch.uint8,
        layout: str = "chw",
    ):
        super().__init__(size, 0.0, dtype, layout)
        if isinstance(crop_fraction, bool) or not isinstance(crop_fraction, (int, float)) or not 0 < crop_fraction <= 1:
            raise ValueError(f"invalid crop_fraction={crop_fraction!r}; accepted: a fraction in (0, 1]")
        self.crop_fraction = float(crop_fraction)

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        out_h, out_w = self.size
        scale = min(width / out_w, height / out_h) * self.crop_fraction
        w, h = max(1, min(width, round(out_w * scale))), max(1, min(height, round(out_h * scale)))
        return (width - w) // 2, (height - h) // 2, w, h
