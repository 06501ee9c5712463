"""`trainaccel info`: what this machine offers trainaccel, and the configuration it would use."""

from __future__ import annotations

import os
import platform
import sys

from trainaccel import __version__
from trainaccel.config import Config, ConfigError


def collect() -> dict[str, object]:
    """Versions, backends, device counts and the resolved config, as plain values."""
    import torch
    import torch.distributed as dist

    available = dist.is_available()
    return {
        "trainaccel": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backends": {
            "gloo": available and dist.is_gloo_available(),
            "nccl": available and dist.is_nccl_available(),
            "mpi": available and dist.is_mpi_available(),
        },
        "cpus": os.cpu_count(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
    }


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        config = Config.resolve()
    except ConfigError as e:
        print(f"trainaccel info: error: {e}", file=sys.stderr)
        return 2
    facts = collect()
    table = Table(title="trainaccel info", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key in ("trainaccel", "torch", "python", "platform", "cuda", "cpus", "gpus"):
        table.add_row(key, str(facts[key]))
    backends = facts["backends"]
    assert isinstance(backends, dict)
    table.add_row("backends", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()))
    for name in Config.option_names():
        source = Config.env_name(name) if Config.env_name(name) in os.environ else "default"
        table.add_row(f"config.{name}", f"{getattr(config, name)}  ({source})")
    for line in Config.misspelt_env():
        table.add_row("warning", line)
    console.print(table)
    names = [Config.env_name(name) for name in Config.option_names()]
    given = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    if given:
        print(NOT_BY_OTHER_LAUNCHERS.format(given=", ".join(given)))
    return 0


# What `trainaccel info` says where TRAINACCEL_* options are set in its environment.
NOT_BY_OTHER_LAUNCHERS = (
    "trainaccel info: {given} set here: applied only in workers that `trainaccel run` starts or in a script that "
    "calls trainaccel.init(); torchrun, accelerate launch, python and other launchers start workers that ignore them"
)
