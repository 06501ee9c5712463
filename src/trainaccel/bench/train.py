"""`trainaccel bench train`: baseline, trainaccel and local arms side by side, repeated, medians and ratios."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from trainaccel.bench.emulate import HELP as EMULATE_HELP
from trainaccel.bench.emulate import EmulatedCluster, Emulation, parse_emulate
from trainaccel.bench.jobs import (
    describe_workers,
    interleaved_or_exit_code,
    print_auto_lines,
    report_header,
    run_workers,
)
from trainaccel.bench.models import MODELS
from trainaccel.bench.plot import check_available, plot_train
from trainaccel.bench.recsys import RECSYS_MODELS
from trainaccel.bench.recsys_worker import ARMS as RECSYS_ARMS  # no "local": the embedding exchange is the model
from trainaccel.bench.worker import ARMS, cuda_available
from trainaccel.config import Config, ConfigError
from trainaccel.launch.local import TORCHRUN, TRAINACCEL_RUN, plain_env

WORKER_MODULE = "trainaccel.bench.worker"
RECSYS_WORKER_MODULE = "trainaccel.bench.recsys_worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="resnet50", choices=[*MODELS, *RECSYS_MODELS], help="benchmark model (default resnet50)"
    )
    parser.add_argument("--image-size", type=int, default=224, help="image side for the ResNets (default 224)")
    parser.add_argument("--embedding-dim", type=int, default=16, help="factor dim of deepfm and wide_deep (default 16)")
    parser.add_argument(
        "--max-rows",
        type=int,
        default=1_000_000,
        help="deepfm/wide_deep: Criteo's 26 table sizes capped at this (default 1000000: 5.6M rows)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="examples per worker per step (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="steps per run, warm-up included (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved (default 3)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="local workers (default 2)")
    parser.add_argument(
        "--arms",
        help=f"comma-separated subset of {', '.join(ARMS)} (deepfm, wide_deep: {', '.join(RECSYS_ARMS)}; default all)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:OPTIONS",
        help="an extra trainaccel arm with its own options, e.g. 'fp16+hier:compression=fp16,hierarchical=on' "
        "(repeatable; run interleaved with the other arms)",
    )
    parser.add_argument(
        "--emulate",
        metavar="SPEC",
        help=EMULATE_HELP,
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a bar chart of the arms (needs trainaccel[plot])")
    Config.add_arguments(parser, suffix=" (trainaccel arm)")


def parse_arms(text: str | None, accepted: tuple[str, ...], what: str = "") -> list[str]:
    """`--arms a,b` -> [a, b], each one of `accepted`, none twice; without the flag, every arm that runs here."""
    if text is None:
        # (node-local where asked: on nodes of one worker it is local)
        return [a for a in accepted if (a != "torch-bf16" or cuda_available()) and a != "node-local"]
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in accepted]
    if bad or not arms or len(set(arms)) != len(arms):
        raise ValueError(f"invalid --arms {text!r}{what}; accepted: a comma-separated subset of {', '.join(accepted)}")
    if "torch-bf16" in arms and not cuda_available():
        raise ValueError(
            "arm torch-bf16 needs CUDA and NCCL (torch's bf16_compress_hook refuses Gloo); use torch-fp16 here"
        )
    return arms


def variant_options(label: str, text: str, accepted: tuple[str, ...], unlisted: tuple[str, ...] = ()) -> dict[str, str]:
    """A variant's `opt=value,...` -> {option: value}, each name in `accepted` (or `unlisted`: taken, not named in
    the error); ValueError naming the item and the accepted options otherwise."""
    options: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or name not in (*accepted, *unlisted):
            raise ValueError(
                f"invalid option {item!r} in --variant {label}; accepted: option=value with options "
                f"{', '.join(accepted)}"
            )
        options[name] = value.strip()
    return options


def parse_variant(text: str, reserved: tuple[str, ...] = ARMS) -> tuple[str, dict[str, str]]:
    """`LABEL:opt=value,...` -> (label, options), each option checked as trainaccel checks it."""
    label, sep, rest = text.partition(":")
    label = label.strip()
    if not sep or not label or label in reserved or any(c.isspace() for c in label):
        raise ValueError(
            f"invalid --variant {text!r}; accepted: LABEL:option=value,... with a label other than "
            f"{', '.join(reserved)}"
        )
    options = variant_options(label, rest, Config.option_names())
    try:
        config = Config.resolve(env={}, flags=options)
    except ConfigError as e:
        raise ValueError(f"--variant {label}: {e}") from None
    return label, {name: str(getattr(config, name)) for name in options}


def arm_settings(
    args: argparse.Namespace, arms: list[str]
) -> tuple[dict[str, dict[str, str]], Config, dict[str, str], Emulation | None]:
    """From a bench's flags: each arm's trainaccel options (variants their own), the config, the options
    given as flags, and the emulated cluster if asked for; raises ValueError/ConfigError/RuntimeError."""
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) != len(args.variant):
        raise ValueError("each --variant needs its own label")
    emulation = parse_emulate(args.emulate) if args.emulate else None
    flags = Config.flags_from(args)
    config = Config.resolve(flags=flags)
    if args.plot:
        check_available()
    options = {name: str(getattr(config, name)) for name, raw in flags.items() if raw is not None}
    return {arm: options for arm in arms} | variants, config, options, emulation


def _check(args: argparse.Namespace) -> None:
    for flag in ("image_size", "batch_size", "repeats", "nproc_per_node", "embedding_dim", "max_rows"):
        if getattr(args, flag) < 1:
            raise ValueError(f"invalid --{flag.replace('_', '-')} {getattr(args, flag)}; accepted: an integer >= 1")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"invalid --steps {args.steps} / --warmup {args.warmup}; accepted: 0 <= warmup < steps")


def _run_arm(
    arm: str, args: argparse.Namespace, options: dict[str, str], out: Path, cluster: EmulatedCluster | None, port: int
) -> dict:
    """Run one arm; `arm` is baseline, local, or trainaccel (also for variants, with their options)."""
    if arm == "trainaccel":
        launcher, env = TRAINACCEL_RUN, {**os.environ, **Config.resolve(env={}, flags=options).to_env(options)}
        # Throughput of the codec itself: its exact warm-up steps end within the untimed steps.
        env.setdefault("TRAINACCEL_COMPRESSION_WARMUP", str(max(1, args.warmup)))
    else:
        launcher, env = TORCHRUN, plain_env()
    common = [
        f"--arm={arm}",
        f"--model={args.model}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--out={out}",
    ]
    if args.model in RECSYS_MODELS:
        worker = ["-m", RECSYS_WORKER_MODULE, *common, f"--dim={args.embedding_dim}", f"--max-rows={args.max_rows}"]
    else:
        worker = ["-m", WORKER_MODULE, *common, f"--image-size={args.image_size}"]
    return run_workers(
        f"arm {arm}", launcher, worker, out, env, nproc_per_node=args.nproc_per_node, cluster=cluster, port=port
    )


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Median and spread per arm; ratios to the baseline are paired by repeat, then the median taken."""
    summary = {}
    base, local = runs.get("baseline"), runs.get("local")
    for arm, results in runs.items():
        rates = [r["examples_per_s_per_worker"] for r in results]
        entry = {
            "examples_per_s_per_worker": rates,
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "bytes_per_step": results[-1]["bytes_per_step"],
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in results),
            "model_memory_bytes": max(
                (r["model_memory_bytes"] for r in results if "model_memory_bytes" in r), default=None
            ),
            "comm_hook": results[-1]["comm_hook"],
            "parameters": results[-1]["parameters"],
            "amp": results[-1]["amp"],
            "compiled": results[-1]["compiled"],
            "final_loss": statistics.median(r["final_loss"] for r in results),
        }
        entry.update({k: results[-1][k] for k in ("embedding_rows", "embedding_bytes_per_step") if k in results[-1]})
        if any(r.get("auto_settings") for r in results):
            entry["auto_settings"] = [r.get("auto_settings", []) for r in results]  # per repeat, as logged
        if base:
            entry["ratio_vs_baseline"] = statistics.median(
                r / b["examples_per_s_per_worker"] for r, b in zip(rates, base)
            )
        if local:
            entry["share_of_local"] = statistics.median(
                r / b["examples_per_s_per_worker"] for r, b in zip(rates, local)
            )
        summary[arm] = entry
    return summary


def render(summary: dict[str, dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    # The last step's loss is on that step's synthetic batch: a sign that the arm trained, not its quality.
    caption = "last step's loss: the training loss on that step's synthetic batch; bench quality measures quality"
    table = Table(title=title, caption=caption)
    columns = ["arm", "examples/s per worker", "min - max", "vs baseline", "of local", "bytes sent/step"]
    columns += ["peak memory", "model's memory", "last step's loss"]
    base_memory = summary.get("baseline", {}).get("model_memory_bytes")
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right", no_wrap=column == "arm")
    for arm, s in summary.items():
        ratio, share = s.get("ratio_vs_baseline"), s.get("share_of_local")
        table.add_row(
            arm,
            f"{s['median']:.1f}",
            f"{s['min']:.1f} - {s['max']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if share is None else f"{share:.0%}",
            "-" if s["bytes_per_step"] is None else f"{s['bytes_per_step'] / 2**20:.1f} MiB",
            f"{s['peak_memory_bytes'] / 2**20:.0f} MiB",
            "-"
            if s["model_memory_bytes"] is None
            else f"{s['model_memory_bytes'] / 2**20:.0f} MiB"
            + (f" ({s['model_memory_bytes'] / base_memory:.0%})" if base_memory else ""),
            f"{s['final_loss']:.4f}",
        )
    console = Console(width=max(130, Console().width))
    console.print(table)
    print_auto_lines(console, summary)


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
        recsys = args.model in RECSYS_MODELS
        arms = parse_arms(args.arms, RECSYS_ARMS if recsys else ARMS, f" for {args.model}")
        arm_options, config, options, emulation = arm_settings(args, arms)
    except (ValueError, ConfigError, RuntimeError) as e:
        print(f"trainaccel bench train: error: {e}", file=sys.stderr)
        return 2
    runs, code = interleaved_or_exit_code(
        "train",
        f"bench train {args.model}",
        list(arm_options),
        args.repeats,
        emulation,
        lambda arm, out, cluster, port, repeat: _run_arm(
            arm if arm in ARMS else "trainaccel", args, arm_options[arm], out, cluster, port
        ),
        lambda result: f"{result['examples_per_s_per_worker']:.1f} examples/s per worker",
    )
    if runs is None:
        return code
    summary = summarize(runs)
    workers = describe_workers(emulation, args.nproc_per_node)
    title = f"bench train {args.model}: {workers} x batch {args.batch_size}, median of {args.repeats}" + (
        f"; trainaccel {' '.join(f'{k}={v}' for k, v in options.items())}" if options else ""
    )
    render(summary, title)
    if args.plot:
        plot_train(summary, title, args.plot)
    if args.json:
        report = {
            **report_header("train", args),
            "trainaccel_config": config.describe(),
            "arm_options": {arm: arm_options[arm] for arm in runs if arm not in ("baseline", "local")},
            "arms": summary,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
