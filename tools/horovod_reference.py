"""Run Horovod's own PyTorch test suite against `trainaccel.horovod` and summarise the outcome.

    python tools/horovod_reference.py HOROVOD_SRC [--nproc 2] [--launcher horovodrun|mpirun] [-k EXPR] [--out DIR]

HOROVOD_SRC is a Horovod source tree holding `test/parallel/test_torch.py` and
`test/utils/common.py`: a git checkout (the source archive on PyPI leaves `test/` out).
Nothing of Horovod is imported: a shim package maps `horovod.torch` to `trainaccel.horovod`.
The workers are started by `trainaccel run` with the environment horovodrun's Gloo mode gives
(HOROVOD_RANK, HOROVOD_SIZE, ...), each runs pytest on the suite and records each result as
it happens; a test passes when it passed on every rank. After each test a worker whose
tearDown failed (a test that failed on some ranks only leaves the others in a collective)
meets the others' tearDown barrier and shuts Horovod down, then the workers wait for one
another, so the next test starts on every rank alike. If a test kills the workers, it is
reported as failed and the run goes on after it.

With `--launcher mpirun` the workers get Open MPI's variables instead (OMPI_COMM_WORLD_RANK,
...). The suite's tearDown then never shuts Horovod down, as under mpirun: every test runs in
one process group, with whatever the tests before it left in flight, and the tool only waits
for every rank between tests.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SHIMS = {
    # `import horovod.torch as hvd` gives trainaccel.horovod.
    "horovod/__init__.py": "import sys\nimport trainaccel.horovod as torch\nsys.modules['horovod.torch'] = torch\n",
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    # common.py imports in_thread for its helpers; the suite under test never calls it.
    "horovod/runner/util/threads.py": (
        "import threading\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"
    ),
}
NEWER_OPTIMIZERS = ["Muon"]
TEST_TIMEOUT_S = 180
OPTIONAL_SHIMS = {"mock": "from unittest.mock import *\n", "cloudpickle": "from pickle import *\n"}


def write_shims(root: Path) -> None:
    for rel, text in SHIMS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for module, text in OPTIONAL_SHIMS.items():
        try:
            __import__(module)
        except ImportError:
            (root / f"{module}.py").write_text(text)


class _Recorder:
    """A pytest plugin: one JSON line per test phase as it happens, so a crash loses nothing before it."""

    def __init__(self, path: Path, sync_dir: Path, rank: int, world: int, shut_down: bool):
        self.file = path.open("a")
        self.sync_dir, self.rank, self.world, self.tests_done = sync_dir, rank, world, 0
        self.shut_down = shut_down  # as the suite's tearDown does under horovodrun

    def _write(self, **record: str) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self._write(test=nodeid, outcome="started")
        # A test that fails on some ranks only leaves the others waiting in a collective:
        # end the worker, so the run goes on from the next test.
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        # Called after the test's last phase: align the ranks before the next test starts. The
        # timeout set at its start still runs, so a rank that never arrives ends the workers.
        self._align()
        faulthandler.cancel_dump_traceback_later()

    def _align(self) -> None:
        """Leave the test with Horovod shut down on this rank, then wait until every rank has left it."""
        hvd = sys.modules.get("trainaccel.horovod")
        if self.shut_down and hvd is not None and hvd.is_initialized():
            # The test's tearDown failed here (its barrier met a rank still in the test). That
            # rank raised too and is now in its own tearDown's barrier: meet it there, so that
            # it can shut down as well instead of waiting for this rank forever.
            for _ in range(3):
                try:
                    hvd.barrier()
                    break
                except RuntimeError:
                    continue
            hvd.shutdown()
        self.tests_done += 1
        (self.sync_dir / f"{self.tests_done}.{self.rank}").touch()
        while sum(1 for _ in self.sync_dir.glob(f"{self.tests_done}.*")) < self.world:
            time.sleep(0.01)

    def pytest_runtest_logreport(self, report: object) -> None:
        outcome = report.outcome  # type: ignore[attr-defined]
        if outcome == "passed" and report.when != "call":  # type: ignore[attr-defined]
            return
        message = ""
        if outcome != "passed":
            text = getattr(report, "longreprtext", "") or ""
            lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()[-1:]
            message = lines[-1][:300] if lines else ""
        self._write(test=report.nodeid, outcome=outcome, message=message)  # type: ignore[attr-defined]


def worker(suite: Path, out: Path, expr: str | None, skip: list[str], sync_dir: Path, launcher: str) -> int:
    """One rank: horovodrun's Gloo environment (or mpirun's), then pytest on the suite."""
    import pytest

    rank = os.environ["RANK"]
    if launcher == "mpirun":
        os.environ.update(
            OMPI_COMM_WORLD_RANK=rank,
            OMPI_COMM_WORLD_SIZE=os.environ["WORLD_SIZE"],
            OMPI_COMM_WORLD_LOCAL_RANK=os.environ["LOCAL_RANK"],
            OMPI_COMM_WORLD_LOCAL_SIZE=os.environ["LOCAL_WORLD_SIZE"],
        )
    else:
        os.environ.update(
            HOROVOD_RANK=rank,
            HOROVOD_SIZE=os.environ["WORLD_SIZE"],
            HOROVOD_LOCAL_RANK=os.environ["LOCAL_RANK"],
            HOROVOD_LOCAL_SIZE=os.environ["LOCAL_WORLD_SIZE"],
            HOROVOD_CROSS_RANK=os.environ.get("GROUP_RANK", "0"),
            HOROVOD_CROSS_SIZE="1",
        )
    import torch

    # Some tests loop over every torch.optim optimizer whose module starts with "torch.optim".
    # Optimizers newer than the suite (Muon takes only 2-D parameters) fail there under Horovod
    # itself, so they are moved out of that enumeration.
    for newer in NEWER_OPTIMIZERS:
        if hasattr(torch.optim, newer):
            getattr(torch.optim, newer).__module__ = "hidden_from_the_suite"
    args = [str(suite), "-q", "-p", "no:cacheprovider", "-p", "no:faulthandler"]
    if expr:
        args += ["-k", expr]
    for nodeid in skip:
        args += ["--deselect", nodeid]
    world = int(os.environ["WORLD_SIZE"])
    recorder = _Recorder(out / f"rank{rank}.jsonl", sync_dir, int(rank), world, shut_down=launcher != "mpirun")
    return int(pytest.main(args, plugins=[recorder]))


def read_results(out: Path, nproc: int) -> tuple[dict[str, list[tuple[str, str]]], set[str]]:
    """Per test, each rank's (outcome, message); and the tests some rank started but never finished."""
    results: dict[str, list[tuple[str, str]]] = {}
    unfinished: set[str] = set()
    for rank in range(nproc):
        report = out / f"rank{rank}.jsonl"
        if not report.exists():
            continue
        started: set[str] = set()
        for line in report.read_text().splitlines():
            record = json.loads(line)
            if record["outcome"] == "started":
                started.add(record["test"])
                continue
            started.discard(record["test"])
            results.setdefault(record["test"], []).append((record["outcome"], record["message"]))
        unfinished |= started
    return results, unfinished


def summarise(results: dict[str, list[tuple[str, str]]], crashed: set[str], nproc: int) -> Counter:
    totals: Counter = Counter()
    for name in sorted(set(results) | crashed):
        per_rank = results.get(name, [])
        kinds = {k for k, _ in per_rank}
        if name in crashed:
            verdict, why = "failed", "crashed or hung the workers"
        else:
            verdict = "failed" if "failed" in kinds else "skipped" if "skipped" in kinds else "passed"
            why = next((m for k, m in per_rank if k != "passed" and m), "")
        totals[verdict] += 1
        short = name.split("::")[-1]
        print(f"{verdict:8} {short}" + (f"  -- {why}" if why and verdict != "passed" else ""))
    print(f"\n{nproc} workers: " + ", ".join(f"{totals[k]} {k}" for k in ("passed", "failed", "skipped")))
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod_src", type=Path, help="Horovod source tree with test/parallel/test_torch.py")
    parser.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    parser.add_argument(
        "--launcher",
        choices=["horovodrun", "mpirun"],
        default="horovodrun",
        help="whose environment the workers get; under mpirun the suite never shuts Horovod down (default horovodrun)",
    )
    parser.add_argument("-k", dest="expr", help="pytest -k expression to select tests")
    parser.add_argument("--out", type=Path, help="where the per-rank reports go (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    suite = args.horovod_src / "test" / "parallel" / "test_torch.py"
    if not suite.is_file():
        parser.error(f"{suite} not found; HOROVOD_SRC must be a Horovod source tree")
    out = args.out or Path(tempfile.mkdtemp(prefix="hvdref-"))
    if args.worker:
        return worker(suite, out, args.expr, args.skip, args.sync_dir or out, args.launcher)
    out.mkdir(parents=True, exist_ok=True)
    shims = out / "shims"
    write_shims(shims)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shims), os.environ.get("PYTHONPATH")]))}
    crashed: set[str] = set()
    while True:
        results, unfinished = read_results(out, args.nproc)
        crashed |= unfinished
        # Each launch aligns its ranks in a fresh folder: a relaunch counts its tests from 0 again.
        sync_dir = tempfile.mkdtemp(prefix="sync-", dir=out)
        cmd = [
            sys.executable,
            "-m",
            "trainaccel",
            "run",
            "--nproc-per-node",
            str(args.nproc),
            __file__,
            str(args.horovod_src),
            "--worker",
            "--out",
            str(out),
            "--sync-dir",
            sync_dir,
            "--launcher",
            args.launcher,
        ]
        if args.expr:
            cmd += ["-k", args.expr]
        for nodeid in sorted(set(results) | crashed):
            cmd += ["--skip", nodeid]
        code = subprocess.call(cmd, env=env)
        results, unfinished = read_results(out, args.nproc)
        if code == 0 or not unfinished - crashed:
            break  # finished, or crashed without starting anything new: stop rather than loop
        print(f"the workers died during {sorted(unfinished - crashed)}; going on with the rest")
    totals = summarise(results, crashed | unfinished, args.nproc)
    print(f"reports in {out}")
    return 0 if not totals["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
