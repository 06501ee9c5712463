"""What `trainaccel bench data` reads: a synthetic ImageNet-like set, the training transform, and the datasets."""

from __future__ import annotations

import io
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def make_synthetic(folder: Path, images: int, classes: int, seed: int = 0) -> list[Path]:
    """JPEGs (quality 90) of about 500x375 with ImageNet-like file sizes, in class folders; deterministic."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(images):
        width = int(rng.integers(400, 601))
        height = int(width * rng.uniform(0.65, 0.85))
        # Smooth colour fields plus grain: compresses about as much as photographs do at q90.
        coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
            (width, height), Image.Resampling.BICUBIC
        )
        pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 10, (height, width, 3)).astype(np.int16)
        path = folder / f"class{i % classes:03d}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


TENSOR_DTYPES = ("float32", "uint8")


class TrainTransform:
    """RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3) + horizontal flip + to a tensor.

    `dtype="float32"`: CHW in [0, 1], as torchvision's ToTensor. `"uint8"`: HWC as decoded, so
    a batch is NHWC, a channels-last NCHW view after `permute(0, 3, 1, 2)`, converted to float on
    the accelerator, as FFCV and DALI hand batches over (4x fewer bytes from the workers, no
    transposing copy). Takes a PIL image (Pillow's resize) or a uint8 CHW tensor (torch's
    antialiased resize, the same filter), as torchvision's transforms do.
    """

    def __init__(self, size: int = 224, dtype: str = "float32"):
        if dtype not in TENSOR_DTYPES:
            raise ValueError(f"invalid dtype={dtype!r}; accepted: {', '.join(TENSOR_DTYPES)}")
        self.size, self.dtype = size, dtype

    def _finish(self, chw: torch.Tensor) -> torch.Tensor:
        if self.dtype == "uint8":  # HWC memory, as decoded: the batch is NHWC, a channels-last NCHW view
            return chw.permute(1, 2, 0).contiguous()
        return chw.contiguous().float().div_(255)

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """A random crop (left, top, right, bottom), or the whole image after 10 misses."""
        for _ in range(10):
            area = width * height * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                x, y = random.randint(0, width - w), random.randint(0, height - h)
                return x, y, x + w, y + h
        return 0, 0, width, height

    def __call__(self, image: Any) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            left, top, right, bottom = self.box(image.shape[2], image.shape[1])
            # The resize's fast uint8 kernel wants channels-last memory without gaps (a decoded HWC image is).
            crop = image[None, :, top:bottom, left:right].contiguous(memory_format=torch.channels_last)
            resized = torch.nn.functional.interpolate(
                crop, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False
            )[0]
            if random.random() < 0.5:
                resized = resized.flip(-1)
            return self._finish(resized)
        from PIL import Image

        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=self.box(*image.size))
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return self._finish(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))


class DecodeDataset(torch.utils.data.Dataset):
    """Images from files, opened with PIL as ImageFolder does (the per-file baseline), or bytes in memory
    decoded as `RecordDataset(output="tensor")` does (the decode-only bound)."""

    def __init__(self, items: list[tuple[Path | bytes, int]], transform: TrainTransform):
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        source, label = self.items[i]
        if isinstance(source, bytes):
            from trainaccel.data.decode import decode_image

            return self.transform(decode_image(source, "tensor")), label
        from PIL import Image

        with Image.open(source) as image:
            return self.transform(image.convert("RGB")), label


class RemoteFileDataset(torch.utils.data.Dataset):
    """One object per image on a remote store, one request each, opened with PIL: the remote baseline."""

    def __init__(self, items: list[tuple[str, int]], transform: TrainTransform, storage_options: dict[str, Any]):
        from trainaccel.data.storage import Store

        self.items, self.transform = items, transform
        self.store = Store(items[0][0], storage_options) if items else None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        url, label = self.items[i]
        with Image.open(io.BytesIO(self.store.read(url))) as image:
            return self.transform(image.convert("RGB")), label


class ReadyDataset(torch.utils.data.Dataset):
    """A new tensor shaped as the transform's output per image: what the DataLoader alone can carry."""

    def __init__(self, length: int, transform: TrainTransform):
        self.length = length
        self.shape, self.dtype = (3, transform.size, transform.size), torch.float32
        if transform.dtype == "uint8":
            self.shape, self.dtype = (transform.size, transform.size, 3), torch.uint8

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full(self.shape, i % 256, dtype=self.dtype), i % 10


def decoder_timings(samples: list[bytes], size: tuple[int, int], repeats: int) -> dict[str, dict[str, float]]:
    """Milliseconds per image (median of `repeats` passes) for Pillow and simplejpeg, at full size and `size`.

    Each decodes to its own output (a PIL image, a NumPy array); a PIL image costs more to make a tensor of.
    """
    from trainaccel.data.decode import decode_jpeg, decode_pillow

    decoders = {"pillow": lambda data, at: decode_pillow(data, "pil", at), "simplejpeg": decode_jpeg}
    timings: dict[str, dict[str, float]] = {}
    for name, decode in decoders.items():
        for label, at in (("full", None), (f"{size[0]}x{size[1]}", size)):
            passes = []
            for data in samples[:20]:  # warm up: the first calls also load code and fill caches
                decode(data, at)
            for _ in range(repeats):
                start = time.perf_counter()
                for data in samples:
                    decode(data, at)
                passes.append((time.perf_counter() - start) * 1e3 / len(samples))
            timings.setdefault(name, {})[label] = statistics.median(passes)
    return timings


def tfrecord_package_dataset(shards: list[Path], transform: TrainTransform) -> torch.utils.data.IterableDataset:
    """The `tfrecord` package's loader on the same shards (each shard split over the DataLoader workers)."""
    from PIL import Image
    from tfrecord.torch.dataset import TFRecordDataset

    def decode(features: dict[str, Any]) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(features["image/encoded"])).convert("RGB")
        return transform(image), int(features["image/class/label"][0])

    description = {"image/encoded": "byte", "image/class/label": "int"}
    return torch.utils.data.ChainDataset(
        [TFRecordDataset(str(s), f"{s}.index", description, transform=decode) for s in shards]
    )
