"""`trainaccel demo`: plain DDP against trainaccel, on an emulated slow link when it can build one.

As root with iproute2 (and scikit-learn for the data), it runs `bench quality`'s digits task on 2 emulated nodes of
one worker each, joined by a 500 Mbit/s link: time and validation loss per arm, `--sync-every auto` first.
Elsewhere it trains a small DDP script on local CPU workers over loopback, under plain torchrun and under
trainaccel, and names the command that shows the gain.
"""

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
LOOPBACK_STEPS, SLOW_LINK_STEPS = 150, 200
# One worker per emulated node: on a small machine two workers of a node would share a core, and the demo would
# measure the core instead of the link that a cluster's nodes have between them.
SLOW_LINK = "nodes=2,procs-per-node=1,link=500mbit"
# trainaccel's zero-code choice first, then the strongest honest baseline (torch's own fp16 hook), plain DDP and no
# communication at all (the ceiling): one run each, about two minutes in all.
SLOW_LINK_ARMS = "auto,torch-fp16,baseline,local"
SLOW_LINK_ARGS = ["--task", "digits", "--repeats", "1", "--arms", SLOW_LINK_ARMS]
SLOW_LINK_COMMAND = f"sudo trainaccel bench quality --task digits --emulate {SLOW_LINK} --arms {SLOW_LINK_ARMS}"
OWN_SCRIPT_COMMAND = "trainaccel run --nproc-per-node 8 --sync-every auto --metrics-every 100 train.py"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    launcher: list[str]
    options: dict[str, str]


ARMS = [
    Arm("plain DDP (torchrun)", TORCHRUN, {}),
    Arm("trainaccel run", TRAINACCEL_RUN, {}),
    Arm("trainaccel run --compression fp16", TRAINACCEL_RUN, {"compression": "fp16"}),
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

    steps = args.steps or SLOW_LINK_STEPS
    # Plain prints for the prose: the terminal wraps it, and the closing command stays on one line to copy.
    print(
        f"trainaccel demo: one DDP script, unchanged, trains a small image classifier (UCI handwritten digits, {steps} "
        "steps) on 2 emulated nodes of one worker each, joined by a 500 Mbit/s link, four ways: under "
        "`trainaccel run --sync-every auto`, with torch's own fp16 hook, as plain DDP, and with no communication at "
        f"all (the ceiling). One run each, about {30 + steps * 0.4:.0f} seconds in all.\n"
    )
    parser = argparse.ArgumentParser(prog="trainaccel demo")
    quality.add_arguments(parser)
    argv = [*SLOW_LINK_ARGS, "--steps", str(steps), "--emulate", SLOW_LINK]
    argv += ["--json", args.json] if args.json else []
    code = quality.main(parser.parse_args(argv), show=_show)
    if code == 0:
        print(
            "\nThe same job with repeats and medians, and other settings: `trainaccel bench quality` "
            "(docs/results.md). Your own script, with its examples/s and step time logged every 100 steps:\n"
            f"  {OWN_SCRIPT_COMMAND}"
        )
    return code


def _show(summary: dict[str, dict], title: str, metric: str, labels: dict[str, str]) -> None:
    """The demo's table: each arm in words, its time beside plain DDP's and the ceiling's, and its loss."""
    from rich.console import Console
    from rich.table import Table

    from trainaccel.bench.plot import arm_words
    from trainaccel.bench.quality import print_auto_lines

    table = Table(title=title)
    columns = ("arm", "seconds", "vs plain DDP", "of the ceiling", "validation loss", "vs plain DDP's", "sent/step")
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right", no_wrap=column == "arm")
    for arm, s in summary.items():
        ratio, share, delta = s.get("speedup"), s.get("share_of_ceiling"), s.get("loss_vs_baseline")
        table.add_row(
            labels.get(arm) or arm_words(arm),
            f"{s['median_seconds']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if share is None else f"{share:.0%}",
            f"{s['validation_loss']:.4f}",
            "-" if delta is None or arm == "local" else f"{delta:+.1%}",
            "-" if s["bytes_per_step"] is None else f"{s['bytes_per_step'] / 2**20:.2f} MiB",
        )
    console = Console(width=max(120, Console().width))  # the arms' names in one line each
    console.print(table)
    print_auto_lines(console, summary)
    print(
        "seconds: training time (validation excluded); of the ceiling: the no-communication run's time over the "
        "arm's; sent/step: bytes each worker sends per step. sync_every=auto changes what is trained (each node "
        "steps alone between syncs), so compare its validation loss with plain DDP's."
    )


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
    table = Table(title=f"trainaccel demo: {results[0]['world_size']} local CPU workers, Gloo, over loopback")
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
        "The same DDP script, unchanged, under each launcher.\n"
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
    print(
        f"trainaccel demo: one DDP script, unchanged, trains {args.steps} steps on {args.nproc_per_node} local CPU "
        f"workers three ways ({', '.join(arm.name for arm in ARMS)}); about {10 * len(ARMS)} seconds."
    )
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
