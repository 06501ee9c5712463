"""trainaccel: an open, PyTorch-native accelerator for distributed data-parallel training.

Zero-code: `trainaccel run --nproc-per-node 8 train.py`. One line: `trainaccel.init()`, undone by
`trainaccel.shutdown()`. Importing this package is cheap and changes nothing; torch is loaded by `init()`.
"""

from __future__ import annotations

from typing import Any

from trainaccel.config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "__version__", "compile", "convert_sync_batchnorm", "init", "shard", "shutdown"]


def init(*, start_process_group: bool = True, **options: Any) -> Config:
    """Set trainaccel up in this worker (see `trainaccel.runtime.init`); returns the resolved config."""
    from trainaccel.runtime import init as _init

    return _init(start_process_group=start_process_group, **options)


def shutdown() -> None:
    """Undo `init()`: torch as it was, the process group it started destroyed (see `trainaccel.runtime.shutdown`)."""
    from trainaccel.runtime import shutdown as _shutdown

    _shutdown()


def compile(model: Any, preset: str = "default", **options: Any) -> Any:  # noqa: A001 - mirrors torch.compile
    """`torch.compile` in place with a named preset and an eager fallback (see `trainaccel.compiler.compile`)."""
    from trainaccel.compiler import compile as _compile

    return _compile(model, preset, **options)


def convert_sync_batchnorm(module: Any, scope: str = "global", process_group: Any = None) -> Any:
    """BatchNorm layers -> SyncBatchNorm over every worker or this node's (see `trainaccel.batchnorm`)."""
    from trainaccel.batchnorm import convert_sync_batchnorm as _convert

    return _convert(module, scope, process_group)


def shard(model: Any, mode: str = "full", **options: Any) -> Any:
    """Shard a model with FSDP2 block by block, over all ranks or within each node (see `trainaccel.sharding.shard`)."""
    from trainaccel.sharding import shard as _shard

    return _shard(model, mode, **options)
