"""fp16 with `fp16_scale=peak` on 2 emulated nodes x 2 real Gloo workers: every kind of gradient x flat,
hierarchical, and hierarchical with fp16 inside the node too, against the exact mean; `dynamic` beside it, to show
what the peak's scale changes."""

import json

import pytest

from conftest import SCRIPTS, run_nodes

pytestmark = pytest.mark.multiprocess

CASES = ["normal", "tiny", "huge", "wide", "zeros", "same_on_all", "ranks_apart", "inf_on_one", "nan_on_one"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16_peak")
    for proc in run_nodes(SCRIPTS / "fp16_peak.py", out, timeout=300):
        assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads((out / "fp16_peak.json").read_text())


@pytest.mark.parametrize("hierarchical", ["off", "on", "intra"])
@pytest.mark.parametrize("case", CASES)
def test_the_peaks_scale_sums_within_fp16s_roundings_with_no_retry(cells, case, hierarchical):
    cell = cells[f"{case}/peak/{hierarchical}"]
    assert cell["hierarchical"] == (hierarchical != "off")
    assert cell["worst"] <= 1.0, cell  # within the tolerance of fp16's roundings, at every finite place
    assert cell["nonfinite_got"] == cell["nonfinite_expected"], cell  # a non-finite gradient shows where it was
    assert cell["fallbacks"] == 0  # nothing read on the host to choose a retry, and none needed
    assert cell["replicas_equal"]


@pytest.mark.parametrize("hierarchical", ["off", "on", "intra"])
@pytest.mark.parametrize("case", CASES)
def test_the_dynamic_scale_keeps_its_behaviour(cells, case, hierarchical):
    cell = cells[f"{case}/dynamic/{hierarchical}"]
    assert cell["replicas_equal"] and cell["nonfinite_got"] == cell["nonfinite_expected"], cell
    if case == "tiny":  # at scale 1 gradients below float16's range flush to zero: what the peak's scale avoids
        assert cell["worst"] > 100.0, cell
    elif case in ("huge", "inf_on_one", "nan_on_one"):  # not finite in float16: reduced exactly instead
        assert cell["fallbacks"] >= 1, cell
    if case not in ("tiny", "inf_on_one", "nan_on_one"):
        assert cell["worst"] <= 1.0, cell
