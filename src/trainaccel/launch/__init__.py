"""`trainaccel run` / `python -m trainaccel.launch`: torchrun plus trainaccel options and host lists."""

from trainaccel.launch.run import build_parser, main

__all__ = ["build_parser", "main"]
