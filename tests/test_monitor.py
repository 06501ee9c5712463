"""StepMeter and --metrics-every: lines every N steps whose numbers match the loop's own timing."""

import json
import logging
import re
import time

import pytest

from conftest import SCRIPTS, read_ranks, run, run_nodes, trainaccel_cmd
from trainaccel.monitor import StepMeter, StragglerDetector

CHECK = re.compile(r"straggler check at step (\d+): own work per step by rank: ([\d., ]+) ms")
STRAGGLER = re.compile(
    r"straggler at step (\d+): rank (\d+) \(host (\S+), local rank (\d+)\) is (\d+)% slower than the median"
)
LINE = re.compile(
    r"step (\d+) \| ([\d,.]+) examples/s per worker, ([\d,.]+) total \((\d+) workers\) \| step ([\d.]+) ms: "
    r"data ([\d.]+) ms, compute ([\d.]+) ms \| peak memory ([\d,]+) MiB"
)


def _slow_batches(n: int, wait: float):
    for i in range(n):
        time.sleep(wait)
        yield i


def test_a_timed_loop_in_one_process(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainaccel")
    meter = StepMeter(every=4, jsonl=tmp_path / "metrics.jsonl")
    starts = []
    for _ in meter.wrap(_slow_batches(8, 0.02)):
        time.sleep(0.01)  # compute
        meter.step(batch_size=16)
        starts.append(time.perf_counter())
    assert [r.step for r in meter.records] == [4, 8]
    record = meter.records[1]
    measured = (starts[7] - starts[3]) / 4  # the loop's own mean step over the second window
    assert record.step_time_s == pytest.approx(measured, rel=0.05)
    assert record.data_time_s == pytest.approx(0.02, abs=0.005) and record.compute_time_s == pytest.approx(
        0.01, abs=0.005
    )
    assert record.examples_per_s_per_worker == pytest.approx(16 / measured, rel=0.05) == record.examples_per_s
    assert record.peak_memory_bytes > 0 and record.workers == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [4, 8] and lines[1]["data_time_s"] == record.data_time_s
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")] == [
        r.line() for r in meter.records
    ]
    assert LINE.fullmatch(record.line())


def test_bad_every_is_named():
    with pytest.raises(ValueError, match="invalid every 0; accepted: an integer >= 1"):
        StepMeter(every=0)


def test_own_time_leaves_out_the_waits_for_peers():
    detector = StragglerDetector(every=2)
    with detector.waiting():
        time.sleep(0.05)  # a collective waiting for a slower peer
    time.sleep(0.02)
    detector.waited(0.01)
    assert detector.step() is None
    report = detector.step(own_time_s=0.03)
    assert report.step == 2 and report.stragglers == ()  # one worker is its own median
    assert report.own_times_s[0] == pytest.approx((0.02 - 0.01 + 0.03) / 2, abs=0.004)
    assert detector.reports == [report]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every": 0}, "invalid every 0; accepted: an integer >= 1"),
        ({"threshold": -0.1}, "invalid threshold -0.1; accepted: a number > 0"),
    ],
)
def test_bad_detector_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StragglerDetector(**kwargs)


@pytest.mark.multiprocess
def test_metrics_every_logs_lines_matching_the_scripts_own_timing(tmp_path):
    proc = run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--metrics-every",
            "4",
            SCRIPTS / "metrics_loop.py",
            tmp_path,
            "13",
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [LINE.search(line) for line in (proc.stdout + proc.stderr).splitlines() if LINE.search(line)]
    assert [int(m.group(1)) for m in lines] == [4, 8, 12]  # forward-to-forward: step 12 closes at the 13th forward
    forwards = read_ranks(tmp_path, 2)[0]["forwards"]
    for m in lines:
        step = int(m.group(1))
        measured = (forwards[step] - forwards[step - 4]) / 4  # rank 0's own mean over the same steps
        per_worker, total, workers, step_ms, data_ms, compute_ms = (
            float(m.group(i).replace(",", "")) for i in range(2, 8)
        )
        assert workers == 2 and total == pytest.approx(2 * per_worker, rel=0.01)
        assert step_ms / 1e3 == pytest.approx(measured, rel=0.15)
        assert per_worker == pytest.approx(8 / measured, rel=0.15)
        assert 25 <= data_ms <= step_ms - 15  # the 30 ms sleep before each forward; the 20 ms one is compute


@pytest.mark.multiprocess
def test_a_worker_half_again_as_slow_is_named_and_the_timeline_shows_steps_and_bucket_stages(tmp_path):
    trace = tmp_path / "trace.json"
    env = {"TRAINACCEL_STRAGGLER_EVERY": "4", "TRAINACCEL_TIMELINE": str(trace), "TRAINACCEL_LOG_LEVEL": "debug"}
    # 2 emulated nodes x 2 workers: rank 2 is node 1's first worker; the reduction is hierarchical.
    procs = run_nodes(
        SCRIPTS / "straggler_loop.py", "10", "2", nodes=2, per_node=2, launcher=[*trainaccel_cmd(), "run"], env=env
    )
    assert all(p.returncode == 0 for p in procs), "\n".join(p.stdout[-3000:] for p in procs)
    out = procs[0].stdout  # rank 0's node
    checks = [int(m.group(1)) for m in CHECK.finditer(out)]
    assert checks == [4, 8], out[-3000:]  # steps closed from the second forward on (the first registers the hook)
    named = [m.groups() for m in STRAGGLER.finditer(out)]
    assert named and int(named[0][0]) in checks[:2], out[-3000:]
    assert {(rank, local) for _, rank, _, local, _ in named} == {("2", "0")}, named  # that rank and no other
    assert all(int(slower) >= 20 for *_, slower in named)

    events = json.loads(trace.read_text())  # a complete JSON array of trace events
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0} and all(e["dur"] >= 0 for e in spans)
    by_track: dict[str, list[dict]] = {}
    for e in sorted(spans, key=lambda e: e["ts"]):
        by_track.setdefault(tracks[e["tid"]], []).append(e)
    assert [e["name"] for e in by_track.pop("steps")] == [f"step {i}" for i in range(1, 9)]
    assert sorted(by_track) == ["bucket 0", "bucket 1"]
    stages = ["intra-node reduce", "encode", "inter-node allreduce", "decode", "intra-node gather"]
    for name, track in by_track.items():
        names = [e["name"] for e in track]
        # Each step's bucket, in order (DDP sets its buckets up after the first step, which may differ).
        assert len(names) >= 9 * len(stages) and names == stages * (len(names) // len(stages)), name
        for before, after in zip(track, track[1:]):
            assert after["ts"] >= before["ts"] + before["dur"] - 1, name  # spans on a track do not overlap


def test_timeline_is_written_on_rank_zero_or_per_rank_and_closes_as_valid_json(tmp_path):
    from trainaccel.monitor import timeline

    assert timeline.start(tmp_path / "trace.json", rank=1) is None  # only rank 0 writes a plain path
    trace = timeline.start(tmp_path / "trace-{rank}.json", rank=1)
    try:
        assert trace is timeline.current() and trace.path == tmp_path / "trace-1.json"
        t0 = time.perf_counter()
        trace.span("encode", t0, t0 + 0.001, timeline.bucket_track(3), codec="FP16")
        trace.span("allreduce", t0 + 0.001, t0 + 0.003, timeline.bucket_track((3, 1)))
        trace.flush()
        assert trace.path.read_text().startswith("[\n") and not trace.path.read_text().rstrip().endswith("]")
    finally:
        timeline.stop()
    events = json.loads((tmp_path / "trace-1.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(names[e["tid"]], e["name"], e["dur"]) for e in events if e["ph"] == "X"]
    assert spans == [
        ("bucket 3", "encode", pytest.approx(1000, abs=1)),
        ("bucket 3.1", "allreduce", pytest.approx(2000, abs=1)),
    ]
    assert list(names.values()) == ["steps", "bucket 3", "bucket 3.1"] and timeline.current() is None


class _Event:
    """Stands in for a CUDA timing event: recorded at `at` (ms), complete or still pending on the device."""

    def __init__(self, at: float, complete: bool = True):
        self.at, self.complete = at, complete

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: "_Event") -> float:
        return end.at - self.at


@pytest.mark.parametrize(
    "ready, done, expected",
    [
        (1.0, 1.25, 0.25),  # host clock (CPU)
        (None, 1.0, 0.0),  # no step seen
        (_Event(100.0), _Event(350.0), 0.25),  # device events: the device's wait, in seconds
        (_Event(100.0), _Event(350.0, complete=False), 0.0),  # still pending: no sample, and no wait for it
    ],
)
def test_the_wait_for_peers_is_timed_where_the_work_runs(ready, done, expected):
    from trainaccel.comm.hooks import CommWait

    wait = CommWait()
    wait.ready, wait.done = ready, done
    assert wait.take() == pytest.approx(expected)
    assert wait.ready is None and wait.done is None
