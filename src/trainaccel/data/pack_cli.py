"""`trainaccel pack`: make-list, imagefolder, list and coco, with a progress bar and worker processes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(commands: argparse._SubParsersAction) -> None:
    make = commands.add_parser("make-list", help="write the image list (`relative/path label` lines) of class folders")
    make.add_argument("img_dir", type=Path, help="IMG_DIR/<class>/<image> folders")
    make.add_argument("list", type=Path, help="the list to write")
    make.add_argument(
        "--labels",
        type=Path,
        help="JSON {class: label} to use; default: sorted classes, written to labels.json beside the list",
    )
    folder = commands.add_parser("imagefolder", help="pack IMG_DIR/<class>/<image> into shards in OUT")
    folder.add_argument("img_dir", type=Path)
    folder.add_argument("out", help="output folder, or a URL: s3://bucket/prefix, gs://..., az://...")
    listed = commands.add_parser("list", help="pack the images of an image list (paths under IMG_ROOT) into OUT")
    listed.add_argument("list", type=Path)
    listed.add_argument("img_root", type=Path)
    listed.add_argument("out", help="output folder or URL")
    listed.add_argument(
        "--labels", type=Path, help="JSON {class: label} for the manifest; default: labels.json beside the list, if any"
    )
    coco = commands.add_parser("coco", help="pack the images of a COCO annotation file, with boxes and categories")
    coco.add_argument("annotations", type=Path, help="COCO instances JSON (images, annotations, categories)")
    coco.add_argument("img_dir", type=Path)
    coco.add_argument("out", help="output folder or URL")
    for sub in (folder, listed, coco):
        sub.add_argument(
            "--shard-size",
            default="1000",
            help="records per shard (1000), or input bytes with a unit (64MB); default 1000",
        )
        sub.add_argument(
            "--max-side", type=int, help="resize so the longer side is at most N (re-encoded as JPEG); default: keep"
        )
        sub.add_argument("--quality", type=int, default=90, help="JPEG quality for resized images (default 90)")
        sub.add_argument(
            "--on-error",
            choices=["skip", "fail"],
            default="fail",
            help="unreadable images: stop (fail, default) or leave out and list them in the manifest (skip)",
        )
        sub.add_argument("--workers", type=int, default=1, help="processes writing shards (default 1)")


def main(args: argparse.Namespace) -> int:
    try:
        from trainaccel.data.pack import (
            PackError,
            PackOptions,
            coco_items,
            folder_items,
            make_list,
            pack,
            read_labels,
            read_list,
        )
    except ImportError as error:  # the data extra is not installed
        print(f"trainaccel pack: {error}; install it with pip install 'trainaccel[data]'", file=sys.stderr)
        return 2
    try:
        if args.pack_command == "make-list":
            label_map = make_list(args.img_dir, args.list, args.labels)
            print(f"wrote {args.list} ({len(label_map)} classes)")
            return 0
        options = PackOptions(args.shard_size, args.max_side, args.quality, args.on_error)
        if args.pack_command == "imagefolder":
            items, label_map = folder_items(args.img_dir)
            root = args.img_dir
            source = {"imagefolder": str(args.img_dir.resolve())}
        elif args.pack_command == "coco":
            items, label_map = coco_items(args.annotations)
            root = args.img_dir
            source = {"coco": str(args.annotations.resolve()), "img_dir": str(args.img_dir.resolve())}
        else:
            labels = args.labels or (args.list.parent / "labels.json")
            label_map = read_labels(labels) if args.labels or labels.exists() else {}
            items, root = read_list(args.list), args.img_root
            source = {"list": str(args.list.resolve()), "img_root": str(args.img_root.resolve())}
        manifest = _pack_with_progress(pack, items, root, args.out, label_map, options, source, args.workers)
    except (PackError, ValueError, OSError, ImportError) as error:
        print(f"trainaccel pack: {error}", file=sys.stderr)
        return 2
    skipped = len(manifest["skipped"])
    print(
        f"{args.out}: {manifest['records']} images in {len(manifest['shards'])} shards"
        + (f"; {skipped} skipped (listed in manifest.json)" if skipped else "")
    )
    return 0


def _pack_with_progress(pack, items, root, out, label_map, options, source, workers) -> dict:  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("packing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("pack", total=len(items))
        return pack(items, root, out, label_map, options, source, workers, lambda n: bar.advance(task, n))
