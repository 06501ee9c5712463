"""Start one benchmark job: local workers, or one torchrun per node of an emulated cluster."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from trainaccel.bench.emulate import EmulatedCluster, Emulation, EmulationError
from trainaccel.bench.progress import progress
from trainaccel.launch.local import TRAINACCEL_RUN, run_job, run_together


def run_workers(
    name: str,
    launcher: list[str],
    worker: list[str],
    out: Path,
    env: dict[str, str] | None,
    *,
    nproc_per_node: int,
    cluster: EmulatedCluster | None = None,
    port: int = 29500,
    lost_node: int | None = None,
    rejoin: bool = False,
    join_when: Callable[[], bool] | None = None,
) -> dict:
    """Run `launcher ... worker` to completion and return the JSON its rank 0 wrote to `out`.

    Without a cluster: `--standalone` on this machine. With one: a torchrun per node inside
    its namespace, static rendezvous on node 0, Gloo bound to the node's shaped interface.
    `lost_node`: a node whose workers end themselves on purpose (the others' result is the run's); `rejoin`: its
    launcher is started again once it ended, and its second start must succeed. `join_when`: the job may grow by
    the cluster's last node (`--nnodes N-1:N`, with the store on etcd), which starts once it says so (if ever).
    """
    if cluster is None:
        return run_job(name, [*launcher, "--standalone", f"--nproc-per-node={nproc_per_node}", *worker], out, env)
    emulation = cluster.emulation
    # Under store=etcd, trainaccel's launcher rendezvouses on the cluster's etcd store (a name of its own per run);
    # a plain torchrun baseline keeps torchrun's store on node 0.
    on_etcd = cluster.store is not None and launcher == TRAINACCEL_RUN
    store = ["--store", cluster.store, f"--rdzv-id=bench-{uuid.uuid4().hex[:12]}"] if on_etcd else []
    nnodes = f"{emulation.nodes - 1}:{emulation.nodes}" if join_when is not None else str(emulation.nodes)
    commands = [
        [
            *cluster.exec_prefix(node),
            *launcher,
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={emulation.procs_per_node}",
            f"--master-addr={cluster.address(0)}",
            f"--master-port={port}",
            *store,
            *worker,
        ]
        for node in range(emulation.nodes)
    ]
    node_env = emulation.node_env(os.environ if env is None else env)
    logs = [out.with_suffix(f".node{node}.log") for node in range(emulation.nodes)]
    lost = () if lost_node is None else (lost_node,)
    restart = lost if rejoin else ()

    def node_lost(node: int) -> None:
        """Its launcher ended after its workers: the rest of the node goes too (its store member), then comes back
        with it when it is started again."""
        cluster.kill_node(node)
        if rejoin and node < len(cluster.etcd.hosts):
            cluster.etcd.start(node)

    try:
        code, failed = run_together(
            commands,
            [node_env] * len(commands),
            logs,
            may_fail=lost,
            restart=restart,
            on_end=node_lost if on_etcd else None,
            later=None if join_when is None else {emulation.nodes - 1: join_when},
        )
    finally:
        if cluster.etcd is not None:  # the next run starts with every store member back (with its data: it rejoins)
            cluster.etcd.revive()
    if failed is not None or not out.exists():
        tail = "\n".join(logs[failed or 0].read_text().splitlines()[-30:])
        raise RuntimeError(f"{name} failed on node {failed} (exit {code}):\n{tail}")
    return json.loads(out.read_text())


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C inside this block, so clean-up (namespaces, workers) always runs."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def bench_session(emulation: Emulation | None) -> Iterator[tuple[Path, EmulatedCluster | None]]:
    """A scratch folder and, when asked, an emulated cluster; both removed however the block ends."""
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="trainaccel-bench-") as tmp:
        if emulation is None:
            yield Path(tmp), None
        else:
            with EmulatedCluster(emulation) as cluster:
                yield Path(tmp), cluster


def report_header(benchmark: str, args: argparse.Namespace) -> dict:
    """What every benchmark's JSON starts with: what ran, when, where, with which settings."""
    import torch

    return {
        "benchmark": benchmark,
        "command": ["trainaccel", *sys.argv[1:]],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # bf16 speed hangs on AVX512-BF16/AMX
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("command", "benchmark") and not k.startswith("trainaccel_")
        },
    }


# run_one(arm, out, cluster, port, repeat) -> the run's result; describe(result) -> its line of progress.
RunOne = Callable[[str, Path, EmulatedCluster | None, int, int], dict]


def interleaved_or_exit_code(
    command: str,
    title: str,
    arms: list[str],
    repeats: int,
    emulation: Emulation | None,
    run_one: RunOne,
    describe: Callable[[dict], str],
) -> tuple[dict[str, list[dict]] | None, int]:
    """Each arm `repeats` times, interleaved, so that drift on a shared machine hits every arm alike.

    A progress bar shows the run in flight and a line is printed as each ends. Returns (runs, 0), or
    (None, the exit code) after one line on stderr for `trainaccel bench <command>` when a run failed (1)
    or was interrupted (130), once workers and namespaces are gone.
    """
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    try:
        with bench_session(emulation) as (tmp, cluster), progress(title, repeats * len(arms)) as report:
            for repeat in range(repeats):
                for i, arm in enumerate(arms):
                    report.start(f"{arm}, repeat {repeat + 1}/{repeats}")
                    port = 29500 + repeat * len(arms) + i  # a fresh port: no TIME_WAIT from the last run
                    result = run_one(arm, tmp / f"arm{i}-{repeat}.json", cluster, port, repeat)
                    runs[arm].append(result)
                    report.done(describe(result))
    except (RuntimeError, EmulationError) as e:
        print(f"trainaccel bench {command}: error: {e}", file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        print(f"trainaccel bench {command}: interrupted; workers stopped and namespaces removed", file=sys.stderr)
        return None, 130
    return runs, 0


def print_auto_lines(console: object, summary: dict[str, dict]) -> None:
    """sync_every=auto's choices under a report's table: each arm's, each repeat's, as its rank 0 logged them."""
    for arm, s in summary.items():
        for repeat, lines in enumerate(s.get("auto_settings", []), 1):
            for line in lines:
                console.print(f"{arm}, repeat {repeat}: {line}", markup=False, highlight=False, soft_wrap=True)


def describe_workers(emulation: Emulation | None, nproc_per_node: int) -> str:
    """`2 nodes x 2 workers, link 500mbit, 1 thread each[, 0.67 cores per node]`, or `2 workers` on this machine alone:
    a table's title."""
    if emulation is None:
        return f"{nproc_per_node} workers"
    threads = emulation.node_env(dict(os.environ))["OMP_NUM_THREADS"]
    each = f"{threads} thread{'' if threads == '1' else 's'} each"
    cores = "" if emulation.node_cpus is None else f", {emulation.node_cpus:g} cores per node"
    return f"{emulation.nodes} nodes x {emulation.procs_per_node} workers, link {emulation.link}, {each}{cores}"
