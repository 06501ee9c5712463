"""The first inner step under sync_every broadcasts rank 0's parameters only where DDP's broadcast no longer holds."""

import pytest

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd

# case -> whether the first inner step must broadcast the parameters (tests/scripts/first_broadcast.py says how each
# script leaves them between DDP's wrap and its first step)
CASES = {
    "unchanged": False,
    "in_place": True,
    "in_place_rank0": True,
    "replaced": True,
    "no_init_sync": True,
    "ignored": True,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("first_broadcast")
    cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2", "--sync-every", "3"]
    proc = run([*cmd, "--sync-scope", "rank", SCRIPTS / "first_broadcast.py", out, *CASES], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_ranks(out, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_the_replicas_start_equal_and_the_model_is_sent_again_only_if_ddps_broadcast_no_longer_holds(ranks, case):
    first, second = (r[case] for r in ranks)
    assert first["syncs"] == second["syncs"] == 2
    assert first["synced"] == second["synced"]  # equal starts: a skipped broadcast that was needed breaks this
    for rank in (first, second):
        assert rank["carried"] == ([rank["elements"]] if CASES[case] else [])
