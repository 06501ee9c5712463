"""`trainaccel pack`: lists, shards, resizing, bad files, workers, and resuming after a kill."""

import contextlib
import io
import json
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
from PIL import Image

from conftest import run, trainaccel_cmd
from trainaccel.cli import main
from trainaccel.data import ImageRecord, RecordFile


def make_images(root, classes=3, per_class=8, size=(64, 48)):
    """IMG_DIR/<class>/<n>.jpg (and one PNG), each with its own colour."""
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for n in range(per_class):
            image = Image.new("RGB", size, (40 * c, 10 * n, 200))
            suffix = "png" if (c, n) == (0, 0) else "jpg"
            image.save(root / f"class{c}" / f"{n:03d}.{suffix}")
    return root


def read_pack(out):
    """Every record of a pack, in shard order, and the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    records = [ImageRecord.from_example(p) for s in manifest["shards"] for p in RecordFile(out / s["name"])]
    return records, manifest


def pack(*args):
    """`trainaccel pack ...` run in this process (the console script itself is tested once, below)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["pack", *map(str, args)])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.multiprocess
def test_make_list_and_labels(tmp_path):
    images = make_images(tmp_path / "img")
    proc = run([*trainaccel_cmd(), "pack", "make-list", images, tmp_path / "train.txt"])  # the console script
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "train.txt").read_text().splitlines()
    assert len(lines) == 24 and lines[0] == "class0/000.png 0" and lines[-1] == "class2/007.jpg 2"
    assert json.loads((tmp_path / "labels.json").read_text()) == {"class0": 0, "class1": 1, "class2": 2}
    (tmp_path / "partial.json").write_text(json.dumps({"class0": 5}))
    proc = pack("make-list", images, tmp_path / "other.txt", "--labels", tmp_path / "partial.json")
    assert proc.returncode == 2 and "no label for class folder(s) ['class1', 'class2']" in proc.stderr


def test_imagefolder_packs_every_image_once_with_labels(tmp_path):
    images = make_images(tmp_path / "img")
    proc = pack("imagefolder", images, tmp_path / "out", "--shard-size", "5")
    assert proc.returncode == 0, proc.stderr
    records, manifest = read_pack(tmp_path / "out")
    assert [r.filename for r in records] == sorted(str(p.relative_to(images)) for p in images.rglob("*.*"))
    assert [r.label for r in records] == [int(r.filename[5]) for r in records]
    assert len(manifest["shards"]) == 5 and manifest["records"] == 24 and manifest["skipped"] == []
    assert records[0].encoded == (images / "class0/000.png").read_bytes() and records[0].format == "png"
    assert (records[1].height, records[1].width) == (48, 64)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("shard-")) == ["manifest.json"]
    # Packed again with the same arguments: nothing to do; with others: refused.
    assert pack("imagefolder", images, tmp_path / "out", "--shard-size", "5").returncode == 0
    proc = pack("imagefolder", images, tmp_path / "out", "--shard-size", "6")
    assert proc.returncode == 2 and "already holds a finished pack made with other arguments" in proc.stderr


def test_max_side_resizes_and_shard_size_in_bytes(tmp_path):
    images = make_images(tmp_path / "img", classes=2, per_class=4, size=(300, 200))
    proc = pack("imagefolder", images, tmp_path / "out", "--max-side", "32", "--quality", "80", "--shard-size", "3KB")
    assert proc.returncode == 0, proc.stderr
    records, manifest = read_pack(tmp_path / "out")
    assert all((r.width, r.height, r.format) == (32, 21, "jpeg") for r in records)
    assert Image.open(io.BytesIO(records[0].encoded)).size == (32, 21)
    assert len(manifest["shards"]) > 1


@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_damaged_image_is_listed_or_stops_the_pack(tmp_path, on_error):
    images = make_images(tmp_path / "img", classes=2, per_class=3)
    (images / "class1" / "001.jpg").write_bytes(b"not a jpeg")
    proc = pack("imagefolder", images, tmp_path / "out", "--on-error", on_error)
    if on_error == "fail":
        assert proc.returncode == 2 and "class1/001.jpg: UnidentifiedImageError" in proc.stderr
        assert not (tmp_path / "out" / "manifest.json").exists()
        return
    assert proc.returncode == 0 and "1 skipped" in proc.stdout
    records, manifest = read_pack(tmp_path / "out")
    assert len(records) == 5 and [s["path"] for s in manifest["skipped"]] == ["class1/001.jpg"]


@pytest.mark.multiprocess  # a process pool
def test_list_and_workers_give_the_same_shards(tmp_path):
    images = make_images(tmp_path / "img")
    assert pack("make-list", images, tmp_path / "train.txt").returncode == 0
    one = pack("list", tmp_path / "train.txt", images, tmp_path / "one", "--shard-size", "4")
    two = pack("list", tmp_path / "train.txt", images, tmp_path / "two", "--shard-size", "4", "--workers", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    (_, m1), (_, m2) = read_pack(tmp_path / "one"), read_pack(tmp_path / "two")
    assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m2["shards"]]
    assert m1["labels"] == {"class0": 0, "class1": 1, "class2": 2}


def test_bad_arguments_name_the_value(tmp_path):
    images = make_images(tmp_path / "img", classes=1, per_class=1)
    proc = pack("imagefolder", images, tmp_path / "out", "--shard-size", "12XB")
    assert proc.returncode == 2 and "invalid shard size '12XB'" in proc.stderr
    proc = pack("imagefolder", images, tmp_path / "out", "--quality", "0")
    assert proc.returncode == 2 and "invalid quality=0" in proc.stderr
    (tmp_path / "bad.txt").write_text("class0/000.png 0\nno-label-here\n")
    proc = pack("list", tmp_path / "bad.txt", images, tmp_path / "out")
    assert proc.returncode == 2 and "bad.txt:2: expected `relative/path label`" in proc.stderr


@pytest.mark.multiprocess
def test_a_killed_pack_resumes_to_exactly_one_copy_of_every_image(tmp_path):
    images = make_images(tmp_path / "img", classes=4, per_class=60, size=(400, 300))
    out = tmp_path / "out"
    args = [*trainaccel_cmd(), "pack", "imagefolder", str(images), str(out), "--shard-size", "8", "--max-side", "64"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(list(out.glob("*.done.json"))) < 3 and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the pack finished before it could be interrupted"
    assert len(list(out.glob("*.done.json"))) >= 3
    proc = pack("imagefolder", images, out, "--shard-size", "8", "--max-side", "64")
    assert proc.returncode == 0, proc.stderr
    records, manifest = read_pack(out)
    assert sorted(r.filename for r in records) == sorted(str(p.relative_to(images)) for p in images.rglob("*.*"))
    assert manifest["records"] == 240 and not list(out.glob(".*partial"))


def test_coco_boxes_categories_and_annotations(tmp_path):
    from tfrecord.reader import tfrecord_loader

    images = tmp_path / "coco"
    images.mkdir()
    for i, size in enumerate([(200, 100), (50, 40), (80, 80)]):
        Image.new("RGB", size, (i * 60, 0, 0)).save(images / f"{i}.jpg")
    annotations = {
        "images": [
            {"id": 7, "file_name": "0.jpg", "width": 200, "height": 100},
            {"id": 8, "file_name": "1.jpg", "width": 50, "height": 40},
            {"id": 9, "file_name": "2.jpg", "width": 80, "height": 80},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}],
        "annotations": [
            {"id": 1, "image_id": 7, "bbox": [20, 10, 100, 50], "category_id": 3, "area": 5000, "iscrowd": 0},
            {"id": 2, "image_id": 7, "bbox": [0, 0, 200, 100], "category_id": 1, "area": 20000, "iscrowd": 1},
            {"id": 3, "image_id": 8, "bbox": [5, 4, 10, 8], "category_id": 1, "area": 80},
        ],
    }
    (tmp_path / "instances.json").write_text(json.dumps(annotations))
    proc = pack("coco", tmp_path / "instances.json", images, tmp_path / "out", "--max-side", "100")
    assert proc.returncode == 0, proc.stderr
    records, manifest = read_pack(tmp_path / "out")
    assert [r.filename for r in records] == ["0.jpg", "1.jpg", "2.jpg"] and manifest["labels"] == {"cat": 1, "dog": 3}
    assert (records[0].width, records[0].height) == (100, 50)  # resized; normalized boxes still hold
    shard = tmp_path / "out" / manifest["shards"][0]["name"]
    theirs = list(
        tfrecord_loader(
            str(shard),
            None,
            {
                "image/object/bbox/xmin": "float",
                "image/object/bbox/ymax": "float",
                "image/object/class/label": "int",
                "image/object/class/text": "byte",
                "image/object/is_crowd": "int",
                "image/coco/annotations": "byte",
                "image/source_id": "byte",
            },
        )
    )
    first = theirs[0]
    assert first["image/object/bbox/xmin"] == pytest.approx([0.1, 0.0]) and first[
        "image/object/bbox/ymax"
    ] == pytest.approx([0.6, 1.0])
    assert first["image/object/class/label"].tolist() == [3, 1] and first["image/object/is_crowd"].tolist() == [0, 1]
    assert first["image/source_id"] == b"7" and json.loads(first["image/coco/annotations"])[1]["id"] == 2
    assert theirs[2]["image/object/class/label"].tolist() == []  # no objects: empty, still typed lists
    annotations["annotations"][0]["category_id"] = 42
    (tmp_path / "bad.json").write_text(json.dumps(annotations))
    proc = pack("coco", tmp_path / "bad.json", images, tmp_path / "bad")
    assert proc.returncode == 2 and "annotation 1 has unknown category_id 42" in proc.stderr
