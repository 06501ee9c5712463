"""Kill and resume under a lossy codec: the engine's state travels in the model's own checkpoint.

`resume_recipe.py` under `trainaccel run --compression C --max-restarts 1`: rank 1 fails at step 5,
the job restarts from the step-4 checkpoint (loaded into the module before DDP wraps it) and must
end with exactly the parameters of an uninterrupted run.
"""

import pytest
import torch

from conftest import SCRIPTS, run, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

STEPS, FAIL_AT, LAST_CHECKPOINT = 10, 5, 4


def launch(out_dir, compression, *args, fail=True, bucket_mb=None, warmup=2):
    out_dir.mkdir()
    flags = ["--compression", compression, "--max-restarts", 1, *(["--bucket-mb", bucket_mb] if bucket_mb else [])]
    flags += ["--compression-warmup", warmup]  # 2: compressing (SGD's momentum taken over) from step 3 on
    args = [out_dir, STEPS, *(["--fail-at-step", FAIL_AT] if fail else []), *args]
    cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, *flags, SCRIPTS / "resume_recipe.py", *args]
    proc = run(cmd, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out_dir / "final.pt"), proc


# One bucket, or one per parameter (0.001 MiB): DDP's first buckets then split the parameters otherwise.
# A warm-up of 6 exact steps: the restart (from step 4) comes during it. CI runs the split buckets; the other cells
# are comm_full (pytest -m comm_full tests/comm).
FULL = pytest.mark.comm_full


@pytest.mark.parametrize(
    "compression, bucket_mb, warmup",
    [
        pytest.param("topk", None, 2, marks=FULL),
        ("topk", 0.001, 2),
        pytest.param("randomk", 0.001, 2, marks=FULL),
        pytest.param("powersgd", None, 2, marks=FULL),
        pytest.param("topk", None, 6, marks=FULL),
    ],
)
def test_a_restarted_job_resumes_the_exact_trajectory(tmp_path, compression, bucket_mb, warmup):
    options = dict(bucket_mb=bucket_mb, warmup=warmup)
    reference, _ = launch(tmp_path / "uninterrupted", compression, "--every-rank", fail=False, **options)
    resumed, _ = launch(tmp_path / "restarted", compression, "--every-rank", **options)
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == LAST_CHECKPOINT
    saved = torch.load(tmp_path / "restarted" / "checkpoint-rank1.pt")["model"]  # the last one: step 10
    engine = saved._metadata[""]["trainaccel_comm"]
    assert engine["rank"] == 1 and engine["counters"]["steps"] == STEPS and engine["buckets"]
    if compression != "powersgd":  # SGD's momentum 0.9, taken over after the warm-up, travels with the engine
        assert engine["moved_momentum"]["momentum"] == 0.9
        optimizer = torch.load(tmp_path / "restarted" / "checkpoint-rank1.pt")["optimizer"]
        assert optimizer["param_groups"][0]["momentum"] == 0.9  # the script's settings, as torch saves them
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@FULL  # CI: the restart matrix's cell above, and the message in-process (test_script_patterns.py)
def test_a_checkpoint_of_rank_0_alone_resumes_with_empty_residuals_elsewhere_and_says_so(tmp_path):
    reference, _ = launch(tmp_path / "uninterrupted", "topk", fail=False)
    resumed, proc = launch(tmp_path / "restarted", "topk")
    assert "not this rank's (it was saved by rank 0)" in proc.stdout + proc.stderr
    # The restore is what makes the resume exact: without rank 1's residuals the trajectory differs.
    assert any(not torch.equal(resumed["params"][n], v) for n, v in reference["params"].items())
    assert all(v.isfinite().all() for v in resumed["params"].values())
