"""`trainaccel bench data` on a tiny synthetic set: every arm and cache runs and is reported."""

import json

from PIL import Image

from conftest import run, trainaccel_cmd


def test_bench_data_reports_every_arm(tmp_path):
    proc = run([*trainaccel_cmd(), "bench", "data", "--work", tmp_path / "work", "--images", 30, "--classes", 3,
                "--repeats", 1, "--batch-size", 8, "--json", tmp_path / "out.json"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report["median"]) == {"files", "records", "records-256", "tfrecord", "memory"}
    assert all(rate > 0 for per in report["median"].values() for rate in per.values())
    assert report["ratio_to_files"]["files"] == {"cold": 1.0, "warm": 1.0}
    images = sorted((tmp_path / "work" / "images").rglob("*.jpg"))
    assert len(images) == 30 and len({p.parent for p in images}) == 3
    with Image.open(images[0]) as first:
        assert first.format == "JPEG" and 400 <= first.width <= 600
    packed = json.loads((tmp_path / "work" / "packed-256" / "manifest.json").read_text())
    assert packed["records"] == 30 and packed["plan"]["options"]["max_side"] == 256


def test_bad_arms_are_named():
    proc = run([*trainaccel_cmd(), "bench", "data", "--arms", "files,nope"])
    assert proc.returncode == 2 and "invalid --arms 'files,nope'" in proc.stderr
