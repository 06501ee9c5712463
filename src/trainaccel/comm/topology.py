"""Which workers share a node, and the intra-node and inter-node groups built from that once."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist

from trainaccel.context import warn_once
from trainaccel.devices import backend_of
from trainaccel.resilience import failfast


@dataclasses.dataclass(frozen=True)
class Topology:
    """This worker's place in the job; groups are None where the job has no such level."""

    rank: int
    world_size: int
    nodes: tuple[tuple[int, ...], ...]  # global ranks per node, nodes ordered by their lowest rank
    node_index: int
    intra_group: dist.ProcessGroup | None = None  # this node's workers
    gather_group: dist.ProcessGroup | None = None  # the same workers again, for the last stage
    inter_group: dist.ProcessGroup | None = None  # the workers with this local index on every node

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_index])

    @property
    def local_index(self) -> int:
        """This worker's position within its node (Horovod's local rank)."""
        return self.nodes[self.node_index].index(self.rank)

    @property
    def uniform(self) -> bool:
        """Every node has the same number of workers."""
        return len({len(n) for n in self.nodes}) == 1

    def why_flat(self) -> str | None:
        """Why a hierarchical reduction cannot help or cannot run here; None when it can."""
        if self.num_nodes < 2:
            return "one node"
        if not self.uniform:
            sizes = ", ".join(str(len(n)) for n in self.nodes)
            return f"nodes have different numbers of workers ({sizes})"
        if self.local_size < 2:
            return "one worker per node"
        return None


def node_key(env: dict[str, str] | None = None) -> str:
    """What identifies this worker's node: torchrun's node rank, else the host name."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    if env.get("GROUP_RANK"):
        return f"node-rank {env['GROUP_RANK']}"
    return f"host {socket.gethostname()}"


def group_nodes(keys: list[str]) -> tuple[tuple[int, ...], ...]:
    """Ranks grouped by node key, nodes ordered by their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in nodes.values())


_cache: list[tuple[dist.ProcessGroup, Topology]] = []  # (the default group it was built for, topology)


def discover(process_group: dist.ProcessGroup | None = None) -> Topology:
    """The topology of the default group (one small allgather, then cached); call on every rank.

    Hierarchy is only built for the default group: for any other group the topology is flat.
    """
    world = dist.group.WORLD
    group = world if process_group is None else process_group
    if group is not world:
        return Topology(
            dist.get_rank(group), dist.get_world_size(group), (tuple(range(dist.get_world_size(group))),), 0
        )
    if _cache and _cache[0][0] is world:
        return _cache[0][1]
    rank, size = dist.get_rank(), dist.get_world_size()
    if failfast.job_replicas():
        # A node started again to rejoin a running job: its default group is a stand-in that gathers nothing, and
        # builds no real subgroup. The job's nodes are as its members wrote them; its node's group is built at the
        # join (Membership.join).
        nodes = tuple(tuple(ranks) for ranks in failfast.job_replicas())
        node_index = next(i for i, ranks in enumerate(nodes) if rank in ranks)
        _cache[:] = [(world, Topology(rank, size, nodes, node_index))]
        return _cache[0][1]
    keys: list[str] = [""] * size
    dist.all_gather_object(keys, node_key())
    nodes = group_nodes(keys)
    node_index = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    topology = Topology(rank, size, nodes, node_index)
    if topology.num_nodes > 1 and topology.uniform and topology.local_size > 1:
        # new_group is collective over the whole world: every rank builds every group, in order.
        intra = [dist.new_group(list(ranks)) for ranks in nodes]
        gather = [dist.new_group(list(ranks)) for ranks in nodes]
        inter = [dist.new_group([ranks[i] for ranks in nodes]) for i in range(topology.local_size)]
        topology = dataclasses.replace(
            topology,
            intra_group=intra[node_index],
            gather_group=gather[node_index],
            inter_group=inter[topology.local_index],
        )
    _cache[:] = [(world, topology)]
    _held[0] = 0
    return topology


_held: list[int] = [0]  # reductions built over the cached hierarchy's groups and not released (`hold`, `release`)


def _cached_hierarchy(topology: Topology) -> bool:
    """Whether `topology` is the cached one with the hierarchy's groups (the others' groups are not counted)."""
    return bool(_cache) and _cache[0][1] is topology and topology.intra_group is not None


def hold(topology: Topology) -> None:
    """A reduction over `topology`'s groups was built (on every rank alike): they stay while any is held."""
    if _cached_hierarchy(topology):
        _held[0] += 1


def release(topology: Topology) -> bool:
    """A reduction `hold` counted is no longer used (autotune's losing candidates; every rank alike): once none is,
    the hierarchy's groups are destroyed (on NCCL, a communicator and its buffers each), and built again at the
    next `discover()` that needs them. Returns whether they were destroyed."""
    if not _cached_hierarchy(topology):
        return False
    _held[0] -= 1
    if _held[0] > 0:
        return False
    for group in (topology.intra_group, topology.gather_group, topology.inter_group):
        dist.destroy_process_group(group)
    _cache.clear()
    return True


_node_groups: list[tuple[dist.ProcessGroup, dist.ProcessGroup | None]] = []  # (the default group, this node's group)


def node_group() -> dist.ProcessGroup | None:
    """This node's workers as a process group; None when the job is one node. Collective on first call.

    A group of its own, not the hierarchy's: the engine's thread issues on those, and collectives
    of the script's own threads on one group would interleave differently on different ranks.
    """
    world = dist.group.WORLD
    if _node_groups and _node_groups[0][0] is world:
        return _node_groups[0][1]
    topology = discover()
    if topology.num_nodes == 1:
        group = None
    else:  # every rank builds every node's group, in order
        group = [dist.new_group(list(ranks)) for ranks in topology.nodes][topology.node_index]
    _node_groups[:] = [(world, group)]
    return group


def hierarchy_for(
    process_group: dist.ProcessGroup | None,
    hierarchical: str,
    eligible: bool,
    what: str,
    device: torch.device | None = None,
) -> Topology | None:
    """The topology to reduce over in two levels, or None for a flat reduction; call on every rank.

    `hierarchical` is the option (on, auto, off); `auto` takes a hierarchy on Gloo when `eligible` (Gloo: the backend
    that reduces `device`'s tensors, the CPU's when None). Asked for one that cannot be built (`on`, or nodes of
    different sizes), it warns once: "`what` flat over all workers (why)".
    """
    group = dist.group.WORLD if process_group is None else process_group
    on_gloo = backend_of(group, device or torch.device("cpu")) == "gloo"
    wanted = hierarchical == "on" or (hierarchical == "auto" and eligible and on_gloo)
    if not wanted:
        return None
    topology = discover(process_group)
    why_flat = topology.why_flat()
    if why_flat is None:
        return topology
    if hierarchical == "on" or not topology.uniform:
        warn_once(f"hierarchical={hierarchical}: {what} flat over all workers ({why_flat})")
    return None
