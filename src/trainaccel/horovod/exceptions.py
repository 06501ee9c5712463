"""Horovod's exception types, so `except hvd.HorovodInternalError` in user code keeps working."""


class HorovodInternalError(RuntimeError):
    """A collective failed because a peer is gone or the job is broken; elastic jobs recover from it."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of workers changed; elastic jobs re-form and continue from the last commit."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of workers changed")
        self.skip_sync = skip_sync


class UnsupportedOperation(ValueError, RuntimeError):
    """A Horovod argument trainaccel does not support (Adasum, MPI); Horovod raises RuntimeError for some."""
