"""Momentum correction, zero-code: an SGD optimizer's momentum and weight decay applied by error feedback."""

import pytest

from conftest import SCRIPTS, read_ranks, run_nodes

pytestmark = pytest.mark.multiprocess

SETTINGS = ["heavy_ball", "nesterov", "dampening", "weight_decay", "groups", "no_momentum"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("momentum")
    procs = run_nodes(SCRIPTS / "momentum_correction.py", out, timeout=400)
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
    return read_ranks(out, 4), "".join(p.stdout for p in procs)


@pytest.mark.parametrize("codec", ["topk", "randomk"])
@pytest.mark.parametrize("hierarchical", ["off", "on"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_sending_everything_equals_torch_sgd_on_the_exact_mean(ranks, codec, hierarchical, setting):
    for r in ranks[0]:
        case = r["exact"][f"{codec}/{hierarchical}/{setting}"]
        assert case["hierarchical"] is (hierarchical == "on")
        assert case["max_abs_err"] <= 1e-5, case
        if setting == "no_momentum":
            assert case["moved"] == 0 and case["saved_groups"][0]["weight_decay"] == 0.01
            continue
        # Taken over: the live optimizer runs without momentum or buffers; its state_dict() is the script's.
        assert case["moved"] > 0 and set(case["live_momentum"]) == {0.0} and case["buffers"] == 0
        for group in case["saved_groups"]:
            assert group["momentum"] in (0.8, 0.9) and "trainaccel_moved" not in group


@pytest.mark.parametrize("case", ["topk/nesterov=False", "topk/nesterov=True", "randomk/nesterov=False"])
def test_what_was_applied_is_momentum_sgd_minus_the_residuals(ranks, case):
    for r in ranks[0]:
        found = r["settings"][case]
        assert found["gap"] > 1e-3  # ratio 0.1 holds part of the update back: the check below has something to see
        assert found["max_abs_err"] <= 1e-5 * max(1.0, found["gap"]), found


def test_shutdown_gives_the_optimizer_its_settings_back(ranks):
    for r in ranks[0]:
        decay, rest = r["after_shutdown"]
        assert decay["momentum"] == 0.9 and decay["nesterov"] is True and decay["weight_decay"] == 0.05
        assert rest["momentum"] == 0.9 and rest["weight_decay"] == 0.0
        assert "trainaccel_moved" not in decay


def test_adaptive_optimizers_are_warned_about_once(ranks):
    out = ranks[1]
    assert out.count("compression=topk with AdamW") == 1  # once per job (rank 0)
    assert "expect a worse loss than plain DDP" in out
