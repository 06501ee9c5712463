"""StepMeter and --metrics-every: lines every N steps whose numbers match the loop's own timing."""

import json
import logging
import re
import time

import pytest

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd
from trainaccel.monitor import StepMeter

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
    assert record.data_time_s == pytest.approx(0.02, abs=0.005) and record.compute_time_s == pytest.approx(0.01, abs=0.005)
    assert record.examples_per_s_per_worker == pytest.approx(16 / measured, rel=0.05) == record.examples_per_s
    assert record.peak_memory_bytes > 0 and record.workers == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [4, 8] and lines[1]["data_time_s"] == record.data_time_s
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")] == [r.line() for r in meter.records]
    assert LINE.fullmatch(record.line())


def test_bad_every_is_named():
    with pytest.raises(ValueError, match="invalid every 0; accepted: an integer >= 1"):
        StepMeter(every=0)


def test_metrics_every_logs_lines_matching_the_scripts_own_timing(tmp_path):
    proc = run([*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2", "--metrics-every", "4",
                SCRIPTS / "metrics_loop.py", tmp_path, "13"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [LINE.search(line) for line in (proc.stdout + proc.stderr).splitlines() if LINE.search(line)]
    assert [int(m.group(1)) for m in lines] == [4, 8, 12]  # forward-to-forward: step 12 closes at the 13th forward
    forwards = read_ranks(tmp_path, 2)[0]["forwards"]
    for m in lines:
        step = int(m.group(1))
        measured = (forwards[step] - forwards[step - 4]) / 4  # rank 0's own mean over the same steps
        per_worker, total, workers, step_ms, data_ms, compute_ms = (float(m.group(i).replace(",", "")) for i in range(2, 8))
        assert workers == 2 and total == pytest.approx(2 * per_worker, rel=0.01)
        assert step_ms / 1e3 == pytest.approx(measured, rel=0.15)
        assert per_worker == pytest.approx(8 / measured, rel=0.15)
        assert 25 <= data_ms <= step_ms - 15  # the 30 ms sleep before each forward; the 20 ms one is compute
