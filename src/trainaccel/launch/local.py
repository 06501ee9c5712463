"""Run a short multi-worker job on this machine and collect the JSON its rank 0 writes (demo, bench)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainaccel.launch.run import TORCHRUN

__all__ = ["TORCHRUN", "TRAINACCEL_RUN", "plain_env", "run_job"]
TRAINACCEL_RUN = [sys.executable, "-m", "trainaccel.launch"]


def plain_env() -> dict[str, str]:
    """This environment without TRAINACCEL_* variables: what a plain torchrun baseline should see."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}


def run_job(name: str, command: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Run `command` to completion; return the JSON it left in `out`, or raise with its output's tail."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())
