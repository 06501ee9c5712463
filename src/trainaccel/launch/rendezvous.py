"""torchrun's static rendezvous with the job's store on etcd (`trainaccel run --store etcd://...`).

Static, as torchrun's default: each node's rank is its `--node-rank`, the job's size is `--nnodes`, and a node whose
agent starts again takes its rank back. The store is the job's etcd store (resilience/etcd_store.py) under the
rendezvous id, not a TCPStore in the first node's agent, so no node's loss takes the store with it.

A job that grows (`--nnodes MIN:MAX`, under on_lost_replica=continue with sync_every): nodes 0 to MIN-1 start it,
and a node started later with a node rank from MIN to MAX-1 joins it at a sync (resilience.rejoin). Every node runs
the same number of workers, so that each worker's rank follows from its node's rank alone (torch's
TORCH_ELASTIC_WORKER_IDENTICAL path): no launcher waits for another.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

BACKEND = "trainaccel-etcd"


def _handler(params: Any) -> Any:
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    from trainaccel.resilience import job_store

    class EtcdRendezvous(RendezvousHandler):
        """A fixed node rank and size (torchrun's static rendezvous) over the job's etcd store."""

        def __init__(self) -> None:
            self.rank, self.world_size, self.run_id = int(params.config["rank"]), params.max_nodes, params.run_id
            timeout = timedelta(seconds=int(params.config.get("timeout", 600)))
            self._store = job_store.open_store(params.endpoint, params.run_id, timeout=timeout)
            if params.min_nodes < params.max_nodes:  # before this node's workers start: they read it
                job_store.note_places(self._store, params.min_nodes, params.max_nodes)

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers share the store with the agents, across restarts (as static's do)

        def next_rendezvous(self) -> Any:
            # Workers reach the store through trainaccel's env:// handler (runtime.py); MASTER_ADDR and MASTER_PORT
            # name the first member only for what reads them.
            host, port = self._store.endpoints[0]
            return RendezvousInfo(
                PrefixStore(self.run_id, self._store), self.rank, self.world_size, RendezvousStoreInfo(host, port)
            )

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0  # static: a node that starts again takes its rank back, nobody waits to join

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    return EtcdRendezvous()


def register() -> None:
    """Make the backend known to torchrun's registry in this process (once)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND, _handler)
    except ValueError:  # registered already (a second launch in this process)
        pass


def check_etcd_args(args: Any, store: str) -> None:
    """LaunchError (one line) if torchrun's `args` cannot rendezvous on the job's etcd store."""
    from trainaccel.launch.torchrun import LaunchError

    if args.rdzv_backend not in ("static", BACKEND):
        raise LaunchError(
            f"--store {store} takes the place of --rdzv-backend {args.rdzv_backend}: leave --rdzv-backend out "
            "(each node's rank is its --node-rank, as with static rendezvous)"
        )
    if not args.rdzv_id or args.rdzv_id == "none":
        raise LaunchError(
            f"--store {store} needs --rdzv-id NAME: the job's name in the store, the same on every node and new for "
            "each job (the jobs on one etcd cluster are kept apart by it)"
        )


def check_growth(args: Any, config: Any) -> None:
    """LaunchError (one line) if a job that grows (`--nnodes MIN:MAX` on etcd) cannot work with `args` and `config`."""
    from trainaccel.launch.torchrun import LaunchError

    low, _, high = str(args.nnodes).partition(":")
    if not high or int(low) == int(high):
        return
    if config.on_lost_replica != "continue" or not config.sync_every:
        raise LaunchError(
            f"--nnodes {args.nnodes} with --store: nodes join a running job at a sync, so it needs --sync-every and "
            "--on-lost-replica continue (each replica trains alone between syncs); give --nnodes one number otherwise"
        )
    if config.sync_warmup:
        raise LaunchError(
            f"--nnodes {args.nnodes} with --sync-warmup {config.sync_warmup}: the warm-up's per-step exchange runs "
            "over the default group, which a job that grows cannot start (its nodes are not all there); use 0"
        )
    if not str(args.nproc_per_node).isdigit():
        raise LaunchError(
            f"--nnodes {args.nnodes} with --nproc-per-node {args.nproc_per_node}: a job that grows needs the same "
            "number of workers on every node, given as a number (each worker's rank follows from its node's)"
        )
    if int(args.node_rank) >= int(high):
        last = int(high) - 1
        raise LaunchError(f"invalid --node-rank {args.node_rank} with --nnodes {args.nnodes}; accepted: 0 to {last}")


def use_etcd(args: Any, store: str) -> None:
    """torchrun's `args` (checked by `check_etcd_args`) changed to rendezvous on the job's etcd store: the backend,
    its endpoint, the node's rank."""
    import os

    register()
    if ":" in str(args.nnodes):
        # Ranks by node rank, no exchange among the launchers (torch's fast path): a node that joins later, or a
        # first node lost, leaves nobody waiting for its launcher.
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    conf = f"rank={args.node_rank}"
    args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
    args.rdzv_backend, args.rdzv_endpoint = BACKEND, store
    args.node_rank = 0  # (torchrun warns that node_rank is only static's: it is carried in rdzv_conf)
