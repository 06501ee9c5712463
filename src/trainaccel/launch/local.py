"""Run a short multi-worker job on this machine and collect the JSON its rank 0 writes (demo, bench)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainaccel.config import ENV_PREFIX
from trainaccel.launch.torchrun import TORCHRUN

__all__ = ["TORCHRUN", "TRAINACCEL_RUN", "plain_env", "run_job", "run_together"]
TRAINACCEL_RUN = [sys.executable, "-m", "trainaccel.launch"]


def plain_env() -> dict[str, str]:
    """This environment without TRAINACCEL_* variables: what a plain torchrun baseline should see."""
    return {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


def run_job(name: str, command: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Run `command` to completion; return the JSON it left in `out`, or raise with its output's tail.

    Interrupted (Ctrl-C, or SIGTERM turned into one), it `stop`s the command's process group: a launcher gets SIGTERM
    and the time to stop its workers (torchrun starts them in sessions of their own, so SIGKILL, as `subprocess.run`
    sends, would leave them running)."""
    # Output to a file, not a pipe: a launcher reporting as it stops cannot block on one nobody reads.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait()
        except BaseException:
            stop([proc])
            raise
        if proc.returncode != 0 or not out.exists():
            log.seek(0)
            tail = "\n".join(log.read().splitlines()[-30:])
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def run_together(
    commands: list[list[str]],
    envs: list[dict[str, str] | None] | None = None,
    logs: list[Path] | None = None,
    may_fail: tuple[int, ...] = (),
    restart: tuple[int, ...] = (),
    on_end: Callable[[int], None] | None = None,
    later: dict[int, Callable[[], bool]] | None = None,
) -> tuple[int, int | None]:
    """Run commands side by side; the first failure stops the rest (as does Ctrl-C, re-raised).

    Returns (exit code, index of the failed command or None). Each command gets its own
    process group, so stopping it stops everything it started. The commands at `may_fail` may end in failure
    (a node lost on purpose): the others run on, and the result is theirs. Those also at `restart` are started
    again once, as soon as they ended (a lost node started anew: its log goes on), and must then succeed.
    `on_end(i)` is called once as each command at `may_fail` first ends (before any start again). A command at
    `later` starts once its function says so (a node joining a running job); one that never started is not waited for.
    """
    envs = envs or [None] * len(commands)
    files = [open(path, "w") for path in logs] if logs else [None] * len(commands)
    procs: list[subprocess.Popen] = []
    may_fail, again, ended = set(may_fail), set(restart), set()

    def start(command: list[str], env: dict[str, str] | None, out: Any) -> subprocess.Popen:
        err = subprocess.STDOUT if out else None
        return subprocess.Popen(command, env=env, start_new_session=True, stdout=out, stderr=err)

    waiting = dict(later or {})
    try:
        for i, (command, env, out) in enumerate(zip(commands, envs, files)):
            procs.append(None if i in waiting else start(command, env, out))  # type: ignore[arg-type]
        while True:
            for i, due in list(waiting.items()):
                if due():
                    del waiting[i]
                    procs[i] = start(commands[i], envs[i], files[i])
            codes = [p.poll() if p is not None else 0 for p in procs]
            for i in sorted(may_fail - ended):
                if codes[i] is not None:
                    ended.add(i)
                    if on_end is not None:
                        on_end(i)
            for i in sorted(again):
                if codes[i] is not None:  # ended (killed on purpose): started again, this time to succeed
                    again.discard(i)
                    may_fail.discard(i)
                    procs[i], codes[i] = start(commands[i], envs[i], files[i]), None
            failed = [i for i, code in enumerate(codes) if code not in (None, 0) and i not in may_fail]
            if failed:
                stop([p for p in procs if p is not None])
                return codes[failed[0]], failed[0]  # type: ignore[return-value]
            if all(code == 0 or (code is not None and i in may_fail) for i, code in enumerate(codes)):
                return 0, None
            time.sleep(0.1)
    except BaseException:
        stop([p for p in procs if p is not None])
        raise
    finally:
        for f in files:
            if f is not None:
                f.close()


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each process group still running, SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
