"""`trainaccel demo`: the same DDP script on local CPU workers, under plain torchrun and under trainaccel."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from trainaccel.launch.local import TORCHRUN, TRAINACCEL_RUN, run_job

WORKER_MODULE = "trainaccel.demo.worker"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    launcher: list[str]
    options: dict[str, str]


ARMS = [
    Arm("plain DDP", TORCHRUN, {}),
    Arm("trainaccel", TRAINACCEL_RUN, {}),
    Arm("trainaccel fp16", TRAINACCEL_RUN, {"compression": "fp16"}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=2, help="local CPU workers (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps per arm (default 150)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per worker per step (default 64)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _check(args: argparse.Namespace) -> str | None:
    if args.nproc_per_node < 1:
        return f"invalid --nproc-per-node {args.nproc_per_node}; accepted: an integer >= 1"
    if args.batch_size < 1:
        return f"invalid --batch-size {args.batch_size}; accepted: an integer >= 1"
    if not 0 <= args.warmup < args.steps:
        return f"invalid --steps {args.steps} / --warmup {args.warmup}; accepted: 0 <= warmup < steps"
    return None


def run_arm(arm: Arm, args: argparse.Namespace, out: Path) -> dict:
    """Train once under this arm's launcher; returns rank 0's measured figures (also left in `out`)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in arm.options.items()]
    command = [
        *arm.launcher,
        "--standalone",
        f"--nproc-per-node={args.nproc_per_node}",
        *flags,
        "-m",
        WORKER_MODULE,
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch-size={args.batch_size}",
        f"--out={out}",
    ]
    started = time.perf_counter()
    result = run_job(f"arm {arm.name!r}", command, out)
    result.update(arm=arm.name, command=command, wall_s=time.perf_counter() - started)
    return result


def render(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = results[0]["examples_per_s_per_worker"]
    table = Table(title=f"trainaccel demo: {results[0]['world_size']} local CPU workers, Gloo")
    for column in (
        "arm",
        "examples/s per worker",
        "vs plain DDP",
        "final loss",
        "bytes sent/step",
        "replicas identical",
    ):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for r in results:
        table.add_row(
            r["arm"],
            f"{r['examples_per_s_per_worker']:.0f}",
            f"{r['examples_per_s_per_worker'] / base:.2f}x",
            f"{r['final_loss']:.4f}",
            f"{r['bytes_per_step'] / 2**20:.2f} MiB",
            "yes" if r["replica_max_abs_diff"] == 0 else f"no (max diff {r['replica_max_abs_diff']:.2e})",
        )
    console = Console()
    console.print(table)
    console.print(
        "Same DDP script, unchanged: plain DDP = torchrun; trainaccel = trainaccel run (defaults); "
        "trainaccel fp16 = trainaccel run --compression fp16.\n"
        "bytes sent/step: allreduce payload each worker hands to the network per step. "
        "Workers share this machine's cores over loopback, where bandwidth is not the bottleneck; "
        "one run each, so rerun for spread."
    )


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    problem = _check(args)
    if problem:
        print(f"trainaccel demo: error: {problem}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="trainaccel-demo-") as tmp:
        for i, arm in enumerate(ARMS, 1):
            with console.status(f"[{i}/{len(ARMS)}] {arm.name}: {args.steps} steps on {args.nproc_per_node} workers"):
                try:
                    results.append(run_arm(arm, args, Path(tmp) / f"arm{i}.json"))
                except RuntimeError as e:
                    print(f"trainaccel demo: error: {e}", file=sys.stderr)
                    return 1
    render(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"arms": results}, indent=2))
    return 0
