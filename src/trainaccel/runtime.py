"""`trainaccel.init()` / `trainaccel.shutdown()`: read the config, bring up the process group if needed, patch DDP;
and undo all of it."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from trainaccel import context
from trainaccel.config import Config
from trainaccel.context import current_config, log
from trainaccel.environment import env_rank, is_distributed, map_mpi_env

__all__ = ["current_config", "init", "shutdown"]


def init(*, start_process_group: bool = True, **options: Any) -> Config:
    """Set trainaccel up in this worker; every DDP model built afterwards is accelerated.

    Idempotent: a repeated call with the same options changes nothing. With
    `start_process_group`, the default process group is started (env://) when the
    environment describes a distributed job and the script has not started one yet.
    `shutdown()` undoes it all.
    """
    mapped = map_mpi_env()
    config = Config.resolve(**options)
    misspelt = Config.check_env()  # (raises, naming the closest option, unless TRAINACCEL_UNKNOWN_ENV=warn)
    _configure_logging(config.log_level)
    from trainaccel.resilience.failfast import set_collective_timeout

    set_collective_timeout(config.collective_timeout)
    _store_on_etcd(config.store)  # (first: the attempt's keys are then prefixed on it)
    _key_groups_by_attempt()
    _explain_uncaught_failures()
    if is_distributed():
        from trainaccel.devices import select_local_device

        # Whoever starts the group: each worker on its own GPU, as NCCL and object collectives need.
        select_local_device()
    if config.on_lost_replica == "continue" and is_distributed():
        from trainaccel.resilience.rejoin import prepare_rejoin

        prepare_rejoin()  # before any default group starts: a rank started again gets a stand-in one
        _refuse_growth_without_syncs(config)
    if start_process_group:
        _start_process_group(mapped)

    from trainaccel.comm.owners import install_if_wanted
    from trainaccel.zero_code import patch_ddp

    install_if_wanted()

    previous = current_config()
    patch_ddp(config)
    if config.shard != "off":
        from trainaccel.sharding import install

        install()
    if config != previous:
        if context.rank() == 0:
            log.info("trainaccel config: %s", config.describe())
            for line in misspelt:
                log.warning("ignoring %s", line)
    return config


def shutdown() -> None:
    """The inverse of `init()`: every patch of torch undone, the process group `init()` started destroyed.

    Models built before keep DDP's communication hook (DDP cannot unregister one) and lose the rest.
    """
    context.undo_all()


def _refuse_growth_without_syncs(config: Config) -> None:
    """A job that grows (--nnodes MIN:MAX on etcd) trains only under sync_every without a warm-up: nodes join at a
    sync, and the default group is a stand-in."""
    from trainaccel.config import ConfigError
    from trainaccel.resilience.failfast import first_ranks

    if first_ranks() is None:
        return
    if not config.sync_every or config.sync_warmup:
        raise ConfigError(
            f"a job that grows (--nnodes MIN:MAX) needs sync_every and sync_warmup=0 (here sync_every="
            f"{config.sync_every}, sync_warmup={config.sync_warmup}): nodes join at a sync, and its default group is a "
            "stand-in that no per-step exchange can use"
        )


def _store_on_etcd(store: str) -> None:
    """Under store=etcd://..., an env:// group (the script's, trainaccel's) rendezvouses on the job's etcd store, not
    on a TCPStore on the first node (until shutdown)."""
    if store == "agent" or not context.first_time("env:// on etcd"):
        return
    import urllib.parse

    from trainaccel.resilience import job_store

    job_store.configure(store)

    def env_handler(url: str, timeout: Any = None, **kwargs: Any) -> Any:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))  # init_process_group's rank, size
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        if rank < 0 or world < 1:
            raise ValueError(f"env:// on the job's store ({job_store.describe()}): RANK and WORLD_SIZE are not set")
        store = job_store.shared()
        if timeout is not None:
            store.set_timeout(timeout)
        yield store, rank, world

    _replace_env_handler("env:// on etcd", lambda original: env_handler)
    context.on_undo("the job's store option", lambda: job_store.configure(None))


def _replace_env_handler(what: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """torch's env:// rendezvous handler replaced by `make(the handler before)` until shutdown (`what` names it)."""
    import importlib

    # The module: `torch.distributed.rendezvous` as an attribute is the function of the same name.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers["env"]
    handlers["env"] = make(original)
    context.on_undo(what, lambda: handlers.__setitem__("env", original))


def _key_groups_by_attempt() -> None:
    """Under torchrun, the keys of a script's own env:// group carry the attempt (until shutdown).

    A static rendezvous (`--master-addr`, several nodes) gives every attempt the agent's one store, and
    torch keys the group by nothing that changes between attempts: a restarted group would read the last
    attempt's Gloo addresses and fail (`Connection refused`) or hang.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or not context.first_time("attempt-keyed env://"):
        return
    from torch.distributed import PrefixStore

    def keyed(original: Callable[..., Any]) -> Callable[..., Any]:
        def env_handler(url: str, **kwargs: Any) -> Any:
            for store, rank, world in original(url, **kwargs):
                yield PrefixStore(f"trainaccel/attempt{attempt}", store), rank, world

        return env_handler

    _replace_env_handler("attempt-keyed env://", keyed)


def _explain_uncaught_failures() -> None:
    """An error that ends the script says which peers were missing and ends the other ranks (once, until shutdown)."""
    if not context.first_time("excepthook"):
        return
    previous = sys.excepthook

    def excepthook(kind: type, error: BaseException, tb: Any) -> None:
        from trainaccel.resilience.failfast import failed

        failed(error)
        previous(kind, error, tb)

    context.patch(sys, "excepthook", excepthook)


def _configure_logging(level: str) -> None:
    if context.first_time("logging"):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[trainaccel rank {env_rank()}] %(levelname)s %(message)s"))
        before = log.level, log.propagate

        def restore() -> None:
            log.removeHandler(handler)
            log.setLevel(before[0])
            log.propagate = before[1]

        log.addHandler(handler)
        log.propagate = False
        context.on_undo("trainaccel logging", restore)
    log.setLevel(level.upper())


_incarnation = 0  # process groups started by this process so far


def _start_process_group(mapped: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized() or not is_distributed():
        return
    from trainaccel.resilience import job_store

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing and not job_store.on_etcd():
        how = " (mpirun -x MASTER_ADDR -x MASTER_PORT)" if mapped else ""
        raise RuntimeError(
            f"cannot start the process group: {' and '.join(missing)} not set; "
            f"export the first host's address and a free port{how}"
        )
    if torch.cuda.is_available() and dist.is_nccl_available():
        backend = "cpu:gloo,cuda:nccl"  # init() made this worker's GPU the current device
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
    context.on_undo("process group", _destroy_process_group)
    log.debug("started process group %s: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def _destroy_process_group() -> None:
    """The default group `init()` started (a group the script started is the script's to end)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
