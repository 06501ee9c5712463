"""The `trainaccel` command: run, info, demo, bench, pack."""

from __future__ import annotations

import importlib
import sys

from trainaccel import __version__
from trainaccel.argparsing import Parser, refuse

USAGE = """trainaccel {run,info,demo,bench,pack} ...

  run    start a training script with trainaccel (every torchrun flag, plus
         trainaccel options and -np/-H host lists); see `trainaccel run --help`
  info   versions, backends, devices and the resolved configuration
  demo   train a small model on 2 local CPU workers, plain DDP vs trainaccel
  bench  benchmarks: `trainaccel bench quality` (time to a target validation loss
         on real tasks, every arm side by side), `trainaccel bench train`
         (examples/s: baseline, torch's fp16/bf16 hooks, trainaccel, local arms),
         `trainaccel bench comm` (allreduce bandwidth over message sizes),
         `trainaccel bench faults` (each fault on 2 emulated nodes: seconds
         until every process on every node exited),
         `trainaccel bench data` (images/s of input pipelines),
         `trainaccel bench embedding` (lookups/s of embedding training steps)
  pack   image files into indexed TFRecord shards: `trainaccel pack make-list`,
         `trainaccel pack imagefolder`, `trainaccel pack list`, `trainaccel pack coco`
"""

BENCHMARKS = {  # name: (its module, with add_arguments(parser) and main(args); its line in the help)
    "quality": ("trainaccel.bench.quality", "time to a target validation loss on real tasks, arms side by side"),
    "train": ("trainaccel.bench.train", "examples/s per worker: baseline vs trainaccel vs local"),
    "comm": ("trainaccel.bench.comm", "allreduce bus bandwidth over message sizes, per codec"),
    "faults": ("trainaccel.bench.faults", "each fault on 2 emulated nodes: seconds until every process exited"),
    "data": ("trainaccel.bench.data", "images/s: per-file loading vs packed shards, cold and warm cache"),
    "embedding": (
        "trainaccel.bench.embedding",
        "lookups/s: dense and sparse nn.EmbeddingBag, dynamic tables, TorchRec",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # torchrun's parser takes the rest verbatim (REMAINDER after the script).
        from trainaccel.launch.run import main as run_main

        return run_main(argv[1:])
    parser = Parser(prog="trainaccel", usage=USAGE)
    parser.add_argument("--version", action="version", version=f"trainaccel {__version__}")
    # Only the command named (and its benchmark) imports its module for its arguments: the others would load torch
    # and its distributed packages for nothing (`trainaccel --version` in a tenth of a second, not seconds).
    named = argv[:2]
    # prog=: each command's usage and errors name it alone (by default argparse puts the root's usage there)
    commands = parser.add_subparsers(dest="command", metavar="{run,info,demo,bench,pack}", prog="trainaccel")
    commands.add_parser("run", help="start a training script (see `trainaccel run --help`)")
    info = commands.add_parser("info", help="versions, backends, devices and the resolved configuration")
    demo = commands.add_parser("demo", help="plain DDP vs trainaccel on local CPU workers")
    named_parsers = {("info",): info, ("demo",): demo}  # (an unknown flag is reported by its command's parser)
    if named[:1] == ["demo"]:
        importlib.import_module("trainaccel.demo").add_arguments(demo)
    bench = commands.add_parser("bench", help="benchmarks, arms side by side").add_subparsers(
        dest="benchmark", metavar="{" + ",".join(BENCHMARKS) + "}", required=True, prog="trainaccel bench"
    )
    for name, (module, text) in BENCHMARKS.items():
        benchmark = named_parsers["bench", name] = bench.add_parser(name, help=text)
        if named == ["bench", name]:
            importlib.import_module(module).add_arguments(benchmark)
    packing = commands.add_parser("pack", help="image files into indexed TFRecord shards").add_subparsers(
        dest="pack_command", metavar="{make-list,imagefolder,list,coco}", required=True, prog="trainaccel pack"
    )
    if named[:1] == ["pack"]:
        importlib.import_module("trainaccel.data.pack_cli").add_arguments(packing)
        named_parsers.update({("pack", name): sub for name, sub in packing.choices.items()})
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse(
            named_parsers.get(tuple(named), named_parsers.get(tuple(named[:1]), parser)),
            "unrecognized arguments: " + " ".join(unknown),
        )
    if args.command == "pack":
        return importlib.import_module("trainaccel.data.pack_cli").main(args)
    if args.command == "info":
        return importlib.import_module("trainaccel.info").main()
    if args.command == "demo":
        return importlib.import_module("trainaccel.demo").main(args)
    if args.command == "bench":
        return importlib.import_module(BENCHMARKS[args.benchmark][0]).main(args)
    parser.print_usage(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
