"""Every codec trains a small task to within 5% of the uncompressed final loss, on 4 real Gloo workers."""

import json

import pytest

from conftest import SCRIPTS, run_nodes

pytestmark = pytest.mark.multiprocess

STEPS = 300


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence") / "losses.json"
    for proc in run_nodes(SCRIPTS / "convergence.py", out, STEPS):
        assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(out.read_text())


def test_uncompressed_run_learns(losses):
    assert losses["none"]["final_loss"] < 0.1  # from ~1.0 at the start; the noise floor is 0.01
    assert losses["none"]["hierarchical"] is True  # 2 nodes x 2 workers: auto turns the hierarchy on


@pytest.mark.parametrize("codec", ["fp16", "topk", "randomk", "powersgd"])
def test_codec_final_loss_within_5_percent_of_none(losses, codec):
    none = losses["none"]["final_loss"]
    assert abs(losses[codec]["final_loss"] - none) <= 0.05 * none, losses
    assert losses[codec]["bytes_per_step"] < losses["none"]["bytes_per_step"]
