"""trainaccel's communication engine: DDP hooks, codecs, and the DDP patch behind `init()`."""

from trainaccel.comm.codecs import CastCompression, Codec, NoCompression, get_codec
from trainaccel.comm.hooks import CommState, trainaccel_comm_hook
from trainaccel.comm.patch import bytes_per_step, comm_state, patch_ddp, register, unpatch_ddp

__all__ = [
    "bytes_per_step",
    "CastCompression",
    "Codec",
    "CommState",
    "NoCompression",
    "comm_state",
    "get_codec",
    "patch_ddp",
    "register",
    "trainaccel_comm_hook",
    "unpatch_ddp",
]
