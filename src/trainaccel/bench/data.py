"""`trainaccel bench data`: images/s through a DataLoader, per-file loading vs packed shards, cold and warm cache.

With `--store http|s3` the images and shards are served by a real server on loopback (nginx, or
moto's S3 server) behind a proxy that adds `--latency-ms` each way: per-file reads then cost a
round trip each, as on object storage or a cluster file system.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainaccel.bench.image_data import (
    TENSOR_DTYPES,
    DecodeDataset,
    ReadyDataset,
    RemoteFileDataset,
    TrainTransform,
    decoder_timings,
    make_synthetic,
    tfrecord_package_dataset,
)
from trainaccel.bench.jobs import report_header
from trainaccel.bench.progress import progress
from trainaccel.bench.stores import Remote

ARMS = (
    "files",
    "records",
    "records-pil",
    "records-256",
    "records-256-fused",
    "records-local",
    "tfrecord",
    "memory",
    "loader-only",
)
STORES = ("local", "http", "s3")
DECODE_SIZE = (160, 120)  # half the synthetic images' size or less: JPEGs decode at 1/2 scale
CACHES = ("cold", "warm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "trainaccel-bench-data",
        help="folder for the synthetic images and their packs; made once, reused (default: in the temp dir)",
    )
    parser.add_argument("--images", type=int, default=3000, help="synthetic images (default 3000)")
    parser.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (default 64)")
    parser.add_argument(
        "--dtype",
        choices=TENSOR_DTYPES,
        default="float32",
        help="what the transform's to-tensor gives: float32 in [0, 1] (as ToTensor), or uint8 to "
        "convert on the accelerator (default float32)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved (default 3)")
    parser.add_argument(
        "--arms",
        help=f"comma-separated subset of {', '.join(ARMS)} (default: all; records-local only with --store)",
    )
    parser.add_argument(
        "--cache",
        help="cold (files evicted before each run), warm, or both (default: both; remote stores: cold)",
    )
    parser.add_argument(
        "--store",
        choices=STORES,
        default="local",
        help="where files and shards are read from: the local disk, nginx over HTTP, or moto's S3 server "
        "(both on loopback; default local)",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="milliseconds a proxy adds each way to every exchange with the store (remote stores; default 0)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def _subset(text: str, accepted: tuple[str, ...], flag: str) -> list[str]:
    chosen = [a.strip() for a in text.split(",") if a.strip()]
    if not chosen or any(a not in accepted for a in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(f"invalid {flag} {text!r}; accepted: a comma-separated subset of {', '.join(accepted)}")
    return chosen


def prepare(work: Path, images: int, classes: int) -> dict[str, Path]:
    """The synthetic set and its two packs (stored resolution, --max-side 256); reused when present."""
    from trainaccel.data.pack import PackOptions, folder_items, pack

    folder = work / "images"
    marker = work / "images.json"
    wanted = {"images": images, "classes": classes}
    if not marker.exists() or json.loads(marker.read_text()) != wanted:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        make_synthetic(folder, images, classes)
        marker.write_text(json.dumps(wanted))
    items, labels = folder_items(folder)
    for name, max_side in (("packed", None), ("packed-256", 256)):
        pack(
            items,
            folder,
            work / name,
            labels,
            PackOptions(shard_size="64MB", max_side=max_side),
            {"bench": name},
            workers=2,
        )
    return {"images": folder, "records": work / "packed", "records-256": work / "packed-256"}


def evict(paths: list[Path]) -> None:
    """Drop these files from the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build_arm(
    arm: str, places: dict[str, Path], transform: TrainTransform, remote: Remote | None = None
) -> tuple[Callable[[], torch.utils.data.Dataset], list[Path]]:
    """How to make an arm's dataset for one pass (remote shards: a new, empty block cache), and the files it reads."""
    from trainaccel.data import RecordDataset

    if arm == "files":
        folder = places["images"]
        files = sorted(folder.rglob("*.jpg"))
        classes = sorted({p.parent.name for p in files})
        items = [(p, classes.index(p.parent.name)) for p in files]
        if remote is not None:
            urls = [(remote.url(p), label) for p, label in items]
            return (lambda: RemoteFileDataset(urls, transform, remote.options)), files
        dataset = DecodeDataset(items, transform)
        return (lambda: dataset), files
    if arm.startswith("records"):
        output = "pil" if arm == "records-pil" else "tensor"
        size = (transform.size, transform.size) if arm == "records-256" else None
        folder = places["records-256" if arm.startswith("records-256") else "records"]
        if arm == "records-256-fused":  # the shipped transform, giving what the arm's dtype asks for
            from trainaccel.data import RandomResizedCrop

            float32 = transform.dtype == "float32"
            transform = RandomResizedCrop(  # type: ignore[assignment]
                transform.size,
                dtype=torch.float32 if float32 else torch.uint8,
                layout="chw" if float32 else "hwc",
            )
        shards = [s.shard for s in RecordDataset(folder).shards]
        if remote is not None and arm != "records-local":
            url = remote.url(folder)
            return (
                lambda: RecordDataset(
                    url, transform=transform, output=output, decode_size=size, storage_options=remote.options
                )
            ), shards
        dataset = RecordDataset(folder, transform=transform, output=output, decode_size=size)
        return (lambda: dataset), shards
    shards = [s.shard for s in RecordDataset(places["records"]).shards]
    if arm == "tfrecord":
        dataset = tfrecord_package_dataset(shards, transform)
        return (lambda: dataset), shards
    records = RecordDataset(places["records"], output="bytes")
    if arm == "loader-only":
        ready = ReadyDataset(len(records), transform)
        return (lambda: ready), []
    memory = DecodeDataset([records[i] for i in range(len(records))], transform)
    return (lambda: memory), []


def training_order(dataset: torch.utils.data.Dataset, seed: int) -> torch.utils.data.Sampler | None:
    """The order a training loop reads in: ShardSampler's for shards, a shuffle for files; None for the bounds."""
    from trainaccel.data import RecordDataset, ShardSampler

    if isinstance(dataset, RecordDataset):
        return ShardSampler(dataset, num_replicas=1, rank=0, seed=seed)
    if (
        isinstance(dataset, (DecodeDataset, RemoteFileDataset))
        and dataset.items
        and not isinstance(dataset.items[0][0], bytes)
    ):
        return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    return None


def images_per_second(
    dataset: torch.utils.data.Dataset, workers: int, batch_size: int, seed: int = 0
) -> tuple[float, float]:
    """One pass in training order: images/s from the first batch to the last, and the seconds to the first batch.

    Starting the workers (about 0.15 s here) is a fixed cost per loader, not throughput; counted
    in, it would weigh on a 2-second pass of a fast arm ten times more than on a baseline's.
    """
    start = time.perf_counter()
    sampler = training_order(dataset, seed)
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers))
    first = len(next(batches)[1])
    started = time.perf_counter()
    rest = sum(len(labels) for _, labels in batches)
    end = time.perf_counter()
    if rest == 0:  # a single batch: nothing after the start to time
        return first / (end - start), started - start
    return rest / (end - started), started - start


def main(args: argparse.Namespace) -> int:
    try:
        if args.cache is None:
            args.cache = "cold" if args.store != "local" else ",".join(CACHES)
        if args.arms is None:
            args.arms = ",".join(a for a in ARMS if args.store != "local" or a != "records-local")
        arms, caches = _subset(args.arms, ARMS, "--arms"), _subset(args.cache, CACHES, "--cache")
        for name in ("images", "classes", "workers", "batch_size", "repeats"):
            if getattr(args, name) < (0 if name == "workers" else 1):
                raise ValueError(
                    f"invalid --{name.replace('_', '-')} {getattr(args, name)}; "
                    f"accepted: an integer >= {0 if name == 'workers' else 1}"
                )
        if args.store == "local" and "records-local" in arms:
            raise ValueError("--arms records-local compares a remote store's shards with the local disk; add --store")
        if args.store != "local" and "warm" in caches:
            raise ValueError(
                f"invalid --cache {args.cache!r} with --store {args.store}; accepted: cold (each pass "
                "starts with an empty block cache and the server's files evicted)"
            )
        if args.latency_ms < 0 or (args.latency_ms and args.store == "local"):
            raise ValueError(f"invalid --latency-ms {args.latency_ms}; accepted: >= 0, with --store http or s3")
        places = prepare(args.work, args.images, args.classes)
    except ImportError as error:  # the data extra is not installed
        print(f"trainaccel bench data: {error}; install it with pip install 'trainaccel[data]'", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        print(f"trainaccel bench data: {error}", file=sys.stderr)
        return 2
    if args.store == "local":
        return measure(args, arms, caches, places, None)
    upload = [places[name] for name in ("images", "records", "records-256")]
    with (
        tempfile.TemporaryDirectory() as scratch,
        Remote(args.store, args.work, Path(scratch), args.latency_ms, upload) as remote,
    ):
        return measure(args, arms, caches, places, remote)


def link_rate(remote: Remote, folder: Path, block: int = 8 << 20, streams: int = 4) -> float:
    """Bytes/s of the store through its proxy: a pack's shards read whole in `block` ranges, `streams` at a time."""
    from trainaccel.data import RecordDataset
    from trainaccel.data.storage import Store

    store = Store(remote.url(folder), remote.options)
    jobs = []
    for shard in RecordDataset(folder).shards:
        size = shard.shard.stat().st_size
        url = remote.url(shard.shard)
        jobs += [(url, start, min(start + block, size)) for start in range(0, size, block)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(len(data) for data in pool.map(lambda job: store.read(*job), jobs))
    return total / (time.perf_counter() - start)


def measure(
    args: argparse.Namespace,
    arms: list[str],
    caches: list[str],
    places: dict[str, Path],
    remote: Remote | None,
) -> int:
    transform = TrainTransform(dtype=args.dtype)
    samples = [path.read_bytes() for path in sorted(places["images"].rglob("*.jpg"))[:200]]
    decoders = decoder_timings(samples, DECODE_SIZE, args.repeats)
    built = {arm: build_arm(arm, places, transform, remote) for arm in arms}
    link = None
    if remote is not None:
        evict([s for s in places["records"].glob("*.tfrecord")])
        rate = link_rate(remote, places["records"])
        record_bytes = sum(f.stat().st_size for f in places["records"].glob("*.tfrecord")) / args.images
        link = {"bytes_per_s": rate, "images_per_s": rate / record_bytes}
    rates: dict[str, dict[str, list[float]]] = {arm: {c: [] for c in caches} for arm in arms}
    startup: dict[str, dict[str, list[float]]] = {arm: {c: [] for c in caches} for arm in arms}
    with progress("bench data", args.repeats * len(arms) * len(caches)) as report:
        for repeat in range(args.repeats):  # interleaved, so drifts of the machine hit every arm alike
            for arm in arms:
                make, files = built[arm]
                for cache in caches:
                    dataset = make()
                    report.start(f"{arm}, {cache} cache, repeat {repeat + 1}/{args.repeats}")
                    if cache == "cold":
                        evict(files)
                    elif "cold" not in caches and not rates[arm]["warm"]:
                        images_per_second(dataset, args.workers, args.batch_size, repeat)  # fill the cache first
                    # (warm after cold: the cold pass has just read every file into the cache)
                    rate, seconds = images_per_second(dataset, args.workers, args.batch_size, repeat)
                    rates[arm][cache].append(rate)
                    startup[arm][cache].append(seconds)
                    report.done(f"{rate:.0f} images/s")
    summary = {arm: {c: statistics.median(v) for c, v in per.items()} for arm, per in rates.items()}
    ratios = None
    if "files" in arms:  # the median of the per-repeat ratios: each repeat's arms ran side by side
        ratios = {
            arm: {c: statistics.median(a / b for a, b in zip(rates[arm][c], rates["files"][c])) for c in caches}
            for arm in arms
        }
    spread = {arm: {c: [min(v), max(v)] for c, v in per.items()} for arm, per in rates.items()}
    report = {
        **report_header("data", args),
        "decode_ms_per_image": decoders,
        "rates": rates,
        "median": summary,
        "min_max": spread,
        "ratio_to_files": ratios,
        "seconds_to_first_batch": startup,
        "link": link,
    }
    _print_tables(decoders, summary, ratios, caches, args)
    if link is not None:
        print(
            f"the store through its proxy ({args.latency_ms:g} ms each way): {link['bytes_per_s'] / 1e6:.0f} MB/s, "
            f"{link['images_per_s']:.0f} images/s of packed records"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


def _print_tables(
    decoders: dict[str, dict[str, float]],
    summary: dict[str, dict[str, float]],
    ratios: dict[str, dict[str, float]] | None,
    caches: list[str],
    args: argparse.Namespace,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sizes = list(next(iter(decoders.values())))
    table = Table(title=f"JPEG decode, ms per image, one process, median of {args.repeats}")
    table.add_column("decoder")
    for size in sizes:
        table.add_column(size, justify="right")
    for name, per in decoders.items():
        table.add_row(name, *(f"{per[s]:.2f}" for s in sizes))
    console.print(table)
    table = Table(
        title=f"images/s, {args.images} images, {args.workers} workers, {args.dtype} tensors, median of {args.repeats}"
    )
    table.add_column("arm")
    for cache in caches:
        table.add_column(f"{cache} images/s", justify="right")
        table.add_column(f"{cache} vs files", justify="right")
    for arm, per in summary.items():
        cells = []
        for cache in caches:
            cells += [f"{per[cache]:.0f}", f"{ratios[arm][cache]:.2f}x" if ratios else "-"]
        table.add_row(arm, *cells)
    console.print(table)
