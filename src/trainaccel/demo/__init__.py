"""`trainaccel demo`: plain DDP against trainaccel, on an emulated slow link when it can build one.

As root with iproute2 (and scikit-learn for the data), it runs `bench quality`'s smallest task on an
emulated 2 nodes x 2 workers at 500 Mbit/s: time and validation loss per arm. Elsewhere it trains a
small DDP script on local CPU workers over loopback, under plain torchrun and under trainaccel, and
names the command that shows the gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from trainaccel.launch.local import TORCHRUN, TRAINACCEL_RUN, run_job

WORKER_MODULE = "trainaccel.demo.worker"
LOOPBACK_STEPS, SLOW_LINK_STEPS = 150, 200
SLOW_LINK = "nodes=2,procs-per-node=2,link=500mbit"
# Plain DDP, torch's own fp16 hook (the strongest honest baseline), trainaccel zero-code per-step
# (fp16) and every 2 steps (the option that kept quality on the language model), and no
# communication at all (the ceiling), on the digits task: about two minutes in all.
SLOW_LINK_ARGS = ["--task", "digits", "--repeats", "1", "--arms", "baseline,torch-fp16,trainaccel,local"]
SYNC_ARM = "sync-every-2"
SLOW_LINK_OPTIONS = ["--compression", "fp16", "--variant", f"{SYNC_ARM}:sync_every=2,outer_compression=int8"]
SLOW_LINK_COMMAND = f"sudo trainaccel bench quality --task digits --emulate {SLOW_LINK} {' '.join(SLOW_LINK_OPTIONS)}"


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
    parser.add_argument(
        "--steps", type=int, help=f"steps per arm (default {LOOPBACK_STEPS}; {SLOW_LINK_STEPS} on the slow link)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per worker per step (default 64)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--loopback", action="store_true", help="the loopback run even where an emulated slow link can be built"
    )


def _check(args: argparse.Namespace) -> str | None:
    if args.nproc_per_node < 1:
        return f"invalid --nproc-per-node {args.nproc_per_node}; accepted: an integer >= 1"
    if args.batch_size < 1:
        return f"invalid --batch-size {args.batch_size}; accepted: an integer >= 1"
    if args.steps is not None and not 0 <= args.warmup < args.steps:
        return f"invalid --steps {args.steps} / --warmup {args.warmup}; accepted: 0 <= warmup < steps"
    return None


def why_no_slow_link() -> str | None:
    """What this machine lacks for the emulated slow-link demo, or None when it can run it."""
    from trainaccel.bench.emulate import why_not_emulated

    missing = why_not_emulated()
    if missing is not None:
        return f"it needs {missing}"
    try:
        import sklearn  # noqa: F401  (the digits ship with it)
    except ImportError:
        return "its data set ships with scikit-learn: pip install 'trainaccel[bench]'"
    return None


def slow_link(args: argparse.Namespace) -> int:
    """`bench quality`'s digits task on an emulated 2-node slow link: time and validation loss per arm."""
    from trainaccel.bench import quality

    parser = argparse.ArgumentParser(prog="trainaccel demo")
    quality.add_arguments(parser)
    argv = [*SLOW_LINK_ARGS, "--steps", str(args.steps or SLOW_LINK_STEPS), "--emulate", SLOW_LINK]
    argv += [*SLOW_LINK_OPTIONS, *(["--json", args.json] if args.json else [])]
    code = quality.main(parser.parse_args(argv))
    if code == 0:
        print(
            "Same DDP script, unchanged, on 2 emulated nodes x 2 workers at 500 Mbit/s: plain DDP = torchrun; "
            "torch-fp16 = DDP with torch's fp16_compress_hook; trainaccel = trainaccel run --compression fp16; "
            f"{SYNC_ARM} = trainaccel run --sync-every 2 --outer-compression int8 (each node's workers step as "
            "one replica, the nodes' replicas are averaged every 2 steps: it changes what is trained, so compare "
            "the validation losses); local = no communication at all (the ceiling; rank 0's replica alone). "
            "One run each; `trainaccel bench quality` repeats and takes medians."
        )
        cores = os.cpu_count() or 1
        if cores < 4:  # the 4 workers share cores: a per-step hook's threads then wait for one at every handoff
            print(
                f"Here 4 workers share {cores} CPU cores, which costs per-step hooks with threads of their own "
                "more than torch's: docs/BENCHMARKS.md (\"fp16's scale from the peak\") compares trainaccel's fp16 "
                "with torch's hook at one worker per node, where each has a core of its own."
            )
    return code


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
    why = "--loopback was given" if args.loopback else why_no_slow_link()
    if why is None:
        return slow_link(args)
    args.steps = args.steps or LOOPBACK_STEPS
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
    print(f"No emulated slow link here ({why}). Over a slow link the gain shows; this measures it: {SLOW_LINK_COMMAND}")
    if args.json:
        Path(args.json).write_text(json.dumps({"arms": results}, indent=2))
    return 0
