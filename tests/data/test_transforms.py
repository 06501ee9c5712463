"""The decoding transforms: the same crop as decode-then-crop, DCT scaling only where the crop allows, every option."""

import io
import random

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from trainaccel.data import CenterCrop, ImageRecord, RandomResizedCrop, RecordDataset, RecordWriter


def smooth_jpeg(width=640, height=480, fmt="JPEG") -> bytes:
    """A smooth colour field: DCT-scaled decoding differs from full decoding only by rounding."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, fmt, quality=95)
    return out.getvalue()


def reference(encoded: bytes, box, size) -> torch.Tensor:
    """Decode whole, crop, antialiased bilinear resize: what the fused transform must equal."""
    left, top, w, h = box
    pixels = torch.from_numpy(simplejpeg.decode_jpeg(encoded, "RGB")).permute(2, 0, 1).float()
    crop = pixels[None, :, top : top + h, left : left + w]
    return torch.nn.functional.interpolate(crop, size=size, mode="bilinear", antialias=True, align_corners=False)[0]


@pytest.mark.parametrize("cls", [RandomResizedCrop, CenterCrop])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_fused_decoding_equals_decode_then_crop(cls, dtype, layout):
    encoded = smooth_jpeg()
    transform = (
        cls((96, 128), dtype=dtype, layout=layout)
        if cls is CenterCrop
        else cls((96, 128), flip=0.0, dtype=dtype, layout=layout)
    )
    for seed in range(12):
        random.seed(seed)
        box = transform.box(640, 480)
        random.seed(seed)
        out = transform.from_encoded(encoded)
        assert out.dtype == dtype and out.shape == ((3, 96, 128) if layout == "chw" else (96, 128, 3))
        chw = (out.permute(2, 0, 1) if layout == "hwc" else out).float() * (255 if dtype == torch.float32 else 1)
        # A crop at least twice the output is decoded at 1/2, 1/4 or 1/8 scale: equal up to the scaling's rounding.
        error = (chw - reference(encoded, box, (96, 128))).abs()
        assert error.mean() < 2.5 and error.max() < 40, (seed, box, error.mean(), error.max())


def test_small_crops_decode_at_full_scale_exactly():
    encoded = smooth_jpeg(200, 150)
    transform = RandomResizedCrop(224, flip=0.0)  # every crop is smaller than the output: no scaling
    for seed in range(5):
        random.seed(seed)
        box = transform.box(200, 150)
        random.seed(seed)
        out = transform.from_encoded(encoded)
        expected = reference(encoded, box, (224, 224)).round().clamp(0, 255)
        assert (out.float() - expected).abs().max() <= 1


def test_random_crops_follow_scale_ratio_and_the_central_fallback():
    transform = RandomResizedCrop(32, scale=(0.2, 0.5), ratio=(0.5, 2.0))
    random.seed(1)
    for _ in range(300):
        left, top, w, h = transform.box(400, 300)
        assert 0 <= left <= 400 - w and 0 <= top <= 300 - h
        assert 0.2 * 120000 * 0.9 <= w * h <= 0.5 * 120000 * 1.1 and 0.45 <= w / h <= 2.2
    # A strip no crop of the accepted ratio fits: the central crop with the ratio clamped, as torchvision does.
    assert RandomResizedCrop(32).box(1000, 10) == (493, 0, 13, 10)
    assert RandomResizedCrop(32).box(10, 1000) == (0, 493, 10, 13)
    assert CenterCrop(224).box(500, 375) == (86, 23, 328, 328)  # Resize(256) then CenterCrop(224)
    assert CenterCrop((100, 200), crop_fraction=1.0).box(400, 300) == (0, 50, 400, 200)


def test_flips_and_decoded_inputs():
    encoded = smooth_jpeg(120, 90)
    flipped = CenterCrop(64, crop_fraction=1.0)
    base = flipped.from_encoded(encoded)
    always = RandomResizedCrop(64, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=1.0)
    assert torch.equal(always.from_encoded(encoded), base.flip(-1))
    pil = Image.open(io.BytesIO(encoded))
    tensor = torch.from_numpy(np.asarray(pil.convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(flipped(pil), base) and torch.equal(flipped(tensor), base)
    with pytest.raises(ValueError, match=r"expected a uint8 CHW image tensor, got torch.float32 of shape \(3, 4, 4\)"):
        flipped(torch.zeros(3, 4, 4))
    png = smooth_jpeg(120, 90, fmt="PNG")  # not a JPEG: decoded whole by Pillow, then the same crop
    assert (flipped.from_encoded(png).float() - base.float()).abs().mean() < 2


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: RandomResizedCrop(0), r"invalid size=0; accepted: an integer N >= 1 or \(height, width\)"),
        (lambda: RandomResizedCrop((3, 4, 5)), r"invalid size=\(3, 4, 5\)"),
        (lambda: RandomResizedCrop(8, scale=(0.5, 0.1)), r"invalid scale=\(0.5, 0.1\)"),
        (lambda: RandomResizedCrop(8, ratio=(0, 1)), r"invalid ratio=\(0, 1\)"),
        (lambda: RandomResizedCrop(8, flip=2), "invalid flip=2; accepted: a probability from 0 to 1"),
        (lambda: RandomResizedCrop(8, dtype=torch.float16), "invalid dtype=torch.float16"),
        (lambda: RandomResizedCrop(8, layout="nchw"), "invalid layout='nchw'; accepted: chw, hwc"),
        (lambda: CenterCrop(8, crop_fraction=1.5), r"invalid crop_fraction=1.5; accepted: a fraction in \(0, 1\]"),
    ],
)
def test_bad_arguments_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_record_dataset_hands_the_stored_bytes_to_a_decoding_transform(tmp_path):
    encoded = smooth_jpeg(160, 120)
    with RecordWriter(tmp_path / "s.tfrecord") as writer:
        writer.write(ImageRecord(encoded, 3, "jpeg", 120, 160, "a.jpg").to_example())
    transform = CenterCrop(32)
    image, label = RecordDataset(tmp_path / "s.tfrecord", transform=transform)[0]  # default output="pil"
    assert label == 3 and torch.equal(image, transform.from_encoded(encoded))
    raw, _ = RecordDataset(tmp_path / "s.tfrecord", transform=len, output="bytes")[0]
    assert raw == len(encoded)
    with pytest.raises(ValueError, match=r"decode_size=\(64, 64\) with CenterCrop, which picks the decoding scale"):
        RecordDataset(tmp_path / "s.tfrecord", transform=transform, decode_size=64)
