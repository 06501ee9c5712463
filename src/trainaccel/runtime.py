"""`trainaccel.init()`: read the config, bring up the process group if needed, patch DDP."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from trainaccel.config import Config
from trainaccel.environment import env_rank, is_distributed, map_mpi_env

log = logging.getLogger("trainaccel")

_config: Config | None = None


def current_config() -> Config | None:
    """The config set by the last `init()`, or None before it."""
    return _config


def init(*, start_process_group: bool = True, **options: Any) -> Config:
    """Set trainaccel up in this worker; every DDP model built afterwards is accelerated.

    Idempotent: a repeated call with the same options changes nothing. With
    `start_process_group`, the default process group is started (env://) when the
    environment describes a distributed job and the script has not started one yet.
    """
    global _config
    mapped = map_mpi_env()
    config = Config.resolve(**options)
    _configure_logging(config.log_level)
    from trainaccel.comm.failfast import set_collective_timeout

    set_collective_timeout(config.collective_timeout)
    _explain_uncaught_failures()
    if start_process_group:
        _start_process_group(mapped)

    from trainaccel.comm.patch import patch_ddp

    patch_ddp(config)
    if config != _config:
        _config = config
        if _rank() == 0:
            log.info("trainaccel config: %s", config.describe())
            for name in Config.unknown_env():
                log.warning("ignoring %s: not a trainaccel option (known: %s)", name, ", ".join(Config.option_names()))
    return config


def _explain_uncaught_failures() -> None:
    """A collective failure that ends the script also says which peers were missing (once installed)."""
    if getattr(sys.excepthook, "_trainaccel", False):
        return
    previous = sys.excepthook

    def excepthook(kind: type, error: BaseException, tb: Any) -> None:
        from trainaccel.comm.failfast import annotate

        annotate(error)
        previous(kind, error, tb)

    excepthook._trainaccel = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_rank()


def _configure_logging(level: str) -> None:
    log.setLevel(level.upper())
    if not any(getattr(h, "_trainaccel", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[trainaccel rank {env_rank()}] %(levelname)s %(message)s"))
        handler._trainaccel = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False


_incarnation = 0  # process groups started by this process so far


def _start_process_group(mapped: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized() or not is_distributed():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        how = " (mpirun -x MASTER_ADDR -x MASTER_PORT)" if mapped else ""
        raise RuntimeError(
            f"cannot start the process group: {' and '.join(missing)} not set; "
            f"export the first host's address and a free port{how}"
        )
    if torch.cuda.is_available() and dist.is_nccl_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    global _incarnation
    # torchrun's agent keeps its store across restarts of the workers (TORCHELASTIC_USE_AGENT_STORE):
    # a restarted group would read the last attempt's Gloo addresses and fail or hang.
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "0"
    if _incarnation == 0 and restart == "0":
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        # After a shutdown or a restart the store still holds the last group's keys; a fresh
        # prefix keeps the new group from reading them (every rank counts incarnations alike).
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"trainaccel/restart{restart}/incarnation{_incarnation}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    _incarnation += 1
    log.debug("started process group %s: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
