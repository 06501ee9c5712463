"""decode_image: simplejpeg for JPEGs equals Pillow's decode; DCT scaling, fallbacks, and errors naming the record."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainaccel.data import ImageRecord, RecordDataset, RecordWriter
from trainaccel.data.decode import dct_factor, decode_image


def photo(size=(96, 72), mode="RGB", fmt="JPEG") -> bytes:
    """A smooth gradient with noise: JPEG's chroma subsampling and DCT both have work to do."""
    rng = np.random.default_rng(1)
    w, h = size
    base = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3)) * [1.0, 0.5, 0.2]
    pixels = (base + rng.normal(0, 20, (h, w, 3))).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def pillow_pixels(encoded: bytes, draft=None) -> np.ndarray:
    image = Image.open(io.BytesIO(encoded))
    if draft:
        image.draft("RGB", draft)
    return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize("size", [None, (48, 36), (24, 18), (10, 10), (96, 72), (97, 72)])
def test_jpegs_decode_as_pillow_does_at_the_same_dct_scale(size):
    encoded = photo()
    tensor = decode_image(encoded, "tensor", size)
    reference = pillow_pixels(encoded, size)
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, *reference.shape[:2])
    # Both are libjpeg-turbo with the accurate DCT and fancy upsampling: at most rounding apart.
    assert np.abs(tensor.permute(1, 2, 0).numpy().astype(int) - reference).max() <= 1
    pil = decode_image(encoded, "pil", size)
    assert pil.mode == "RGB" and np.array_equal(np.asarray(pil), tensor.permute(1, 2, 0).numpy())


def test_dct_factor_is_the_largest_power_of_two_that_keeps_the_size():
    assert dct_factor(500, 375, None) == 1
    assert dct_factor(500, 375, (224, 224)) == 1  # 1/2 would give 250x188
    assert dct_factor(500, 375, (224, 160)) == 2
    assert dct_factor(4000, 3000, (224, 224)) == 8
    assert dct_factor(4000, 3000, (600, 224)) == 4
    assert dct_factor(63, 63, (8, 8)) == 8  # ceil(63 / 8) = 8
    assert dct_factor(64, 64, (8, 8)) == 8


def test_other_formats_fall_back_to_pillow_and_colour_spaces_become_rgb():
    png = photo(fmt="PNG")
    assert np.array_equal(decode_image(png, "tensor").permute(1, 2, 0).numpy(), pillow_pixels(png))
    grey = decode_image(photo(mode="L"), "tensor")
    assert grey.shape == (3, 72, 96)
    cmyk = photo(mode="CMYK")  # an Adobe CMYK JPEG, converted to RGB
    assert np.abs(decode_image(cmyk, "tensor").permute(1, 2, 0).numpy().astype(int) - pillow_pixels(cmyk)).max() <= 1
    with pytest.raises(ValueError, match="invalid output='bytes'; accepted: pil, tensor"):
        decode_image(png, "bytes")


def test_an_undecodable_image_names_its_record(tmp_path):
    shard = tmp_path / "part.tfrecord"
    with RecordWriter(shard) as writer:
        writer.write(ImageRecord(photo(), 0, "jpeg", 72, 96, "good.jpg").to_example())
        writer.write(ImageRecord(photo()[:200], 1, "jpeg", 72, 96, "cut.jpg").to_example())  # truncated
    dataset = RecordDataset(shard, output="tensor")
    assert dataset[0][0].shape == (3, 72, 96)
    with pytest.raises(ValueError, match=r"cannot decode the image of record 1 \(cut.jpg\) in .*part.tfrecord: "):
        dataset[1]
    assert RecordDataset(shard, output="bytes")[1][1] == 1  # the record itself is intact
