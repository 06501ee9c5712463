"""trainaccel's communication engine: DDP hooks, codecs, hierarchy, local steps, DiLoCo, and the cross-node sum of
sharded models (`register_fsdp`)."""

from trainaccel.comm.checkpoint import load_state_dict, state_dict
from trainaccel.comm.codecs import CastCompression, Codec, ErrorFeedback, NoCompression, RandomK, TopK, get_codec
from trainaccel.comm.ddp import build_state, bytes_per_step, bytes_sent, comm_state, register
from trainaccel.comm.diloco import DiLoCo, members, rejoined_at, sync_replicas
from trainaccel.comm.fsdp import register_fsdp
from trainaccel.comm.hooks import CommState, trainaccel_comm_hook
from trainaccel.comm.local_steps import LocalSteps
from trainaccel.comm.outer_sync import OuterSync
from trainaccel.comm.topology import Topology, discover

__all__ = [
    "build_state",
    "bytes_per_step",
    "bytes_sent",
    "CastCompression",
    "Codec",
    "CommState",
    "DiLoCo",
    "ErrorFeedback",
    "LocalSteps",
    "NoCompression",
    "OuterSync",
    "RandomK",
    "Topology",
    "TopK",
    "comm_state",
    "discover",
    "get_codec",
    "load_state_dict",
    "members",
    "register",
    "register_fsdp",
    "rejoined_at",
    "state_dict",
    "sync_replicas",
    "trainaccel_comm_hook",
]
