"""Pack image files into TFRecord shards: planned once, written shard by shard, resumable.

`pack` first writes a plan (which images go to which shard) into the output folder. Each shard
is written to a temporary file and renamed; a small result file beside it says it is complete.
A rerun with the same arguments skips complete shards and redoes the rest, so an interrupted
pack ends with exactly one copy of every image. `manifest.json` is written last.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainaccel.data.example import ImageRecord
from trainaccel.data.records import RecordWriter, index_path
from trainaccel.data.storage import BYTE_UNITS, Store, is_url, join, local_path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MANIFEST = "manifest.json"
PLAN = "pack-plan.json"


class PackError(RuntimeError):
    """Packing cannot go on; the message names the file or folder and what is wrong."""


@dataclass(frozen=True)
class Item:
    """One image to pack: its path under the image root, its label, and extra features (COCO).

    `extra` holds (key, kind, values) with kind "bytes", "int" or "float".
    """

    path: str
    label: int
    extra: tuple[tuple[str, str, tuple[Any, ...]], ...] = ()

    def features(self) -> dict[str, np.ndarray]:
        kinds = {"bytes": object, "int": np.int64, "float": np.float32}
        return {key: np.array(values, dtype=kinds[kind]) for key, kind, values in self.extra}


@dataclass(frozen=True)
class PackOptions:
    shard_size: str = "1000"  # records, or bytes of input files with a unit: 64MB, 256MiB
    max_side: int | None = None  # resize so the longer side is at most this (re-encoded as JPEG)
    quality: int = 90
    on_error: str = "fail"  # or "skip": unreadable images are listed in the manifest

    def __post_init__(self) -> None:
        parse_shard_size(self.shard_size)
        if self.max_side is not None and (
            isinstance(self.max_side, bool) or not isinstance(self.max_side, int) or self.max_side < 1
        ):
            raise ValueError(f"invalid max_side={self.max_side!r}; accepted: an integer >= 1, or None to keep the size")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"invalid quality={self.quality!r}; accepted: an integer from 1 to 100")
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"invalid on_error={self.on_error!r}; accepted: skip, fail")


def parse_shard_size(text: str) -> tuple[str, int]:
    """`1000` is records per shard; `64MB`, `256MiB` (B, KB, MB, GB, KiB, MiB, GiB) is input bytes per shard."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or int(match.group(1)) < 1 or (unit and unit not in BYTE_UNITS):
        raise ValueError(
            f"invalid shard size {text!r}; accepted: a record count (1000) or bytes with a unit "
            f"({', '.join(u.upper().replace('I', 'i') for u in BYTE_UNITS)}), e.g. 64MB"
        )
    return ("bytes", int(match.group(1)) * BYTE_UNITS[unit]) if unit else ("records", int(match.group(1)))


def class_folders(img_dir: Path) -> list[str]:
    if not img_dir.is_dir():
        raise PackError(f"no image folder at {img_dir}")
    classes = sorted(p.name for p in img_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise PackError(f"{img_dir} has no class folders (expected IMG_DIR/<class>/<image>)")
    return classes


def folder_items(img_dir: Path, label_map: dict[str, int] | None = None) -> tuple[list[Item], dict[str, int]]:
    """The images of IMG_DIR/<class>/..., in sorted order, and the label map (sorted classes when not given)."""
    classes = class_folders(img_dir)
    if label_map is None:
        label_map = {c: i for i, c in enumerate(classes)}
    missing = [c for c in classes if c not in label_map]
    if missing:
        raise PackError(f"the label map has no label for class folder(s) {missing[:5]} of {img_dir}")
    items = [
        Item(path.relative_to(img_dir).as_posix(), label_map[c])
        for c in classes
        for path in sorted((img_dir / c).rglob("*"))
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES
    ]
    return items, label_map


def make_list(img_dir: Path, list_path: Path, labels_path: Path | None = None) -> dict[str, int]:
    """Write the image list (`relative/path label` per line) of class folders; returns the label map.

    With `labels_path`, its JSON map {class: label} is used (every class must be in it); without,
    classes are numbered in sorted order and the map is written to `labels.json` beside the list.
    """
    items, label_map = folder_items(img_dir, read_labels(labels_path) if labels_path is not None else None)
    if labels_path is None:
        _write_json(list_path.parent / "labels.json", label_map)
    _write_text(list_path, "".join(f"{item.path} {item.label}\n" for item in items))
    return label_map


def read_labels(path: Path) -> dict[str, int]:
    try:
        labels = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PackError(f"cannot read the label map {path}: {error}") from None
    if not isinstance(labels, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in labels.values()):
        raise PackError(f"{path} must be a JSON object mapping class names to integer labels")
    return labels


def read_list(list_path: Path) -> list[Item]:
    """An image list's items; a malformed line raises naming its line number."""
    items = []
    for number, line in enumerate(Path(list_path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        path, _, label = line.rstrip().rpartition(" ")
        if not path or not re.fullmatch(r"-?\d+", label):
            raise PackError(f"{list_path}:{number}: expected `relative/path label`, got {line!r}")
        items.append(Item(path, int(label)))
    return items


def coco_items(annotations: Path) -> tuple[list[Item], dict[str, int]]:
    """The images of a COCO annotation file, with TensorFlow's object-detection keys and the raw annotations.

    Boxes are stored normalized to [0, 1] (they stay right when --max-side resizes the image);
    `image/class/label` is -1, the categories are in `image/object/class/label` and `.../text`.
    """
    try:
        data = json.loads(Path(annotations).read_text())
        images, categories = data["images"], {c["id"]: c["name"] for c in data["categories"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise PackError(f"{annotations} is not a COCO annotation file (images, categories): {error!r}") from None
    by_image: dict[Any, list[dict[str, Any]]] = {}
    for ann in data.get("annotations", []):
        if ann.get("category_id") not in categories:
            raise PackError(
                f"{annotations}: annotation {ann.get('id')} has unknown category_id {ann.get('category_id')!r}"
            )
        by_image.setdefault(ann["image_id"], []).append(ann)
    items = []
    for image in sorted(images, key=lambda i: i["id"]):
        anns, width, height = by_image.get(image["id"], []), image["width"], image["height"]
        boxes = [a["bbox"] for a in anns]  # x, y, w, h in pixels
        extra = (
            ("image/source_id", "bytes", (str(image["id"]),)),
            ("image/object/bbox/xmin", "float", tuple(x / width for x, _, _, _ in boxes)),
            ("image/object/bbox/ymin", "float", tuple(y / height for _, y, _, _ in boxes)),
            ("image/object/bbox/xmax", "float", tuple((x + w) / width for x, _, w, _ in boxes)),
            ("image/object/bbox/ymax", "float", tuple((y + h) / height for _, y, _, h in boxes)),
            ("image/object/class/label", "int", tuple(a["category_id"] for a in anns)),
            ("image/object/class/text", "bytes", tuple(categories[a["category_id"]] for a in anns)),
            ("image/object/area", "float", tuple(float(a.get("area", 0.0)) for a in anns)),
            ("image/object/is_crowd", "int", tuple(int(a.get("iscrowd", 0)) for a in anns)),
            ("image/coco/annotations", "bytes", (json.dumps(anns, sort_keys=True),)),
        )
        items.append(Item(image["file_name"], -1, extra))
    return items, {name: cid for cid, name in sorted(categories.items())}


def plan_shards(items: Sequence[Item], root: Path, shard_size: str) -> list[list[int]]:
    """Which items go to which shard: by count, or by the input files' sizes (known before packing)."""
    kind, limit = parse_shard_size(shard_size)
    if kind == "records":
        return [list(range(i, min(i + limit, len(items)))) for i in range(0, len(items), limit)]
    shards: list[list[int]] = [[]]
    total = 0
    for i, item in enumerate(items):
        size = (root / item.path).stat().st_size if (root / item.path).exists() else 0
        if shards[-1] and total + size > limit:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return [s for s in shards if s]


def shard_name(k: int, total: int) -> str:
    return f"shard-{k:05d}-of-{total:05d}.tfrecord"


def encode_image(path: Path, options: PackOptions) -> tuple[bytes, str, int, int]:
    """The bytes to store: the file as it is, or resized and re-encoded as JPEG when it is too large."""
    from PIL import Image

    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        fmt = (image.format or path.suffix.lstrip(".")).lower()
        if options.max_side is None or max(width, height) <= options.max_side:
            image.verify()  # a truncated or damaged file fails here, at pack time
            return data, fmt, height, width
        image.draft("RGB", (options.max_side, options.max_side))  # JPEG: decode already scaled down
        image = image.convert("RGB")
        image.thumbnail((options.max_side, options.max_side), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        image.save(out, "JPEG", quality=options.quality)
        return out.getvalue(), "jpeg", image.height, image.width


def pack_shard(job: tuple[Path, Path, str, list[Item], PackOptions]) -> dict[str, Any]:
    """Write one shard and then its result file; returns the result."""
    root, out, name, items, options = job
    skipped = []
    with RecordWriter(out / name) as writer:
        for item in items:
            try:
                encoded, fmt, height, width = encode_image(root / item.path, options)
            except Exception as error:  # PIL raises many kinds for damaged files
                if options.on_error == "fail":
                    raise PackError(
                        f"{root / item.path}: {type(error).__name__}: {error} "
                        "(use --on-error skip to leave such files out)"
                    ) from None
                skipped.append({"path": item.path, "error": f"{type(error).__name__}: {error}"})
                continue
            record = ImageRecord(encoded, item.label, fmt, height, width, item.path)
            writer.write(record.to_example(**item.features()))
        records = len(writer.entries)
    result = {
        "name": name,
        "records": records,
        "bytes": (out / name).stat().st_size,
        "sha256": _sha256(out / name),
        "skipped": skipped,
    }
    _write_json(out / f"{name}.done.json", result)
    return result


class _Place:
    """Where a pack's files end up: the local output folder itself (nothing to publish)."""

    def __init__(self, folder: Path):
        self.folder = self.work = folder

    def __str__(self) -> str:
        return str(self.folder)

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def read_json(self, name: str) -> Any:
        return json.loads((self.folder / name).read_text())

    def write_json(self, name: str, value: Any) -> None:
        _write_json(self.folder / name, value)

    def publish(self, name: str) -> None:
        """Make the file `name` written in `work` part of the output."""

    def remove(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)


class _RemotePlace(_Place):
    """A URL (s3://, gs://, ...): shards are written in a local staging folder, uploaded, then deleted there."""

    def __init__(self, url: str, store: Any):
        self.url, self.store = url.rstrip("/"), store
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.work = Path(tempfile.gettempdir()) / "trainaccel-pack-staging" / digest

    def __str__(self) -> str:
        return self.url

    def exists(self, name: str) -> bool:
        return self.store.exists(join(self.url, name))

    def read_json(self, name: str) -> Any:
        return json.loads(self.store.read(join(self.url, name)))

    def write_json(self, name: str, value: Any) -> None:
        self.store.write_bytes(join(self.url, name), (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())

    def publish(self, name: str) -> None:
        self.store.put(self.work / name, join(self.url, name))
        (self.work / name).unlink()

    def remove(self, name: str) -> None:
        self.store.remove(join(self.url, name))


def pack(
    items: Sequence[Item],
    root: Path,
    out: Path | str,
    label_map: dict[str, int],
    options: PackOptions,
    source: dict[str, Any],
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Pack `items` (paths under `root`) into shards in `out`, a folder or a URL fsspec writes; returns the manifest.

    For a URL, each shard is written to a local staging folder, uploaded with its index and its
    completion record, and deleted locally; the manifest is uploaded last.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"invalid workers={workers!r}; accepted: an integer >= 1")
    if not items:
        raise PackError(f"nothing to pack from {source}")
    if is_url(out):
        if str(out).lower().startswith(("http://", "https://")):
            raise PackError(
                f"cannot pack to {out}: HTTP is read-only; pack to a folder and serve it, or to s3://, gs://, az://"
            )
        place: _Place = _RemotePlace(str(out), Store(str(out), storage_options))
    else:
        place = _Place(local_path(out))
    place.work.mkdir(parents=True, exist_ok=True)
    fingerprint = hashlib.sha256(json.dumps([asdict(i) for i in items], default=str).encode()).hexdigest()
    shards = plan_shards(items, root, options.shard_size)
    plan = {
        "source": source,
        "options": asdict(options),
        "images": len(items),
        "fingerprint": fingerprint,
        "shards": [[s[0], s[-1] + 1] for s in shards],
    }
    if place.exists(MANIFEST):
        manifest = place.read_json(MANIFEST)
        if manifest.get("plan") == plan:
            return manifest  # already packed with these arguments
        raise PackError(f"{place} already holds a finished pack made with other arguments; use an empty folder")
    if place.exists(PLAN) and place.read_json(PLAN) != plan:
        raise PackError(
            f"{place} holds an unfinished pack made with other arguments or inputs; rerun that "
            "command to finish it, or use an empty folder"
        )
    place.write_json(PLAN, plan)
    names = [shard_name(k, len(shards)) for k in range(len(shards))]
    results: dict[str, dict[str, Any]] = {}
    jobs = []
    for name, members in zip(names, shards):
        done = f"{name}.done.json"
        if place.exists(done) and place.exists(name) and place.exists(index_path(name).name):
            results[name] = place.read_json(done)
            if progress:
                progress(len(members))
        else:
            jobs.append((root, place.work, name, [items[i] for i in members], options))
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for result, job in zip((pool.map if pool else map)(pack_shard, jobs), jobs):
            name = result["name"]
            for file in (name, index_path(name).name, f"{name}.done.json"):  # the completion record last
                place.publish(file)
            results[name] = result
            if progress:
                progress(len(job[3]))
    manifest = {
        "format": "tfrecord",
        "records": sum(r["records"] for r in results.values()),
        "shards": [{k: results[n][k] for k in ("name", "records", "bytes", "sha256")} for n in names],
        "labels": label_map,
        "skipped": [s for n in names for s in results[n]["skipped"]],
        "plan": plan,
    }
    place.write_json(MANIFEST, manifest)  # last: its presence means every shard is complete
    for name in names:
        place.remove(f"{name}.done.json")
    place.remove(PLAN)
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, value: Any) -> None:
    _write_text(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
