"""`trainaccel bench quality`: time to a target validation loss on real tasks, every arm side by side.

Each arm trains the same task from the same initial model for the same number of steps; arms are
interleaved over repeats, and each repeat has its own seed. Reported per arm: training seconds,
final validation loss and accuracy, quality against plain DDP, time to the target loss (plain
DDP's final loss in the same repeat plus the tolerance), speedup against plain DDP and share of the no-communication
ceiling, both paired by repeat.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainaccel.bench.emulate import HELP as EMULATE_HELP
from trainaccel.bench.emulate import EmulatedCluster, Emulation
from trainaccel.bench.jobs import (
    describe_workers,
    interleaved_or_exit_code,
    print_auto_lines,
    report_header,
    run_workers,
)
from trainaccel.bench.peers import PEER_ARMS, is_peer_variant, parse_peer_variant, run_torchft, torchft_settings
from trainaccel.bench.plot import ARM_WORDS, plot_quality
from trainaccel.bench.tasks import TASKS, task_flags
from trainaccel.bench.train import arm_settings, parse_arms, parse_variant
from trainaccel.bench.worker import ARMS, CEILINGS
from trainaccel.config import Config, ConfigError
from trainaccel.launch.local import TORCHRUN, TRAINACCEL_RUN, plain_env

WORKER_MODULE = "trainaccel.bench.quality_worker"
# A lossy arm keeps quality when its final validation loss is within this of plain DDP's.
TOLERANCE = 0.02
# Arms of this bench only (run with --arms): zero-code trainaccel with these options, sync_scope as auto picks.
OWN_ARMS = {"auto": {"sync_every": "auto"}}
LABELS = {"auto": "trainaccel run --sync-every auto"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="text", choices=list(TASKS), help="what to train (default text)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the task's, 300)")
    parser.add_argument("--batch-size", type=int, help="examples per worker per step (default: the task's)")
    parser.add_argument("--eval-every", type=int, help="validate every N steps (default: steps / 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved (default 3)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="local workers (default 2)")
    parser.add_argument(
        "--arms",
        help=f"comma-separated subset of {', '.join((*ARMS, *OWN_ARMS, *PEER_ARMS))} (default all but torch-bf16 on "
        "CPU, where torch's bf16 hook refuses to run, auto: zero-code sync_every=auto, which picks H, fragments, "
        "overlap and the outer codec, and torchft: torchft's DiLoCo at the trainaccel arm's --sync-every, "
        "--sync-fragments, --sync-overlap (its fragment_sync_delay), --sync-scope and --outer-* options, needs "
        "trainaccel[peers])",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:OPTIONS",
        help="an extra trainaccel arm with its own options, e.g. 'topk:compression=topk', or a torchft arm: "
        "'torchft-d1:sync_every=10,sync_fragments=2,sync_overlap=1,fragment_update_alpha=0.5' (repeatable)",
    )
    parser.add_argument(
        "--emulate",
        metavar="SPEC",
        help=EMULATE_HELP,
    )
    parser.add_argument(
        "--lose",
        action="append",
        default=[],
        metavar="ARM:NODE@STEP",
        help="in arm ARM, node NODE's workers are killed (SIGKILL) before step STEP, e.g. 'continue:2@100' with "
        "--variant continue:sync_every=auto,on_lost_replica=continue (repeatable; needs --emulate)",
    )
    parser.add_argument(
        "--rejoin",
        action="append",
        default=[],
        metavar="ARM",
        help="in arm ARM (one with --lose), the lost node's trainaccel run is started again as soon as it ended: "
        "its worker rejoins the others at their next round's end; every replica's final parameters are compared "
        "(repeatable)",
    )
    parser.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="ARM@STEP",
        help="in arm ARM (one with sync_every and on_lost_replica=continue), the job starts without the emulated "
        "cluster's last node (trainaccel run --nnodes N-1:N, needs --emulate ...,store=etcd), which starts when the "
        "others reach step STEP and joins at their next round's end; STEP 'never': it never does, the job that could "
        "have grown (repeatable)",
    )
    parser.add_argument(
        "--restart",
        action="append",
        default=[],
        metavar="ARM",
        help="in arm ARM (one with --lose and on_lost_replica=stop), the job saves a checkpoint at each validation "
        "and every worker is started again from it after the loss (torchrun's --max-restarts 1): today's way back "
        "(repeatable)",
    )
    parser.add_argument(
        "--keep-global-batch",
        action="append",
        default=[],
        metavar="ARM",
        help="in arm ARM, each worker's batch at each step is the job's (--batch-size x workers) over the workers "
        "present (`trainaccel.comm.members`): after a loss the survivors read the lost worker's share, as a script "
        "that keeps its global batch does (repeatable)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results, loss curves included, as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the validation loss curves (needs trainaccel[plot])")
    Config.add_arguments(parser, suffix=" (trainaccel arm)")


def _check(args: argparse.Namespace) -> None:
    task = TASKS[args.task]
    args.steps = task.steps if args.steps is None else args.steps
    args.batch_size = task.batch_size if args.batch_size is None else args.batch_size
    args.eval_every = max(1, args.steps // 10) if args.eval_every is None else args.eval_every
    for flag in ("steps", "batch_size", "eval_every", "repeats", "nproc_per_node"):
        if getattr(args, flag) < 1:
            raise ValueError(f"invalid --{flag.replace('_', '-')} {getattr(args, flag)}; accepted: an integer >= 1")


def parse_losses(
    args: argparse.Namespace, arm_options: dict[str, dict[str, str]], nodes: int, store: str = "agent"
) -> dict:
    """--lose ARM:NODE@STEP flags as {arm: (node, step)}, each checked against the arms and the run (node 0 only
    with the store on etcd: by default the store lives there)."""
    losses = {}
    first = 0 if store == "etcd" else 1
    held = "" if first == 0 else " (node 0 holds the store: lose it under --emulate ...,store=etcd)"
    accepted = (
        f"ARM:NODE@STEP with ARM one of {', '.join(arm_options)}, NODE in {first}..{nodes - 1}{held} and STEP in "
        f"1..{args.steps}"
    )
    for text in args.lose:
        arm, _, where = text.rpartition(":")
        node, _, step = where.partition("@")
        if arm not in arm_options or not node.isdigit() or not step.isdigit():
            raise ValueError(f"invalid --lose {text!r}; accepted: {accepted}")
        if not first <= int(node) < nodes or not 1 <= int(step) <= args.steps:
            raise ValueError(f"invalid --lose {text!r}; accepted: {accepted}")
        if arm_options[arm].get("on_lost_replica") != "continue" and arm not in args.restart:
            raise ValueError(
                f"invalid --lose {text!r}: arm {arm} does not go on without a lost replica; accepted: an arm with "
                "on_lost_replica=continue (and sync_every) among its options, or an arm given to --restart"
            )
        losses[arm] = (int(node), int(step))
    for arm in args.restart:
        if arm not in losses or arm_options[arm].get("on_lost_replica") == "continue":
            raise ValueError(
                f"invalid --restart {arm!r}; accepted: an arm given to --lose whose on_lost_replica is stop"
            )
    for arm in args.rejoin:
        if arm not in losses:
            raise ValueError(
                f"invalid --rejoin {arm!r}; accepted: an arm given to --lose ({', '.join(losses) or 'none'})"
            )
    for arm in args.keep_global_batch:
        if arm not in arm_options:
            raise ValueError(
                f"invalid --keep-global-batch {arm!r}; accepted: one of the arms, {', '.join(arm_options)}"
            )
    return losses


def parse_joins(
    args: argparse.Namespace, arm_options: dict[str, dict[str, str]], emulation: Emulation | None
) -> dict[str, int]:
    """--join ARM@STEP flags as {arm: step} (0: never), each checked against the arms and the run."""
    joins = {}
    accepted = "ARM@STEP with ARM a trainaccel arm and STEP in 1 to --steps - 1, or never"
    for text in args.join:
        arm, _, step = text.rpartition("@")
        if arm not in arm_options or arm in ARMS or not (step == "never" or step.isdigit()):
            raise ValueError(f"invalid --join {text!r}; accepted: {accepted} (arms: {', '.join(arm_options)})")
        if step != "never" and not 1 <= int(step) < args.steps:
            raise ValueError(f"invalid --join {text!r}; accepted: {accepted}")
        config = Config.resolve(env={}, flags=arm_options[arm])
        if not config.sync_every or config.on_lost_replica != "continue":
            raise ValueError(
                f"invalid --join {text!r}: arm {arm} has no sync_every with on_lost_replica=continue, which a node "
                "joining needs"
            )
        if emulation is None or emulation.store != "etcd":
            raise ValueError(f"invalid --join {text!r}: a job grows with its store on etcd (--emulate ...,store=etcd)")
        if arm in args.rejoin or any(t.rpartition(":")[0] == arm for t in args.lose):
            raise ValueError(f"invalid --join {text!r}: arm {arm} also loses a node; one scenario per arm")
        joins[arm] = 0 if step == "never" else int(step)
    return joins


def _run_arm(
    arm: str,
    args: argparse.Namespace,
    options: dict[str, str],
    out: Path,
    cluster: EmulatedCluster | None,
    port: int,
    seed: int,
    loss: tuple[int, int] | None = None,
    rejoin: bool = False,
    restart: bool = False,
    global_batch: int | None = None,
    join: int | None = None,
) -> dict:
    if arm == "trainaccel":
        launcher, env = TRAINACCEL_RUN, {**os.environ, **Config.resolve(env={}, flags=options).to_env(options)}
    else:
        launcher, env = TORCHRUN, plain_env()
    worker = [
        "-m",
        WORKER_MODULE,
        f"--arm={arm}",
        *task_flags(args, seed, out),
    ]
    if loss is not None:
        worker += [f"--lose-node={loss[0]}", f"--lose-at={loss[1]}"]
    join_when = None
    if join is not None:  # the last node starts once rank 0 has reached the step (0: never)
        marker = out.with_suffix(".join")
        worker += ["--compare-replicas", *([f"--join-at={join}", f"--join-marker={marker}"] if join else [])]
        join_when = marker.exists
    if global_batch is not None:
        worker.append(f"--global-batch={global_batch}")
    if restart:  # every worker started again from the job's last checkpoint after the loss
        (checkpoint := out.with_suffix(".checkpoint")).mkdir(exist_ok=True)
        worker.append(f"--checkpoint={checkpoint}")
        launcher = [*launcher, "--max-restarts=1"]
    lost_node = None if loss is None else loss[0]
    began = time.monotonic()
    result = run_workers(
        f"arm {arm}",
        launcher,
        worker,
        out,
        env,
        nproc_per_node=args.nproc_per_node,
        cluster=cluster,
        port=port,
        lost_node=lost_node,
        rejoin=rejoin,
        join_when=join_when,
    )
    result["wall_seconds"] = time.monotonic() - began  # start to end: restarts and validations included
    if loss is not None or join is not None:  # every replica's end: equal, for those present at the last sync
        ends = [json.loads(path.read_text()) for path in sorted(out.parent.glob(f"{out.name}.rank*"))]
        result["replicas"] = ends
        result["replicas_equal"] = len({e["parameters_sha256"] for e in ends}) == 1
    return result


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first validation after step 0 whose loss is at most `target`; None if none is."""
    return next((seconds for step, seconds, loss, _ in curve if step > 0 and loss <= target), None)


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per arm; speedups and shares are paired by repeat, then the median taken."""
    # The ceiling: one replica per node never syncing across (node-local), where it ran, else no exchange at all.
    base, local = runs.get("baseline"), runs.get("node-local") or runs.get("local")
    # Each repeat has its own seed: its target is that repeat's plain DDP final loss plus the tolerance.
    targets = [b["final_validation_loss"] * (1 + TOLERANCE) for b in base] if base else None
    summary = {}
    for arm, results in runs.items():
        entry = {
            "seconds": [r["seconds"] for r in results],
            "median_seconds": statistics.median(r["seconds"] for r in results),
            "validation_loss": statistics.median(r["final_validation_loss"] for r in results),
            "validation_accuracy": statistics.median(r["final_validation_accuracy"] for r in results),
            "bytes_per_step": results[-1]["bytes_per_step"],
            "comm_hook": results[-1]["comm_hook"],
            "parameters": results[-1]["parameters"],
            "curves": [r["curve"] for r in results],
        }
        if all("wall_seconds" in r for r in results):  # (results of an older version have none)
            entry["median_wall_seconds"] = statistics.median(r["wall_seconds"] for r in results)
        if any("replicas_equal" in r for r in results):  # a node lost: did every replica at the end end equal?
            entry["replicas_equal"] = all(r.get("replicas_equal") for r in results)
            entry["replicas"] = [r.get("replicas", []) for r in results]
        if any(r.get("auto_settings") for r in results):
            entry["auto_settings"] = [r.get("auto_settings", []) for r in results]  # per repeat, as logged
        if base:
            entry["loss_vs_baseline"] = statistics.median(
                r["final_validation_loss"] / b["final_validation_loss"] - 1 for r, b in zip(results, base)
            )
            entry["keeps_quality"] = arm in CEILINGS or entry["loss_vs_baseline"] <= TOLERANCE
            entry["target_loss"] = targets
            reached = [time_to(r["curve"], t) for r, t in zip(results, targets)]
            entry["seconds_to_target"] = reached
            if all(t is not None for t in reached):
                entry["median_seconds_to_target"] = statistics.median(reached)
                base_reached = [time_to(b["curve"], t) for b, t in zip(base, targets)]
                entry["speedup_to_target"] = statistics.median(b / t for b, t in zip(base_reached, reached))
            entry["speedup"] = statistics.median(b["seconds"] / r["seconds"] for r, b in zip(results, base))
        if local:
            entry["share_of_ceiling"] = statistics.median(c["seconds"] / r["seconds"] for r, c in zip(results, local))
        summary[arm] = entry
    return summary


def render(summary: dict[str, dict], title: str, metric: str, labels: dict[str, str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = ["arm", "seconds", "vs baseline", "of ceiling", "val loss", "loss vs baseline", metric]
    columns += ["to target", "speedup to target", "sent/step"]
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right", no_wrap=column == "arm")
    for arm, s in summary.items():
        ratio, share, delta = s.get("speedup"), s.get("share_of_ceiling"), s.get("loss_vs_baseline")
        to_target = s.get("median_seconds_to_target")
        local = arm in CEILINGS
        table.add_row(
            labels.get(arm) or ARM_WORDS.get(arm, arm),
            f"{s['median_seconds']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if share is None else f"{share:.0%}",
            f"{s['validation_loss']:.4f}",
            "-" if delta is None or local else f"{delta:+.1%}",
            f"{s['validation_accuracy']:.1%}",
            "-" if local or delta is None else ("not reached" if to_target is None else f"{to_target:.1f} s"),
            "-" if local or s.get("speedup_to_target") is None else f"{s['speedup_to_target']:.2f}x",
            "-" if s["bytes_per_step"] is None else f"{s['bytes_per_step'] / 2**20:.2f} MiB",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    print_auto_lines(console, summary)


def _batches(replicas: list[list[dict]]) -> str:
    """The survivors' batches per worker, when they changed (--keep-global-batch): '; batch per worker 4 -> 6 (changed
    at steps 101 to 105)'."""
    ends = [e for repeat in replicas for e in repeat if len(e.get("batch_sizes", [])) > 1]
    if not ends:
        return ""
    sequences = sorted({" -> ".join(str(size) for _, size in e["batch_sizes"]) for e in ends})
    steps = [step for e in ends for step, _ in e["batch_sizes"][1:]]
    return f"; batch per worker {', '.join(sequences)} (changed at steps {min(steps)} to {max(steps)})"


def main(args: argparse.Namespace, show: Callable[[dict[str, dict], str, str, dict[str, str]], None] = render) -> int:
    """Run the arms; `show(summary, title, metric, labels)` prints the table (the demo passes its own)."""
    try:
        _check(args)
        accepted = (*ARMS, *OWN_ARMS, *PEER_ARMS)
        arms = parse_arms(args.arms, accepted) if args.arms is not None else parse_arms(None, ARMS)
        peer_variants = dict(parse_peer_variant(v) for v in args.variant if is_peer_variant(v))
        if len(peer_variants) != sum(map(is_peer_variant, args.variant)):
            raise ValueError("each --variant needs its own label")
        args = argparse.Namespace(**{**vars(args), "variant": [v for v in args.variant if not is_peer_variant(v)]})
        for variant in args.variant:  # a peer's arm name is not a trainaccel variant's label
            parse_variant(variant, reserved=(*ARMS, *PEER_ARMS))
        arm_options, config, options, emulation = arm_settings(args, arms)
        arm_options.update(peer_variants)  # (a torchft variant's options are its own, as a trainaccel variant's)
        peer = {
            arm: torchft_settings(arm_options[arm]) for arm in arm_options if arm in PEER_ARMS or arm in peer_variants
        }
        named = {text.rpartition(":")[0] for text in args.lose} | {*args.rejoin, *args.restart, *args.keep_global_batch}
        named |= {text.rpartition("@")[0] for text in args.join}
        if named & set(peer):
            raise ValueError("the torchft arm takes no --lose, --join, --rejoin, --restart or --keep-global-batch")
        labels = {}
        for arm, own in OWN_ARMS.items():  # a --variant of the same label is the user's own arm
            if arm in arms and arm not in {v.partition(":")[0].strip() for v in args.variant}:
                arm_options[arm], labels[arm] = {**arm_options[arm], **own}, LABELS[arm]
        if args.lose and emulation is None:
            raise ValueError("--lose needs --emulate: a node to lose")
        losses = parse_losses(
            args,
            arm_options,
            emulation.nodes if emulation is not None else 0,
            emulation.store if emulation else "agent",
        )
        joins = parse_joins(args, arm_options, emulation)
        task = TASKS[args.task]
        task.load()  # its data is there (or the error says what to install) before any worker starts
    except (ValueError, ConfigError, RuntimeError) as e:
        print(f"trainaccel bench quality: error: {e}", file=sys.stderr)
        return 2
    workers = emulation.workers if emulation is not None else args.nproc_per_node

    def run_one(arm: str, out: Path, cluster: EmulatedCluster | None, port: int, repeat: int) -> dict:
        # Each repeat its own seed (initial model and batches), the same for every arm in it: a
        # codec's loss is compared with plain DDP's on the same draw, and the medians span seeds.
        if arm in peer:
            return run_torchft(args, peer[arm], out, cluster, port, seed=repeat)
        return _run_arm(
            arm if arm in ARMS else "trainaccel",
            args,
            arm_options[arm],
            out,
            cluster,
            port,
            seed=repeat,
            loss=losses.get(arm),
            rejoin=arm in args.rejoin,
            restart=arm in args.restart,
            global_batch=args.batch_size * workers if arm in args.keep_global_batch else None,
            join=joins.get(arm),
        )

    runs, code = interleaved_or_exit_code(
        "quality",
        f"bench quality {args.task}",
        list(arm_options),
        args.repeats,
        emulation,
        run_one,
        lambda result: (
            f"{result['seconds']:.1f} s, validation loss {result['final_validation_loss']:.4f}, "
            f"{task.metric} {result['final_validation_accuracy']:.1%}"
        ),
    )
    if runs is None:
        return code
    summary = summarize(runs)
    title = (
        f"bench quality {args.task}: {args.steps} steps, {describe_workers(emulation, args.nproc_per_node)} x batch "
        f"{args.batch_size}, "
        f"median of {args.repeats}; target loss = plain DDP's + {TOLERANCE:.0%}"
        + (f"; trainaccel {' '.join(f'{k}={v}' for k, v in options.items())}" if options else "")
    )
    show(summary, title, task.metric, labels)
    for arm, s in summary.items():
        if "replicas" in s:
            rejoined = sorted({e["rejoined_at"] for ends in s["replicas"] for e in ends if e["rejoined_at"]})
            resumed = sorted({e["from_step"] for ends in s["replicas"] for e in ends if not e["rejoined_at"]} - {0})
            print(
                f"{arm}: {sum(len(ends) for ends in s['replicas'])} replica end(s) over {args.repeats} repeat(s), "
                f"{'all equal' if s['replicas_equal'] else 'NOT equal'}; "
                f"{s.get('median_wall_seconds', float('nan')):.1f} s from start to end"
                + (f"; {'re' * (arm not in joins)}joined at step {', '.join(map(str, rejoined))}" if rejoined else "")
                + (f"; resumed from the checkpoint of step {', '.join(map(str, resumed))}" if resumed else "")
                + _batches(s["replicas"])
            )
    if args.plot:
        plot_quality(summary, title, args.plot, {arm: arm_options[arm] for arm in summary if arm not in ARMS})
    if args.json:
        report = {
            **report_header("quality", args),
            "task": task.description,
            "tolerance": TOLERANCE,
            "trainaccel_config": config.describe(),
            "arm_options": {arm: arm_options[arm] for arm in runs if arm not in ARMS or arm == "trainaccel"},
            "arms": summary,
        }
        if peer:  # the peers' releases, beside torch's in the header
            report["machine"]["torchft"] = importlib.metadata.version("torchft")
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
