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
