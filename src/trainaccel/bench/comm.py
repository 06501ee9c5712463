"""`trainaccel bench comm`: allreduce bus bandwidth over a sweep of message sizes, per codec."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from trainaccel.bench.emulate import HELP as EMULATE_HELP
from trainaccel.bench.emulate import EmulationError, parse_emulate
from trainaccel.bench.jobs import bench_session, report_header, run_workers
from trainaccel.bench.plot import check_available, plot_comm
from trainaccel.bench.progress import progress
from trainaccel.config import Config, ConfigError
from trainaccel.launch.local import TORCHRUN, plain_env

WORKER_MODULE = "trainaccel.bench.comm_worker"
_SIZE = re.compile(r"^(\d+)(B|KiB|MiB|GiB)?$")
_UNITS = {"B": 1, None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_sizes(text: str) -> list[int]:
    """`64KiB,1MiB,16MiB` -> bytes; each a positive multiple of 4 (float32 elements)."""
    sizes = []
    for item in text.split(","):
        m = _SIZE.match(item.strip())
        size = int(m.group(1)) * _UNITS[m.group(2)] if m else 0
        if size <= 0 or size % 4:
            raise ValueError(
                f"invalid size {item.strip()!r} in --sizes; accepted: N, NKiB, NMiB or NGiB, a multiple of 4 bytes"
            )
        sizes.append(size)
    return sizes


def _human(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB,64MiB", help="message sizes (default 4KiB..64MiB)")
    parser.add_argument("--compression", default="none,fp16", help="comma-separated codecs (default none,fp16)")
    parser.add_argument(
        "--iters", type=int, default=5, help="timed allreduces per size; the median is kept (default 5)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed allreduces per size (default 1)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="local workers without --emulate (default 2)")
    parser.add_argument("--emulate", metavar="SPEC", help=EMULATE_HELP)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write bus bandwidth vs size (needs trainaccel[plot])")


def main(args: argparse.Namespace) -> int:
    try:
        sizes = parse_sizes(args.sizes)
        codecs = [c.strip() for c in args.compression.split(",")]
        for codec in codecs:
            Config.resolve(env={}, compression=codec)
        if args.iters < 1 or args.warmup < 0 or args.nproc_per_node < 1:
            raise ValueError("invalid --iters/--warmup/--nproc-per-node; accepted: iters >= 1, warmup >= 0, nproc >= 1")
        emulation = parse_emulate(args.emulate) if args.emulate else None
        if args.plot:
            check_available()
    except (ValueError, ConfigError, RuntimeError) as e:
        print(f"trainaccel bench comm: error: {e}", file=sys.stderr)
        return 2
    try:
        with bench_session(emulation) as (tmp, cluster):
            out = tmp / "comm.json"
            worker = [
                "-m",
                WORKER_MODULE,
                f"--sizes={','.join(map(str, sizes))}",
                f"--compression={','.join(codecs)}",
                f"--iters={args.iters}",
                f"--warmup={args.warmup}",
                f"--out={out}",
            ]
            with progress("bench comm", 1) as report:
                report.start(f"{len(sizes)} sizes x {len(codecs)} codecs, {args.iters} iterations each")
                env, workers = plain_env(), args.nproc_per_node
                result = run_workers("bench comm", TORCHRUN, worker, out, env, nproc_per_node=workers, cluster=cluster)
                report.done(f"{len(result['rows'])} rows measured")
    except (RuntimeError, EmulationError) as e:
        print(f"trainaccel bench comm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainaccel bench comm: interrupted; workers stopped and namespaces removed", file=sys.stderr)
        return 130
    link = emulation.link_bits_per_s / 1e9 if emulation else None
    for row in result["rows"]:
        row["link_gbit_s"] = link
        row["busbw_vs_link"] = row["busbw_gbit_s"] / link if link else None
    title = render(result, emulation.link if emulation else None)
    if args.plot:
        plot_comm(result["rows"], title, args.plot)
    if args.json:
        report = {
            **report_header("comm", args),
            **result,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def render(result: dict, link: str | None) -> str:
    """Print the table; returns its title."""
    from rich.console import Console
    from rich.table import Table

    where = f"emulated link {link}" if link else "this machine, no shaped link"
    title = f"bench comm: allreduce over {result['world_size']} workers, {where}"
    table = Table(title=title)
    for column in ("compression", "size", "time", "algbw Gbit/s", "busbw Gbit/s", "busbw / link"):
        table.add_column(column, justify="left" if column == "compression" else "right")
    for row in result["rows"]:
        ratio = row["busbw_vs_link"]
        table.add_row(
            row["compression"],
            _human(row["size_bytes"]),
            f"{row['time_s'] * 1e3:.2f} ms",
            f"{row['algbw_gbit_s']:.3f}",
            f"{row['busbw_gbit_s']:.3f}",
            "-" if ratio is None else f"{ratio:.2f}",
        )
    Console().print(table)
    return title
