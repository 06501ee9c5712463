"""`--amp fp16` on real Gloo workers: a script's own gradient clipping and LR scheduler work unchanged."""

import math
import statistics

import pytest

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

SCRIPT = SCRIPTS / "amp_clip.py"
STEPS = 150


def _train(out, amp: str, steps: int, *script_args: str) -> list[dict]:
    out.mkdir()
    launcher = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2", "--amp", amp]
    proc = run([*launcher, SCRIPT, out, str(steps), *script_args])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out, 2)
    assert ranks[0]["params"] == ranks[1]["params"], "replicas diverged"
    return ranks


def test_clip_grad_norm_under_fp16_clips_the_true_gradients_and_reaches_the_fp32_loss(tmp_path):
    fp32 = _train(tmp_path / "fp32", "off", STEPS)
    fp16 = _train(tmp_path / "fp16", "fp16", STEPS)
    # Clipping the scaled gradients would leave 1/65536 of each step: the loss would barely move.
    assert fp16[0]["eval_loss"] == pytest.approx(fp32[0]["eval_loss"], rel=0.05)
    assert fp16[0]["eval_loss"] < 0.05 * fp16[0]["losses"][0]
    # The clip binds for most of the run, and fp16 clips the same (true) gradient norms as fp32.
    assert statistics.median(fp32[0]["norms"]) > 1
    assert statistics.median(fp16[0]["norms"]) == pytest.approx(statistics.median(fp32[0]["norms"]), rel=0.2)
    for r in fp16:  # the scaler skipped the first overflowing steps, and the scheduler with them
        assert r["last_epoch"] == r["real_steps"] < STEPS
        assert r["lr"] == pytest.approx(0.1 * 0.995 ** r["real_steps"])


def test_an_overflowing_step_is_skipped_by_the_scaler_and_the_scheduler_alike(tmp_path):
    steps = 20
    ranks = _train(tmp_path / "fp16", "fp16", steps, "--inf-at", "10")
    for r in ranks:
        assert not math.isfinite(r["norms"][10])  # the injected overflow reached the gradients
        assert r["last_epoch"] == r["real_steps"] <= steps - 1
        assert r["lr"] == pytest.approx(0.1 * 0.995 ** r["real_steps"])
        assert all(math.isfinite(loss) for loss in r["losses"][11:])  # the skipped step left the weights finite
