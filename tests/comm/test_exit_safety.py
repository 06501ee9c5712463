"""Exit waits until communication threads have released the hook's callbacks and finished their jobs (else: SIGABRT
at exit)."""

import threading
import time

import pytest

from conftest import run, torchrun_cmd, trainaccel_cmd
from trainaccel.comm import exit_guard, scheduler


def test_exit_drain_waits_for_release_by_another_thread():
    def callback():
        pass

    exit_guard.track(callback)
    holder = [callback]
    del callback
    assert len(exit_guard._unreleased_callbacks) == 1
    releaser = threading.Timer(0.1, holder.clear)  # as Gloo's thread drops the callback after running it
    releaser.start()
    started = time.monotonic()
    exit_guard._wait_for_callback_release()
    assert not exit_guard._unreleased_callbacks
    assert time.monotonic() - started >= 0.09
    releaser.join()


def test_exit_drain_gives_up_after_its_timeout():
    def callback():
        pass

    exit_guard.track(callback)
    started = time.monotonic()
    exit_guard._wait_for_callback_release(timeout_s=0.05)
    assert 0.05 <= time.monotonic() - started < 1.0
    del callback
    assert not exit_guard._unreleased_callbacks


def test_queued_jobs_are_waited_for_within_a_bound_and_not_while_an_error_ends_the_process(monkeypatch):
    monkeypatch.setattr(scheduler, "FINISH_WAIT_S", 0.2)
    release = threading.Event()
    scheduler.comm_thread().submit(lambda: release.wait(10))  # a collective whose peers never come
    try:
        started = time.monotonic()
        try:
            raise RuntimeError("a peer is gone")
        except RuntimeError:
            assert scheduler.finish_queued_jobs() is False  # an error ends the process: no wait
        assert time.monotonic() - started < 0.1
        assert scheduler.finish_queued_jobs() is False  # waited FINISH_WAIT_S, in vain
        assert time.monotonic() - started >= 0.2
        release.set()
        assert scheduler.finish_queued_jobs() is True
    finally:
        release.set()
        scheduler.stop_comm_thread()


SCRIPT = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from trainaccel.comm import exit_guard, register
dist.init_process_group("gloo")
model = DDP(nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)]), bucket_cap_mb=0.05)
register(model, compression="fp16")
sys.setswitchinterval(100)  # hold the GIL: Gloo's thread cannot release the callbacks yet
model(torch.randn(4, 128)).sum().backward()
exit_guard._wait_for_callback_release()
assert not exit_guard._unreleased_callbacks, "callbacks still held by the communication thread"
"""


@pytest.mark.multiprocess
def test_workers_exit_cleanly_right_after_backward(tmp_path):
    script = tmp_path / "exit_right_after_backward.py"
    script.write_text(SCRIPT)
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr


LATE_JOBS = """
import atexit, sys, threading, time, torch, torch.distributed as dist
from trainaccel.comm import DiLoCo
from trainaccel.comm.scheduler import comm_thread, engine_group
dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]

@atexit.register  # registered first, so it runs after trainaccel's own exit hooks
def threads_left():
    with open(f"{out}/threads{rank}", "w") as f:
        f.write(",".join(sorted(t.name for t in threading.enumerate() if t.name.startswith("trainaccel-comm"))))

model = torch.nn.Linear(4, 4)
DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)  # dropped at once, as a script may
group = engine_group(dist.group.WORLD)

def late_sum():
    time.sleep(1.0)  # still queued when the script destroys the group
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=group)
    with open(f"{out}/sum{rank}", "w") as f:
        f.write(str(total.item()))

def late_write():
    time.sleep(1.0)  # still running when the script ends
    with open(f"{out}/end{rank}", "w") as f:
        f.write("ran")

comm_thread().submit(late_sum)
dist.destroy_process_group()
comm_thread().submit(late_write)
"""


@pytest.mark.multiprocess
def test_jobs_still_queued_run_before_their_group_goes_and_before_the_process_ends(tmp_path):
    # A sync whose model was dropped, or auto's figures, still run when the script destroys its group or ends:
    # run to their end first (a job ending during finalization aborts the process).
    script = tmp_path / "late_jobs.py"
    script.write_text(LATE_JOBS)
    proc = run([*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2", script, tmp_path])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr
    for rank in range(2):
        assert (tmp_path / f"sum{rank}").read_text() == "3.0"  # the allreduce ran on the live group
        assert (tmp_path / f"end{rank}").read_text() == "ran"
        # Ended, not merely idle: a thread left running into finalization aborts the process when it takes the GIL
        # back from C++ (a CUDA future's completion after its last job, say).
        assert (tmp_path / f"threads{rank}").read_text() == ""
