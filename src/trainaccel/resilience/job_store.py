"""Where the job's store lives, one answer for every part that reaches it (workers, their launcher, a rejoining rank).

`store=agent` (the default): torchrun's, in the first node's agent, at MASTER_ADDR:MASTER_PORT. `store=etcd://...`:
an etcd cluster (resilience/etcd_store.py), the job's keys under its rendezvous id (`--rdzv-id`); no node hosts it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainaccel.config import STORE_SCHEME, Config

_store: Any = None  # this process's connection to an etcd store: held for the process (see `shared`)
_configured: str | None = None  # init()'s store option, over the environment's


def configure(store: str | None) -> None:
    """The store option init() was given (None, at shutdown: the environment's again, this connection dropped)."""
    global _configured, _store
    _configured = store
    if store is None:
        _store = None


def setting() -> str:
    """The store option: init()'s, else as this process's environment gives it: `agent` or `etcd://...`."""
    if _configured is not None:
        return _configured
    name = Config.env_name("store")
    return Config.resolve(env={name: os.environ.get(name, "")}, flags={}).store


def on_etcd() -> bool:
    return setting() != "agent"


def job() -> str:
    """The job's name in an etcd store: torchrun's rendezvous id."""
    name = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not name or name == "none":
        raise RuntimeError(
            f"the job's store on etcd ({setting()}) needs the job's name: start it with trainaccel run --rdzv-id NAME"
        )
    return name


def open_store(url: str | None = None, name: str | None = None, **options: Any) -> Any:
    """A new connection to the job's etcd store (`url` and `name`: another process's, from its heartbeat file)."""
    from trainaccel.resilience.etcd_store import EtcdStore

    return EtcdStore(url or setting(), name or job(), **options)


def shared() -> Any:
    """This process's one connection to the job's etcd store. Held for the whole process: c10d keeps only a C++
    handle on a store written in Python, so a group built over it must not outlive the Python object."""
    global _store
    if _store is None:
        _store = open_store()
    return _store


def describe() -> str:
    """What a message names: the etcd members, or the agent store's address."""
    if on_etcd():
        return "etcd at " + setting().removeprefix(STORE_SCHEME)
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def where(its: bool = False) -> str:
    """What may have gone when the store does not answer (`its`: said after the store was named)."""
    whose = "its" if its else "the store's"
    if on_etcd():
        return f"a majority of {whose} members"
    return f"{whose} node ({os.environ.get('MASTER_ADDR', '?')})"


def address(store: Any) -> Any:
    """How another process on this node reaches the store under `store` (for the heartbeat file): [host, port] of a
    TCPStore, {"etcd": url, "job": name} of an etcd store; None for others (a file, a hash map)."""
    import torch.distributed as dist

    from trainaccel.resilience.etcd_store import EtcdStore

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return (store.host, store.port)
    if isinstance(store, EtcdStore):
        return {"etcd": store.url, "job": store.job}
    return None


# A job that grows (--nnodes MIN:MAX on etcd): its launchers write how many nodes start it and how many may take part,
# before any worker starts; its workers read it (resilience.rejoin). Absent: a job of fixed size.
PLACES_KEY = "trainaccel/places"


def note_places(store: Any, first: int, most: int) -> None:
    """A growing job's sizes, in nodes, written once (every launcher writes the same)."""
    store.compare_set(PLACES_KEY, "", json.dumps({"first": first, "most": most}))


def places(store: Any) -> tuple[int, int] | None:
    """(the nodes that start the job, the most that take part) of a job that grows; None: a job of fixed size."""
    if not store.check([PLACES_KEY]):
        return None
    sizes = json.loads(store.get(PLACES_KEY))
    return sizes["first"], sizes["most"]
