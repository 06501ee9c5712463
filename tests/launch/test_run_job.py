"""A benchmark or demo job stopped from outside (SIGTERM to `trainaccel bench`, Ctrl-C) leaves no worker running:
torchrun starts its workers in sessions of their own, so only a launcher given time to stop them does."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port
from trainaccel.launch.watchdog import process_stat

# A worker that says its pid, then trains "forever" (far longer than the test waits).
WORKER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)"
# The bench's own shape: SIGTERM turned into an interrupt around run_job.
DRIVER = """
import sys
from pathlib import Path
from trainaccel.bench.jobs import sigterm_as_interrupt
from trainaccel.launch.local import TORCHRUN, run_job
worker, pid_file, port = sys.argv[1:]
with sigterm_as_interrupt():
    run_job("sleeper", [*TORCHRUN, "--standalone", "--nproc-per-node=1", f"--master-port={port}", worker, pid_file],
            Path(pid_file + ".json"))
"""


def _alive(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie awaiting its parent has ended


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_job_stops_its_workers(tmp_path, signum):
    worker, pid_file = tmp_path / "worker.py", tmp_path / "worker.pid"
    worker.write_text(WORKER)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(worker), str(pid_file), str(free_port())])
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert driver.poll() is None, "the job ended before its worker started"
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        driver.send_signal(signum)
        assert driver.wait(timeout=30) != 0
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"worker {pid} still running after its job was stopped with {signum.name}"
    finally:
        driver.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
