"""Hang detection: the judge that names a hung rank, each worker's step clock, and the launcher's watchdog."""

import json
import socket
import subprocess
import sys
import time

import pytest

from trainaccel.config import Config, ConfigError
from trainaccel.launch.watchdog import Watchdog
from trainaccel.resilience.failfast import (
    HANG_MIN_S,
    HangJudge,
    StepClock,
    describe_failure,
    hang_deadline,
)


def beat(step, time_, forwards=None, step_s=0.1, node="1"):
    return {
        "host": "h",
        "node": node,
        "local_rank": 0,
        "time": time_,
        "step": step,
        "forwards": forwards or step,
        "step_s": step_s,
    }


def run_judge(timeline, hang_timeout=10.0, world=2):
    """Feed `timeline` (now -> beats by rank) to a judge; returns (first verdict's time and text, warnings)."""
    judge = HangJudge(hang_timeout)
    for now, beats in timeline:
        verdict = judge.observe(beats, now, world)
        if verdict is not None:
            return now, verdict
    return None, None


def two_ranks(seconds, rank1, rank0_step=6, every=1.0):
    """Rank 0 waits at `rank0_step` beating; rank 1's beat at time t is `rank1(t)`."""
    return [(t, {0: beat(rank0_step, t), 1: rank1(t)}) for t in [i * every for i in range(int(seconds / every) + 1)]]


@pytest.mark.parametrize("hang_timeout", [10.0, 30.0])
def test_a_rank_behind_and_idle_is_named_once_the_deadline_passes(hang_timeout, caplog):
    when, verdict = run_judge(two_ranks(3 * hang_timeout, lambda t: beat(5, t)), hang_timeout)
    assert verdict.rank == 1 and hang_timeout < when <= hang_timeout + 1
    assert "rank 1 (host h, node 1, local rank 0) is hung: alive but at step 5" in verdict.text
    assert "while rank 0 waits at step 6" in verdict.text and f"(hang_timeout {hang_timeout:g} s)" in verdict.text
    warned = [r.message for r in caplog.records if "may be hung" in r.message]
    assert len(warned) == 1 and "rank 1" in warned[0]  # at half the deadline, once


def test_a_rank_whose_heartbeat_stopped_is_named():
    when, verdict = run_judge(two_ranks(30, lambda t: beat(6, min(t, 2.0))), 10.0)
    assert verdict.rank == 1 and 12 < when <= 13  # its beat last changed at 2 s
    assert "no heartbeat for 11 s: its process is gone, stopped, stuck outside Python, or cut off" in verdict.text


@pytest.mark.parametrize(
    "beats",
    [
        # Slow steps (4 s where the others take none) still advance the slowest step: warned at most, never ended.
        pytest.param(lambda t: (beat(6 + int(t // 4), t), beat(5 + int(t // 4), t)), id="straggler-still-stepping"),
        pytest.param(lambda t: (beat(6, t), beat(5, t, forwards=100 + int(t))), id="evaluating-alone"),
        pytest.param(lambda t: (beat(6, t), beat(6, t)), id="same-step-as-its-peers"),
        pytest.param(lambda t: (beat(2, t), beat(1, t)), id="not-warm-yet"),
    ],
)
def test_a_rank_that_is_busy_slow_level_or_warming_up_is_not_named(beats):
    timeline = [(float(t), dict(enumerate(beats(float(t))))) for t in range(60)]
    when, verdict = run_judge(timeline, 10.0)
    assert verdict is None, verdict.text


def test_no_verdict_until_every_rank_beats_or_when_off():
    timeline = [(t, {0: beat(6, t)}) for t in range(60)]
    assert run_judge(timeline, 10.0) == (None, None)
    assert run_judge(two_ranks(60, lambda t: beat(5, t)), 0.0) == (None, None)


def test_auto_deadline_is_ten_median_step_times_and_at_least_a_minute():
    assert hang_deadline("auto", [None]) is None
    assert hang_deadline("auto", [0.5, 0.4, None]) == HANG_MIN_S
    assert hang_deadline("auto", [20.0, 30.0, 25.0]) == 250.0
    assert hang_deadline(7.5, [20.0]) == 7.5 and hang_deadline(0.0, [1.0]) is None
    step_s = 12.0  # a slow job: 10 steps of 12 s
    when, verdict = run_judge(
        [(t, {0: beat(6, t, step_s=step_s), 1: beat(5, t, step_s=step_s)}) for t in range(200)], "auto"
    )
    assert 120 < when <= 121 and "(hang_timeout auto: 120 s)" in verdict.text


def test_step_clock_measures_the_median_step_after_the_first():
    clock = StepClock()
    clock.observe(0, 0.0)
    clock.observe(1, 30.0)  # start-up: not a step
    assert clock.median_s() is None and not clock.warm()
    for t, step in [(32.0, 2), (34.0, 3), (40.0, 4), (42.0, 5)]:
        clock.observe(step, t)
    assert clock.median_s() == 2.0 and clock.warm()
    clock.observe(0, 50.0)  # a new group: counting starts over, the samples stay
    assert clock.median_s() == 2.0


def test_a_published_failure_reads_as_one_line():
    failure = {"rank": 3, "host": "n1", "node": "1", "local_rank": 1, "reason": "RuntimeError: boom"}
    assert describe_failure(failure) == "rank 3 (host n1, node 1, local rank 1) failed first: RuntimeError: boom"
    assert describe_failure({**failure, "host": None, "reason": "rank 3 (...) is hung"}) == (
        "the job failed: rank 3 (...) is hung"
    )


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("AUTO", "auto"), ("90", 90.0), (0, 0.0)])
def test_hang_timeout_values(value, expected):
    assert Config.resolve(env={}, hang_timeout=value).hang_timeout == expected


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_hang_timeout_refuses_bad_values(value):
    with pytest.raises(ConfigError, match=r"invalid hang_timeout=.*accepted: auto, or a number >= 0"):
        Config.resolve(env={}, hang_timeout=value)


@pytest.mark.multiprocess
def test_the_watchdog_kills_a_child_whose_heartbeat_is_stale_and_nothing_else(tmp_path):
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        with Watchdog(interval_s=3600) as watchdog:  # checked by hand below
            now = time.time()
            files = {
                "0": {"pid": children[0].pid, "rank": 4, "time": now - 20, "limit_s": 10},  # stale: ended
                "1": {"pid": children[1].pid, "rank": 5, "time": now - 5, "limit_s": 10},  # fresh
                "2": {"pid": 1, "rank": 6, "time": now - 20, "limit_s": 10},  # stale, but not our child
            }
            for name, content in files.items():
                (watchdog.folder / f"{name}.json").write_text(json.dumps(content))
            (watchdog.folder / "3.json").write_text("{not json")
            said = watchdog.check(now)
            assert children[0].wait(timeout=10) == -9
            assert children[1].poll() is None and children[2].poll() is None
            assert said == [
                f"trainaccel run: ended local rank 0 (rank 4, pid {children[0].pid}): no heartbeat for 20 s, past "
                "its limit of 10 s: it is stopped, or stuck outside Python"
            ]
            folder = watchdog.folder
        assert not folder.exists()
    finally:
        for child in children:
            child.kill()


@pytest.mark.multiprocess
def test_a_worker_that_dies_as_the_launcher_ends_is_still_said_and_published(tmp_path, capfd):
    # The watchdog's thread is held publishing worker A's death (A's store accepts but never answers), B dies and
    # is reaped the way torchrun's agent does it, and the launcher ends at once: B's death is still said.
    script = "import os, signal, sys; sys.stdin.read(1); os.kill(os.getpid(), signal.SIGKILL)"
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers them
    try:
        with Watchdog(interval_s=3600) as watchdog:
            workers = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE) for _ in range(2)]
            store = {"store": list(silent.getsockname()), "key": "k"}
            for rank, worker in enumerate(workers):
                beat_ = {"pid": worker.pid, "rank": rank, "local_rank": rank, "time": time.time(), "limit_s": 100}
                (watchdog.folder / f"{rank}.json").write_text(json.dumps({**beat_, **(store if rank == 0 else {})}))
            for worker in workers:
                worker.stdin.write(b"x")
                worker.stdin.flush()
                if worker is workers[0]:
                    deadline = time.monotonic() + 10
                    while "rank 0, pid" not in (said := capfd.readouterr().err) and time.monotonic() < deadline:
                        time.sleep(0.01)  # until the thread is publishing A's death
                    assert "rank 0, pid" in said
                while worker.poll() is None:
                    time.sleep(0.1)  # torchrun's agent's check
                assert worker.returncode == -9
    finally:
        silent.close()
    said = capfd.readouterr().err
    assert f"local rank 1 (rank 1, pid {workers[1].pid}): its process was ended by SIGKILL" in said, said
    host, port = store["store"]
    assert f"rank 0's failure is not published: the job's store ({host}:{port}) did not answer in 6 s\n" in said


@pytest.mark.multiprocess
def test_a_worker_reaped_before_its_status_was_read_is_published_from_torchruns_report(capfd):
    # The watchdog's SIGCHLD handler set aside until the worker is reaped, as torchrun's agent can reap it in the
    # moment before the handler runs: only the agent's report (ChildFailedError: pid, exit code) says how it ended.
    import signal

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = "import os, signal, sys; sys.stdin.read(1); os.kill(os.getpid(), signal.SIGKILL)"
    with Watchdog(interval_s=3600) as watchdog:
        worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
        beat_ = {"pid": worker.pid, "rank": 2, "local_rank": 0, "time": time.time(), "limit_s": 100}
        beat_.update(store=["127.0.0.1", store.port], key="job/", world=1)
        (watchdog.folder / "0.json").write_text(json.dumps(beat_))
        handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            worker.stdin.write(b"x")
            worker.stdin.flush()
            assert worker.wait(timeout=30) == -9  # reaped unseen
        finally:
            signal.signal(signal.SIGCHLD, handler)
        time.sleep(0.5)
        assert f"pid {worker.pid}" not in capfd.readouterr().err, "the watchdog could not have seen it"
        assert not store.check(["job/failure"])
        watchdog.reaped({worker.pid: -9, 99999999: 1})  # (a pid it never knew, with no heartbeat: nothing)
    said = capfd.readouterr().err
    assert f"local rank 0 (rank 2, pid {worker.pid}): its process was ended by SIGKILL (signal 9)" in said, said
    failure = json.loads(store.get("job/failure"))
    assert failure["rank"] == 2 and "ended by SIGKILL" in failure["reason"], failure
    assert "99999999" not in said
