"""A worker that dies without a word (SIGABRT, as NCCL's watchdog ends one whose collective timed out): its node's
`trainaccel run` publishes the failure in the job's store, and every node ends at once, naming it."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import free_port, trainaccel_cmd
from trainaccel.bench.faults import ProcessTree
from trainaccel.launch.watchdog import death_reason
from trainaccel.resilience.failfast import failure_record, publish_record

WORKER = Path(__file__).resolve().parents[2] / "src" / "trainaccel" / "bench" / "fault_worker.py"
AT = 5
BOUND_S = 30  # well under hang_timeout: the hang judge cannot be what ends it
RANK1 = r"rank 1 \(host \S+, node 1, local rank 0\)"


@pytest.mark.multiprocess
def test_an_aborted_worker_is_published_by_its_launcher_and_every_node_ends(tmp_path):
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    logs = [tmp_path / f"node{node}.log" for node in range(2)]
    procs = []
    for node, log in enumerate(logs):
        with open(log, "w") as out:
            command = [
                *trainaccel_cmd(),
                *["run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"],
                *["--master-addr", "127.0.0.1", "--master-port", str(port), "--hang-timeout", "300"],
                *[str(WORKER), "--fault", "abort", "--rank", "1", "--at", str(AT), "--step-s", "0.1"],
                # Rank 0 trains on without a collective, as if blocked in NCCL's: no error tells it of rank 1.
                *["--peers-no-sync-s", "600"],
            ]
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=base))
    tree = ProcessTree([p.pid for p in procs])
    try:
        deadline = time.monotonic() + 120
        while f"meets fault abort at step {AT}" not in logs[1].read_text():
            assert time.monotonic() < deadline and procs[1].poll() is None, logs[1].read_text()[-3000:]
            tree.scan()
            time.sleep(0.1)
        aborted = time.monotonic()
        while time.monotonic() - aborted < BOUND_S + 30:
            tree.scan()
            if not tree.alive():
                break
            time.sleep(0.2)
        took = time.monotonic() - aborted
        survivors = tree.alive()
    finally:
        tree.kill()
        for p in procs:
            p.wait(timeout=30)
    outputs = [log.read_text() for log in logs]
    tails = "\n\n".join(out[-3000:] for out in outputs)
    assert survivors == [] and took < BOUND_S, (took, tails)
    assert all(p.returncode != 0 for p in procs), tails
    ended = (
        r"trainaccel: ending rank 0: " + RANK1 + r" failed first: its process was ended by SIGABRT \(signal 6\) "
        r"without a Python error: abort\(\) in native code \(published by its node's trainaccel run\)"
    )
    assert re.search(ended, outputs[0]), tails
    said = r"trainaccel run: local rank 0 \(rank 1, pid \d+\): its process was ended by SIGABRT \(signal 6\)"
    assert re.search(said, outputs[1]), tails


def _status(code: int, status: int) -> os.waitid_result:
    return os.waitid_result((4242, 0, signal.SIGCHLD, status, code))


def test_how_a_worker_died_reads_as_its_failure():
    beat = {"rank": 1, "nccl": True}
    assert death_reason(_status(os.CLD_KILLED, signal.SIGABRT), beat).endswith(
        "SIGABRT (signal 6) without a Python error: NCCL's watchdog ends a worker so when one of its collectives "
        "timed out"
    )
    assert "a crash in native code" in death_reason(_status(os.CLD_DUMPED, signal.SIGSEGV), beat)
    assert death_reason(_status(os.CLD_EXITED, 3), beat) == "its process exited with status 3 without a Python error"
    # Stopped by torchrun's agent or the user, ended cleanly, or not known: no failure of its own.
    assert death_reason(_status(os.CLD_KILLED, signal.SIGTERM), beat) is None
    assert death_reason(_status(os.CLD_EXITED, 0), beat) is None
    assert death_reason(None, beat) is None


def test_a_published_failure_is_never_replaced():
    store = dist.HashStore()
    own = failure_record(1, "RuntimeError: out of memory", host="n1", node="1", local_rank=0)
    assert publish_record(store, own, "trainaccel/0/")
    later = failure_record(1, "its process exited with status 1 without a Python error", host="n1")
    assert not publish_record(store, later, "trainaccel/0/")
    assert store.get("trainaccel/0/failure").decode() == __import__("json").dumps(own)


def test_a_launcher_waits_for_its_failure_to_be_read_only_where_the_peers_read_failures(monkeypatch):
    """Under on_lost_replica=continue (`survivors` in the heartbeat file) the peers drop the rank at their next sync
    and count no reads: waiting for them would only delay the lost node's launcher."""
    from trainaccel.launch.watchdog import publish_death
    from trainaccel.resilience import failfast

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    waited = []
    monkeypatch.setattr(failfast, "await_readers", lambda store, key, readers: waited.append((key, readers)))
    for survivors in (False, True):
        key = f"job-{survivors}/"
        beat = {"rank": 2, "local_rank": 0, "world": 3, "store": ["127.0.0.1", store.port], "key": key}
        failure = publish_death(123, {**beat, "survivors": survivors}, "its process was ended by SIGKILL", False)
        assert failure is not None and store.check([key + "failure"])
    assert waited == [("job-False/", 2)]
