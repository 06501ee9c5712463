"""What `trainaccel bench data` reads: a synthetic ImageNet-like set, the training transform, and the datasets."""

from __future__ import annotations

import io
import math
import random
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
        coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
        pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 10, (height, width, 3)).astype(np.int16)
        path = folder / f"class{i % classes:03d}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


class TrainTransform:
    """RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3) + horizontal flip + to float tensor, on PIL images."""

    def __init__(self, size: int = 224):
        self.size = size

    def __call__(self, image: Any) -> torch.Tensor:
        from PIL import Image

        width, height = image.size
        box = (0, 0, width, height)
        for _ in range(10):
            area = width * height * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                x, y = random.randint(0, width - w), random.randint(0, height - h)
                box = (x, y, x + w, y + h)
                break
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div_(255)


class DecodeDataset(torch.utils.data.Dataset):
    """Images from files (the per-file baseline, as ImageFolder reads them) or from bytes already in memory (the bound)."""

    def __init__(self, items: list[tuple[Path | bytes, int]], transform: TrainTransform):
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        source, label = self.items[i]
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as image:
            return self.transform(image.convert("RGB")), label


def tfrecord_package_dataset(shards: list[Path], transform: TrainTransform) -> torch.utils.data.IterableDataset:
    """The `tfrecord` package's loader on the same shards (each shard split over the DataLoader workers)."""
    from PIL import Image
    from tfrecord.torch.dataset import TFRecordDataset

    def decode(features: dict[str, Any]) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(features["image/encoded"])).convert("RGB")
        return transform(image), int(features["image/class/label"][0])

    description = {"image/encoded": "byte", "image/class/label": "int"}
    return torch.utils.data.ChainDataset([
        TFRecordDataset(str(s), f"{s}.index", description, transform=decode) for s in shards
    ])  # fmt: skip
