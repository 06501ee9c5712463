import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent


def trainaccel_cmd() -> list[str]:
    """The installed console script, as users run it."""
    script = BIN / "trainaccel"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainaccel"]


def torchrun_cmd() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def run(cmd: list[str], env: dict | None = None, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """Run a command with a clean TRAINACCEL_* environment plus `env`; never hangs the suite.

    On timeout the command's whole process group is killed (a launcher's workers too), then it raises.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    args = [str(c) for c in cmd]
    with subprocess.Popen(
        args,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(args, timeout, out, err) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_nodes(
    script,
    *args,
    nodes: int = 2,
    per_node: int | list[int] = 2,
    launcher: list[str] | None = None,
    env: dict | None = None,
    timeout: float = 240,
) -> list[subprocess.CompletedProcess]:
    """Start `script` as `nodes` emulated nodes on this host: one torchrun launch per node (--nnodes).

    `per_node` is the workers per node, or a list of them for nodes of different sizes.
    """
    port = free_port()
    sizes = per_node if isinstance(per_node, list) else [per_node] * nodes
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    procs = [
        subprocess.Popen(
            [
                str(c)
                for c in (
                    *(launcher or torchrun_cmd()),
                    "--nnodes",
                    nodes,
                    "--node-rank",
                    node,
                    "--nproc-per-node",
                    sizes[node],
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                    script,
                    *args,
                )
            ],
            env={**base, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            p.kill()
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_ranks(directory: Path, world: int) -> list[dict]:
    files = sorted(directory.glob("rank*.json"))
    assert len(files) == world, f"expected {world} rank files, found {[f.name for f in files]}"
    return [json.loads(f.read_text()) for f in files]


def run_checks(script: str | Path, out_dir: Path, workers: int, *args) -> list[dict]:
    """Launch a worker script (a name in tests/scripts, or a path) that writes OUT_DIR/rank{r}.json (see
    scripts/checks.py); assert no check failed."""
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", workers, SCRIPTS / script, out_dir, *args]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out_dir, workers)
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], f"rank {rank}"
    return ranks


@pytest.fixture
def scripts() -> Path:
    return SCRIPTS


@pytest.fixture
def trainaccel_messages() -> list[str]:
    """The messages trainaccel logs during the test, whatever its handlers and levels."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("trainaccel").addHandler(handler)
    yield seen
    logging.getLogger("trainaccel").removeHandler(handler)
