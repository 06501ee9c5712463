"""`trainaccel bench data` on a tiny synthetic set: every arm and cache runs and is reported."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run, trainaccel_cmd
from trainaccel.bench.image_data import TrainTransform, make_synthetic


def test_the_transform_gives_the_same_pixels_on_pil_images_and_tensors(tmp_path):
    path = make_synthetic(tmp_path, 1, 1)[0]
    image = Image.open(path).convert("RGB")
    tensor = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
    transform = TrainTransform()
    for seed in range(6):  # crops of every size, flipped or not
        random.seed(seed)
        from_pil = transform(image)
        random.seed(seed)
        from_tensor = transform(tensor)
        assert from_pil.shape == from_tensor.shape == (3, 224, 224) and from_tensor.dtype == torch.float32
        difference = (from_pil - from_tensor).abs() * 255  # in 8-bit levels
        # The same filter: rounding apart, and at the crop edge Pillow also weighs pixels outside the box.
        assert difference.max() <= 8 and difference.mean() <= 0.1
    random.seed(0)
    assert not torch.equal(transform(tensor), transform(tensor))  # random crops
    as_bytes = TrainTransform(dtype="uint8")
    for source in (image, tensor):
        random.seed(7)
        hwc = as_bytes(source)
        random.seed(7)
        chw = transform(source)
        assert hwc.dtype == torch.uint8 and hwc.shape == (224, 224, 3) and hwc.is_contiguous()
        assert torch.equal(hwc.permute(2, 0, 1).float(), (chw * 255).round())
    with pytest.raises(ValueError, match="invalid dtype='float16'; accepted: float32, uint8"):
        TrainTransform(dtype="float16")


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["float32", pytest.param("uint8", marks=pytest.mark.bench_full)])
def test_bench_data_reports_every_arm(tmp_path, dtype):
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "data",
            "--work",
            tmp_path / "work",
            "--images",
            30,
            "--classes",
            3,
            "--repeats",
            1,
            "--batch-size",
            8,
            "--dtype",
            dtype,
            "--json",
            tmp_path / "out.json",
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["settings"]["dtype"] == dtype and "simplejpeg" in proc.stdout  # the decoder table
    assert "files, cold cache, repeat 1/1:" in proc.stdout and "images/s" in proc.stdout  # a line per run
    assert all(0 < s < 60 for per in report["seconds_to_first_batch"].values() for v in per.values() for s in v)
    assert set(report["median"]) == {
        "files",
        "records",
        "records-pil",
        "records-256",
        "records-256-fused",
        "tfrecord",
        "memory",
        "loader-only",
    }
    assert all(rate > 0 for per in report["median"].values() for rate in per.values())
    assert report["ratio_to_files"]["files"] == {"cold": 1.0, "warm": 1.0}
    decoders = report["decode_ms_per_image"]
    assert set(decoders) == {"pillow", "simplejpeg"} and all(set(d) == {"full", "160x120"} for d in decoders.values())
    images = sorted((tmp_path / "work" / "images").rglob("*.jpg"))
    assert len(images) == 30 and len({p.parent for p in images}) == 3
    with Image.open(images[0]) as first:
        assert first.format == "JPEG" and 400 <= first.width <= 600
    packed = json.loads((tmp_path / "work" / "packed-256" / "manifest.json").read_text())
    assert packed["records"] == 30 and packed["plan"]["options"]["max_side"] == 256


def test_bad_arms_are_named(cli):
    proc = cli(["bench", "data", "--arms", "files,nope"])
    assert proc.returncode == 2 and "invalid --arms 'files,nope'" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.bench_full  # remote reads are tested against the same servers in tests/data/test_remote.py
def test_bench_data_streams_from_a_real_store_behind_a_delaying_proxy(tmp_path):
    args = ["--work", tmp_path / "work", "--images", 24, "--classes", 2, "--repeats", 1, "--batch-size", 8]
    arms = "files,records,records-local"
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "data",
            *args,
            "--store",
            "http",
            "--latency-ms",
            2,
            "--arms",
            arms,
            "--json",
            tmp_path / "out.json",
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report["median"]) == {"files", "records", "records-local"}
    assert all(set(per) == {"cold"} and per["cold"] > 0 for per in report["median"].values())
    assert report["link"]["bytes_per_s"] > 0 and "the store through its proxy (2 ms each way)" in proc.stdout
    for bad, message in (
        (["--store", "http", "--cache", "warm"], "invalid --cache 'warm' with --store http; accepted: cold"),
        (["--latency-ms", 5], "invalid --latency-ms 5.0; accepted: >= 0, with --store http or s3"),
        (["--arms", "records-local"], "--arms records-local compares a remote store's shards with the local disk"),
    ):
        proc = run([*trainaccel_cmd(), "bench", "data", *args, *map(str, bad)])
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
