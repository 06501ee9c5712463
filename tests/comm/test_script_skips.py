"""A script's own skip of a non-finite step under sync_every, in real workers."""

import pytest

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd


@pytest.mark.multiprocess
def test_a_step_skipped_on_one_rank_keeps_the_syncs_aligned_and_the_job_ends(tmp_path):
    """Under plain DDP the non-finite gradient reaches every rank through the allreduce and every rank skips; under
    sync_every it stays on rank 1, which alone skips. Both ranks must count the same inner steps, run the same
    syncs and exit, rather than rank 0 waiting in a last sync that rank 1 never starts."""
    proc = run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--sync-every",
            "2",
            "--collective-timeout",
            "60",
            SCRIPTS / "skip_on_one_rank.py",
            tmp_path,
        ],
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = read_ranks(tmp_path, 2)
    assert [r["skipped"] for r in ranks] == [0, 1]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 12
    assert ranks[0]["syncs"] == ranks[1]["syncs"] == 6
