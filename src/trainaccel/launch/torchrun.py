"""What every launch path shares: the torchrun command, its flags, the worker's argv and the launch error."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["BOOTSTRAP_MODULE", "TORCHRUN", "LaunchError", "script_argv", "torchrun_flags"]

BOOTSTRAP_MODULE = "trainaccel.launch.bootstrap"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class LaunchError(ValueError):
    """A launcher argument that cannot work; the message is one line."""


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc-per-node words besides a count


def check_torchrun_flags(args: argparse.Namespace) -> None:
    """torchrun's counts checked before anything starts: torchrun itself ends on a bare AssertionError for some."""
    nproc = str(args.nproc_per_node)
    count = int(nproc) if nproc.lstrip("-").isdigit() else None
    if (count is not None and count < 1) or (count is None and nproc not in NPROC_WORDS):
        raise LaunchError(f"invalid --nproc-per-node {nproc!r}; accepted: an integer >= 1, or {', '.join(NPROC_WORDS)}")
    low, _, high = str(args.nnodes).partition(":")
    bounds = (low, high or low)
    if not all(b.isdigit() for b in bounds) or not 1 <= int(bounds[0]) <= int(bounds[1]):
        raise LaunchError(
            f"invalid --nnodes {args.nnodes!r}; accepted: an integer >= 1, or MIN:MAX with 1 <= MIN <= MAX"
        )
    if args.max_restarts < 0:
        raise LaunchError(f"invalid --max-restarts {args.max_restarts}; accepted: an integer >= 0")


def torchrun_flags(args: argparse.Namespace, **overrides: Any) -> list[str]:
    """The torchrun flags that reproduce `args` (those differing from torchrun's defaults)."""
    from torch.distributed.run import get_args_parser

    values = {**vars(args), **overrides}
    argv: list[str] = []
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = values.get(action.dest, action.default)
        if value == action.default and action.dest not in overrides:
            continue
        if action.nargs == 0:
            if value:
                argv.append(action.option_strings[0])
        elif value is not None:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            argv += [action.option_strings[0], text]
    return argv


def script_argv(args: argparse.Namespace) -> list[str]:
    """What torchrun runs in each worker: the bootstrap, which calls init() then the script."""
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    return [
        "-m",
        BOOTSTRAP_MODULE,
        *(["--module"] if args.module else []),
        args.training_script,
        *args.training_script_args,
    ]
