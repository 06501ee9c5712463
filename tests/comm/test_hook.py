"""trainaccel's DDP hook, measured on 2 real Gloo workers started by torchrun."""

import pytest

from conftest import SCRIPTS, read_ranks, run, torchrun_cmd

pytestmark = pytest.mark.multiprocess

N = 1000  # elements in the test parameter (hook_numerics.py)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hook")
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", SCRIPTS / "hook_numerics.py", out])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return read_ranks(out, 2)


def test_uncompressed_equals_exact_mean_through_ddps_own_allreduce(ranks):
    for r in ranks:
        assert r["none"]["max_abs_err"] <= 1e-6
        # Nothing to add (no codec, one node, no check): DDP's C++ allreduce runs, no Python per bucket.
        assert r["none"]["hook"] == "BuiltinCommHookType.ALLREDUCE"
        assert r["none"]["bytes_per_step"] == N * 4


@pytest.mark.parametrize("codec, bound", [("fp16", 3 * 2**-11 * 12), ("bf16", 3 * 2**-8 * 12)])
def test_cast_codecs_within_their_rounding_bound_and_halve_bytes(ranks, codec, bound):
    # |x| < ~12 here; each of compress, sum and decompress rounds once, relative 2^-11 (fp16) or 2^-8 (bf16).
    for r in ranks:
        assert 0 < r[codec]["max_abs_err"] <= bound
        assert r[codec]["bytes_per_step"] == N * 2
        assert r[codec]["hook"] == "trainaccel_comm_hook" and r[codec]["steps"] == 2  # the first one exact


def test_nan_check_raise_fails_every_rank_naming_the_parameter(ranks):
    for r in ranks:
        assert r["raise"] is not None, "a non-finite gradient passed nan_check=raise"
        assert "non-finite gradient after allreduce" in r["raise"] and "weight" in r["raise"]


def test_nan_check_warn_logs_the_parameter_and_continues(ranks):
    for r in ranks:
        assert len(r["warn"]) == 1 and "weight" in r["warn"][0]
        assert r["warn_grad_finite"] is False


def test_init_hooks_new_models_but_keeps_a_scripts_own_hook(ranks):
    for r in ranks:
        assert r["hooks"]["auto"] == ["trainaccel_comm_hook", "fp16"]
        assert r["hooks"]["own"] == ["allreduce_hook", True]
        assert r["hooks"]["plain"][0] in (None, "") and r["hooks"]["plain"][1] is True


def test_powersgd_starts_beside_a_sparse_gradient_in_the_last_bucket(ranks):
    for r in ranks:
        assert r["powersgd_sparse"]["iter"] == 4 >= r["powersgd_sparse"]["start"]  # every step counted
