"""The `trainaccel` command: run, info, demo, bench, pack."""

from __future__ import annotations

import argparse
import sys

from trainaccel import __version__

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # torchrun's parser takes the rest verbatim (REMAINDER after the script).
        from trainaccel.launch.run import main as run_main

        return run_main(argv[1:])
    parser = argparse.ArgumentParser(prog="trainaccel", usage=USAGE)
    parser.add_argument("--version", action="version", version=f"trainaccel {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{run,info,demo,bench,pack}")
    commands.add_parser("run", help="start a training script (see `trainaccel run --help`)")
    commands.add_parser("info", help="versions, backends, devices and the resolved configuration")
    demo = commands.add_parser("demo", help="plain DDP vs trainaccel on local CPU workers")
    from trainaccel.demo import add_arguments

    add_arguments(demo)
    bench = commands.add_parser("bench", help="benchmarks, arms side by side").add_subparsers(
        dest="benchmark", metavar="{quality,train,comm,faults,data,embedding}", required=True
    )
    from trainaccel.bench.quality import add_arguments as add_quality_arguments

    add_quality_arguments(
        bench.add_parser("quality", help="time to a target validation loss on real tasks, arms side by side")
    )
    from trainaccel.bench.comm import add_arguments as add_comm_arguments
    from trainaccel.bench.train import add_arguments as add_train_arguments

    add_train_arguments(bench.add_parser("train", help="examples/s per worker: baseline vs trainaccel vs local"))
    add_comm_arguments(bench.add_parser("comm", help="allreduce bus bandwidth over message sizes, per codec"))
    from trainaccel.bench.faults import add_arguments as add_faults_arguments

    add_faults_arguments(
        bench.add_parser("faults", help="each fault on 2 emulated nodes: seconds until every process exited")
    )
    from trainaccel.bench.data import add_arguments as add_data_arguments

    add_data_arguments(
        bench.add_parser("data", help="images/s: per-file loading vs packed shards, cold and warm cache")
    )
    from trainaccel.bench.embedding import add_arguments as add_embedding_arguments

    add_embedding_arguments(
        bench.add_parser("embedding", help="lookups/s: dense and sparse nn.EmbeddingBag, dynamic tables, TorchRec")
    )
    packing = commands.add_parser("pack", help="image files into indexed TFRecord shards").add_subparsers(
        dest="pack_command", metavar="{make-list,imagefolder,list,coco}", required=True
    )
    from trainaccel.data.pack_cli import add_arguments as add_pack_arguments

    add_pack_arguments(packing)
    args = parser.parse_args(argv)
    if args.command == "pack":
        from trainaccel.data.pack_cli import main as pack_main

        return pack_main(args)
    if args.command == "info":
        from trainaccel.info import main as info_main

        return info_main()
    if args.command == "demo":
        from trainaccel.demo import main as demo_main

        return demo_main(args)
    if args.command == "bench" and args.benchmark == "quality":
        from trainaccel.bench.quality import main as quality_main

        return quality_main(args)
    if args.command == "bench" and args.benchmark == "train":
        from trainaccel.bench.train import main as train_main

        return train_main(args)
    if args.command == "bench" and args.benchmark == "faults":
        from trainaccel.bench.faults import main as faults_main

        return faults_main(args)
    if args.command == "bench" and args.benchmark == "data":
        from trainaccel.bench.data import main as data_main

        return data_main(args)
    if args.command == "bench" and args.benchmark == "embedding":
        from trainaccel.bench.embedding import main as embedding_main

        return embedding_main(args)
    if args.command == "bench":
        from trainaccel.bench.comm import main as comm_main

        return comm_main(args)
    parser.print_usage(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
