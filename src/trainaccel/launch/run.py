"""`trainaccel run`: every torchrun flag unchanged, plus trainaccel options and mpirun-style host lists."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import shutil
import sys

from trainaccel.argparsing import refuse, two_line_errors
from trainaccel.config import ENV_PREFIX, Config, ConfigError
from trainaccel.launch.torchrun import TORCHRUN, LaunchError, check_torchrun_flags, script_argv, torchrun_flags

log = logging.getLogger("trainaccel")


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser, extended with trainaccel options and host-list flags."""
    from torch.distributed.run import get_args_parser

    parser = two_line_errors(get_args_parser())
    parser.prog = "trainaccel run"
    # argparse classifies every argument before it knows where the script's own begin: with abbreviations on,
    # a script's --out would be taken for --outer-lr (ambiguous prefix) and the launch refused.
    parser.allow_abbrev = False
    parser.description = (
        "Start a distributed training script with trainaccel's acceleration, unchanged. "
        f"Takes every torchrun flag; trainaccel options may also come from {ENV_PREFIX}<OPTION> env."
    )
    parser.usage = "trainaccel run [trainaccel options] [torchrun options] training_script [script args ...]"
    torchrun_group = parser._action_groups[1]  # argparse has no public handle on the group of plain options
    torchrun_group.title = "torchrun's options (as torchrun takes them)"
    Config.add_arguments(parser)
    launch = parser.add_argument_group("host lists (mpirun style) and this launch")
    launch.add_argument("-np", "--np", dest="np", type=int, metavar="N", help="total number of processes")
    launch.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS", help="hosts with slots, e.g. host1:8,host2:8")
    launch.add_argument("--hostfile", metavar="PATH", help="file of `host slots=N` lines")
    launch.add_argument("--dry-run", "--dry_run", action="store_true", help="print the torchrun command(s) and exit")
    launch.add_argument(
        "--use-env",
        "--use_env",
        action="store_true",
        default=True,
        help="accepted for torch.distributed.launch users; LOCAL_RANK is always in the environment",
    )
    # trainaccel's topics first, torchrun's own flags last: they are torchrun's, documented there.
    parser._action_groups.remove(torchrun_group)
    parser._action_groups.append(torchrun_group)
    return parser


def trainaccel_env(args: argparse.Namespace) -> dict[str, str]:
    """Validate the options (flags over env) and return the TRAINACCEL_* env that carries them."""
    flags = Config.flags_from(args)
    config = Config.resolve(flags=flags)
    # The environment's own TRAINACCEL_* variables travel unchanged; a flag replaces its option's variable.
    inherited = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    return {**inherited, **config.to_env(name for name, raw in flags.items() if raw is not None)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.run_path:
            raise LaunchError("--run-path is not supported: workers must start as processes to run the script")
        check_torchrun_flags(args)
        for line in Config.check_env():  # (raises on a misspelt option, unless TRAINACCEL_UNKNOWN_ENV=warn)
            log.warning("ignoring %s", line)
        env = trainaccel_env(args)
        config = Config.resolve(env=env)
        if config.shard != "off":
            # After its first large free, glibc keeps freed blocks below 32 MiB in its heap (a dynamic mmap
            # threshold): a sharded model's gathered blocks would stay resident. A fixed threshold gives them back.
            env["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(2**20))
        if args.max_restarts > 0 and args.rdzv_backend != "static" and config.on_lost_replica == "continue":
            log.warning(
                "--max-restarts with --rdzv-backend %s: when a node's agent restarts its workers, torchrun restarts "
                "every node's (a node joining the rendezvous), so the other replicas go back to the script's last "
                "checkpoint instead of training on; with static rendezvous (--master-addr, --master-port) only the "
                "failed node restarts, and its workers rejoin (on_lost_replica=continue)",
                args.rdzv_backend,
            )
        if args.max_restarts > 0:
            # torchrun's agent shares one store with every attempt of the workers, and torch keys a plain
            # init_process_group by nothing that changes between attempts: a restarted group can read the
            # last attempt's Gloo addresses and fail or hang. A fresh store per attempt avoids that.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if config.store != "agent":
            from trainaccel.launch.rendezvous import check_etcd_args, check_growth

            check_etcd_args(args, config.store)
            check_growth(args, config)
        if args.np is not None or args.hosts or args.hostfile:
            from trainaccel.launch.hosts import plan_hosts

            plan = plan_hosts(args, env)  # (each host's own trainaccel run rendezvouses on etcd, if asked)
        else:
            plan = None
            if config.store != "agent":
                from trainaccel.launch.rendezvous import use_etcd

                use_etcd(args, config.store)
    except (ConfigError, LaunchError, OSError) as e:
        print(f"trainaccel run: error: {e}", file=sys.stderr)
        return 2
    if args.no_python:
        log.warning("--no-python: the program runs as is; it must call trainaccel.init() itself")
    os.environ.update(env)

    if plan is not None:
        from trainaccel.launch.hosts import run_plan

        if args.dry_run:
            for command in plan:
                print(f"# node {command.node_rank}: {command.host}, {command.nproc} processes")
                print(command.shell())
            return 0
        return run_plan(plan)

    if args.dry_run:
        if config.store != "agent":
            print("# the trainaccel-etcd rendezvous exists inside trainaccel run: start this command with it")
        env_prefix = [f"{k}={v}" for k, v in sorted(env.items())]
        print(shlex.join([*env_prefix, *TORCHRUN, *torchrun_flags(args, module=False), *script_argv(args)]))
        return 0
    missing = _missing_script(args)  # here, before any worker starts (a host list's script is on its hosts)
    if missing:
        refuse(parser, missing)
    return _run_torchrun(args)


def _missing_script(args: argparse.Namespace) -> str | None:
    """Why the training script cannot start here (before any worker does), or None."""
    script = args.training_script
    if args.no_python:
        return None if shutil.which(script) or os.path.exists(script) else f"no program {script!r} to run"
    if args.module:
        try:
            found = importlib.util.find_spec(script)
        except (ImportError, ValueError):
            found = None
        return None if found is not None else f"no module {script!r} to run (-m): not importable here"
    if not os.path.isfile(script):
        return f"no training script {script!r}: not a file (from {os.getcwd()})"
    return None


def _run_torchrun(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from trainaccel.launch.survivors import exit_barrier_without_lost_replicas
    from trainaccel.launch.watchdog import Watchdog

    worker, script = script_argv(args), args.training_script
    if not args.no_python:
        args.module, args.training_script, args.training_script_args = True, worker[1], worker[2:]
    try:
        with Watchdog() as watchdog, exit_barrier_without_lost_replicas():
            try:
                run(args)
            except ChildFailedError as e:  # each failed worker's pid and exit code, for those reaped unseen
                watchdog.reaped({f.pid: f.exitcode for f in e.failures.values() if f.pid > 0})
                raise
    except ChildFailedError as e:
        e.name = script  # the report's title: the user's script, not the bootstrap that ran it
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
