"""The engine under every codec x hierarchy on/off x DDP setting, on 2 emulated nodes x 2 real Gloo workers.

One job trains every cell (tests/scripts/engine_matrix.py); each test below reads its cell.
"""

import json
import math

import pytest

from conftest import SCRIPTS, run_nodes

pytestmark = pytest.mark.multiprocess

CODECS = ["none", "fp16", "fp16-peak", "bf16", "topk", "randomk", "powersgd"]  # fp16: dynamic, auto's on the CPU
SETTINGS = [
    "plain",
    "find_unused",
    "bucket_view",
    "static_graph",
    "no_sync",
    "mixed_dtype",
    "fp16_model",
    "bf16_model",
    "sparse",
    "two_models",
    "spike",
]
SPIKE_STEP = 12
# A cell whose codec loses nothing for the model's dtype: `none`, or a cast to the dtype the model already has.
# The peak's power-of-two scale is exact too: a float16 model's sum rounds as plain DDP's does, scaled or not.
LOSSLESS = {("none", s) for s in SETTINGS} | {
    ("fp16", "fp16_model"),
    ("fp16-peak", "fp16_model"),
    ("bf16", "bf16_model"),
}
# Hierarchical sums add in another order: a few roundings of the parameters' dtype (about 1 in magnitude).
ORDER_TOLERANCE = {"fp16_model": 2**-9, "bf16_model": 2**-6}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    for proc in run_nodes(SCRIPTS / "engine_matrix.py", out, timeout=600):
        assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads((out / "matrix.json").read_text())


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("hierarchical", ["off", "on"])
@pytest.mark.parametrize("codec", CODECS)
def test_cell_trains_with_equal_replicas(matrix, codec, hierarchical, setting):
    cell, plain = matrix[f"{codec}/{hierarchical}/{setting}"], matrix[f"plain/{setting}"]
    assert math.isfinite(cell["final"]) and cell["final"] < 0.8 * cell["first"], cell  # the loss falls
    assert cell["replicas_equal"], "the workers' parameters differ"
    assert cell["hierarchical"] == (hierarchical == "on" and codec != "powersgd")  # powersgd is always flat
    if (codec, setting) not in LOSSLESS:  # the codec was applied, not silently bypassed (powersgd beside sparse)
        assert cell["max_diff_from_plain"] > 0, "a lossy codec's run equals plain DDP's to the bit"
    if (codec, setting) in LOSSLESS:
        tolerance = 0.0 if hierarchical == "off" else ORDER_TOLERANCE.get(setting, 2**-19)
        assert cell["max_diff_from_plain"] <= tolerance, cell  # plain DDP's parameters, bit for bit when flat
    if setting == "spike":
        # The script's own check skipped the spiked step and only that one; the engine kept nothing of it.
        assert cell["skipped"] == [SPIKE_STEP] and plain["skipped"] == [SPIKE_STEP]
        assert abs(cell["final"] / cell["final_without_spike"] - 1) <= 0.05, cell
        if codec == "fp16":  # beyond float16's range: retried exactly
            assert cell["fallbacks"] >= 1
        if codec == "fp16-peak":  # scaled from the peak, so within float16's range: nothing to retry
            assert cell["fallbacks"] == 0
        if codec != "none":
            assert cell["skipped_by_engine"] >= 1
    else:
        assert cell["fallbacks"] == 0 and cell["skipped_by_engine"] == 0 and cell["skipped"] == []


@pytest.mark.parametrize("setting", ["fp16_model", "bf16_model"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_half_precision_models_train_like_plain_ddp(matrix, codec, setting):
    plain = matrix[f"plain/{setting}"]["final"]
    for hierarchical in ("off", "on"):
        final = matrix[f"{codec}/{hierarchical}/{setting}"]["final"]
        assert abs(final / plain - 1) <= 0.05, (hierarchical, final, plain)


# Codecs whose sums are read on the host, once per bucket on the communication thread, to choose an exact retry.
READ_FOR_RETRY = {
    "fp16": "comm finite",
    "randomk": "comm finite",
    "topk": "comm finite",
    "powersgd": "comm _powersgd_bucket",
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("hierarchical", ["off", "on"])
@pytest.mark.parametrize("codec", CODECS)
def test_cell_reads_nothing_on_the_training_thread(matrix, codec, hierarchical, setting):
    # A host read waits for the device on a GPU: none may stop the training thread, and on the communication
    # thread only nan_check's (on in every cell) and the exact-retry decision of the codecs that need one.
    cell = matrix[f"{codec}/{hierarchical}/{setting}"]
    reads, steps = cell["host_reads"], cell["steps_counted"]
    assert not [where for where in reads if where.startswith("training ")], reads
    allowed = {"comm _check_finite", READ_FOR_RETRY.get(codec)}
    assert set(reads) <= allowed, reads
    models = 2 if setting == "two_models" else 1
    if setting != "sparse":  # a sparse gradient has a bucket of its own, which nan_check reads too
        assert reads.get("comm _check_finite", 0) <= steps * models * 2, reads  # one per bucket
    if codec in READ_FOR_RETRY and codec != "powersgd":
        assert 0 < reads.get(READ_FOR_RETRY[codec], 0) <= steps * models * 2, reads  # one per bucket, however gathered
