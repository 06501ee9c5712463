"""trainaccel's communication engine: DDP hooks, codecs, hierarchy, local steps, DiLoCo, and the cross-node sum of
sharded models (`register_fsdp`).

`__all__` holds what scripts call; the engine's parts (codecs, the hook, its state's builder) are in their modules.
"""

from trainaccel.comm.checkpoint import load_state_dict, state_dict
from trainaccel.comm.ddp import bytes_per_step, bytes_sent, comm_state, register
from trainaccel.comm.diloco import DiLoCo, members, rejoined_at, sync_replicas
from trainaccel.comm.fsdp import register_fsdp
from trainaccel.comm.hooks import CommState
from trainaccel.comm.local_steps import LocalSteps
from trainaccel.comm.outer_sync import OuterSync
from trainaccel.comm.topology import Topology, discover

__all__ = [
    "CommState",
    "DiLoCo",
    "LocalSteps",
    "OuterSync",
    "Topology",
    "bytes_per_step",
    "bytes_sent",
    "comm_state",
    "discover",
    "load_state_dict",
    "members",
    "register",
    "register_fsdp",
    "rejoined_at",
    "state_dict",
    "sync_replicas",
]
