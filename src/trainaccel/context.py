"""The `trainaccel` logger and facts logged once per job from rank 0; torch-free, importable from anywhere."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("trainaccel")

_said: set[str] = set()


def is_rank_zero() -> bool:
    """Rank 0 of the default group, or a process that has no group (yet)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a process without torch is rank 0
    return dist is None or not dist.is_initialized() or dist.get_rank() == 0


def say_once(level: int, message: str, every_rank: bool = False) -> None:
    """Log a fact about the whole job once, from rank 0 (or a fact about this worker, once, from it)."""
    if message not in _said and (every_rank or is_rank_zero()):
        _said.add(message)
        log.log(level, message)


def warn_once(message: str, every_rank: bool = False) -> None:
    say_once(logging.WARNING, message, every_rank)


def info_once(message: str) -> None:
    say_once(logging.INFO, message)
