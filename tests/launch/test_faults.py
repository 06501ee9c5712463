"""Faults on 2 emulated nodes (network namespaces), each node under its own `trainaccel run`: every process on
every node is gone within the hang deadline plus 30 s, the error names the failing rank and node, and no
namespace or process is left behind."""

import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import selected_params
from trainaccel.bench.emulate import namespaces, why_not_emulated
from trainaccel.bench.faults import FAULTS, run_fault

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(why_not_emulated() is not None, reason="needs root and iproute2 to build network namespaces"),
]

HANG_TIMEOUT_S = 5.0
SLOW = {"hang_timeout": 12.0, "slow_s": 8.5}  # the straggler's step: past half of its deadline, short of all of it
RANK1 = r"rank 1 \(host \S+, node 1, local rank 0\)"
EXPECTED = {  # fault -> (what node 0 says first, what node 1 says first)
    "hang": (RANK1 + r" is hung: alive but at step 29 for \d+ s while rank 0 waits at step 30", RANK1 + " is hung"),
    "stop": (
        RANK1 + r" is hung: no heartbeat for \d+ s: its process is gone, stopped, stuck outside Python, or cut off",
        r"trainaccel run: ended local rank 0 \(rank 1, pid \d+\): no heartbeat for \d+ s",
    ),
    "kill": (RANK1, r"trainaccel run: local rank 0 \(rank 1, pid \d+\): its process was ended by SIGKILL"),
    # Its peer trains without a collective (as if blocked in NCCL's): only its launcher's publication ends it.
    "abort": (
        RANK1 + r" failed first: its process was ended by SIGABRT \(signal 6\) without a Python error: abort\(\) "
        r"in native code \(published by its node's trainaccel run\)",
        r"trainaccel run: local rank 0 \(rank 1, pid \d+\): its process was ended by SIGABRT",
    ),
    "raise": (
        RANK1 + " failed first: RuntimeError: rank 1 failed on purpose at step 30",
        "RuntimeError: rank 1 failed",
    ),
    "link-down": (
        RANK1 + r" is hung: no heartbeat for \d+ s",
        r"the job's store \(10\.213\.0\.1:29500\) has not answered for \d+ s .*the store's node \(10\.213\.0\.1\)",
    ),
    "master-dies": (
        "",
        r"the job's store \(10\.213\.0\.1:29500\) cannot be reached either: its node \(10\.213\.0\.1\)",
    ),
}


def _run(fault):
    hang_timeout = SLOW["hang_timeout"] if fault == "slow" else HANG_TIMEOUT_S
    prefix = f"tf{os.getpid() % 10000}{FAULTS.index(fault)}-"
    result = run_fault(
        fault, options=["--hang-timeout", str(hang_timeout)], slow_s=SLOW["slow_s"], limit_s=120, prefix=prefix
    )
    return result, hang_timeout, namespaces(prefix)


def _temporary_folders() -> set[Path]:
    # This process's temporary folder, and the one its children are given (conftest).
    places = {Path(tempfile.gettempdir()), Path(os.environ.get("TMPDIR", tempfile.gettempdir()))}
    return {folder for place in places for folder in place.glob("trainaccel-*")}


# A worker's SIGABRT is published by its launcher as a SIGKILL is; tests/launch/test_abort.py ends 2 nodes by it.
# A stopped worker (SIGSTOP) is named as a hung one is (the hang case): in the full set, to keep CI's load down.
CASES = [
    pytest.param(f, marks=pytest.mark.resilience_full) if f in ("abort", "stop") else f for f in FAULTS if f != "slow"
]


@pytest.fixture(scope="module")
def results(request):
    before = _temporary_folders()
    chosen = selected_params(request, "fault")
    faults = [f for f in FAULTS if f in chosen or f == "slow"]  # (the straggler's test reads "slow")
    # All at once: they mostly wait (for the deadline, the store's silence, the straggler).
    with ThreadPoolExecutor(len(faults)) as pool:
        done = dict(zip(faults, pool.map(_run, faults)))
    done["left_in_tmp"] = _temporary_folders() - before
    return done


def test_no_temporary_folder_is_left_even_by_a_killed_launcher(results):
    assert results["left_in_tmp"] == set()


@pytest.mark.parametrize("fault", CASES)
def test_every_process_on_every_node_ends_and_the_error_names_the_rank(results, fault):
    result, hang_timeout, left_namespaces = results[fault]
    tail = "\n\n".join(out[-2500:] for out in result.outputs)
    assert result.survivors == 0 and result.seconds is not None, tail
    assert result.seconds <= hang_timeout + 30, (result.seconds, tail)
    assert all(code != 0 for code in result.exit_codes), (result.exit_codes, tail)
    for node, pattern in enumerate(EXPECTED[fault]):
        assert re.search(pattern, result.first_lines[node]), (node, result.first_lines, tail)
    assert left_namespaces == []


def test_a_straggler_is_warned_about_not_ended(results):
    result, hang_timeout, left_namespaces = results["slow"]
    tail = "\n\n".join(out[-2500:] for out in result.outputs)
    assert result.exit_codes == [0, 0] and result.survivors == 0, tail
    assert re.search(RANK1 + r" may be hung: alive but at step 29 for \d+ s while rank 0 waits", tail), tail
    assert "rank 1 done" in result.outputs[1]
    assert left_namespaces == []
