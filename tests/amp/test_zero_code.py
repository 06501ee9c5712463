"""`trainaccel run --amp/--compile` on an unchanged DDP script (real Gloo workers): dtypes, losses, policy."""

import statistics

import pytest

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

SCRIPT = SCRIPTS / "plain_ddp.py"
STEPS = 30


def _train(out, *flags: str, script_args: tuple[str, ...] = ()) -> list[dict]:
    launcher = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2", *flags]
    proc = run([*launcher, SCRIPT, "--out-dir", out, "--steps", str(STEPS), *script_args])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out, 2)
    assert ranks[0]["params"] == ranks[1]["params"], "replicas diverged"
    return ranks


def _final_loss(ranks: list[dict]) -> float:
    """Mean of the last 5 steps' losses over both ranks (one batch's loss is noisy)."""
    return statistics.mean(loss for r in ranks for loss in r["losses"][-5:])


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[dict]:
    ranks = _train(tmp_path_factory.mktemp("eager"))
    assert all(r["inner_dtypes"] == ["torch.float32"] and r["autocast_forwards"] is None for r in ranks)
    return ranks


def test_amp_bf16_runs_the_forward_in_bfloat16_and_reaches_the_fp32_loss(tmp_path, eager):
    ranks = _train(tmp_path, "--amp", "bf16")
    for r in ranks:
        assert r["inner_dtypes"] == ["torch.bfloat16"]  # seen by a plain forward hook on the first layer
        assert r["output_dtypes"] == ["torch.float32"]  # the loss is computed in float32, as autocast would
        assert r["autocast_forwards"] == STEPS
    assert ranks[0]["losses"] != eager[0]["losses"]  # bfloat16 rounds: not the fp32 run by accident
    assert _final_loss(ranks) == pytest.approx(_final_loss(eager), rel=0.05)
    assert _final_loss(ranks) < 0.2 * statistics.mean(r["losses"][0] for r in ranks)


@pytest.mark.comm_full  # CI keeps compile's own test (tests/test_compiler.py)
def test_compile_trains_the_same_script_with_the_eager_trajectory(tmp_path, eager):
    ranks = _train(tmp_path, "--compile")
    for r, e in zip(ranks, eager):
        assert r["compiled_graphs"] > 0 and e["compiled_graphs"] == 0
        assert r["losses"] == pytest.approx(e["losses"], rel=1e-3, abs=1e-5)


def test_amp_fp16_with_the_one_line_scaler(tmp_path, eager):
    ranks = _train(tmp_path, "--amp", "fp16", script_args=("--scaled",))
    for r in ranks:
        assert r["inner_dtypes"] == ["torch.float16"]
        # A GradScaler scaled the loss: it starts at 2**16 and halves at each overflow (a skipped step).
        assert r["grad_scale"] in (2.0**16, 2.0**15, 2.0**14)
    # Gradients were unscaled before the step (else lr x 65536 would diverge); each skipped step
    # leaves this short run a step behind, hence the wider tolerance than bf16's.
    assert _final_loss(ranks) == pytest.approx(_final_loss(eager), rel=0.25)
    assert _final_loss(ranks) < 0.2 * statistics.mean(r["losses"][0] for r in ranks)


@pytest.mark.comm_full  # CI keeps the policy's unit tests and the amp levels' runs beside this one
def test_amp_level_o1_with_the_auto_policy_holds_full_precision_after_a_learning_rate_drop(tmp_path):
    # spike=10 keeps this noisy toy loss from triggering; the drop at step 15 is seen after that step.
    # Compiled too: the per-step decision must not make the compiler specialise on the step.
    ranks = _train(
        tmp_path,
        "--amp-level",
        "O1",
        "--amp-policy",
        "auto:hold=3,spike=10",
        "--compile",
        script_args=("--lr-drop-at", "15"),
    )
    for r in ranks:
        assert r["inner_dtypes"] == ["torch.bfloat16", "torch.float32"]  # O1 on CPU: bfloat16
        assert r["autocast_forwards"] == STEPS - 3  # steps 16, 17, 18 in full precision
        # torch 2.13: 5 graphs (both precisions, resumed after the untraced decision); tracing the
        # decision, so that the graphs depend on the step, made 10.
        assert 0 < r["compiled_graphs"] <= 6
    assert _final_loss(ranks) < 0.5 * statistics.mean(
        r["losses"][0] for r in ranks
    )  # it trained (slower after the drop)
