"""autotune=on: candidates, the choice, and identical decisions on 4 real workers as 2 emulated nodes."""

import pytest

from conftest import SCRIPTS, read_ranks, run_nodes
from trainaccel.comm.autotune import candidate_configs, choose
from trainaccel.config import Config


def test_candidates_never_widen_what_the_user_allowed():
    labels = [label for label, _, _ in candidate_configs(Config.resolve(env={}, compression="topk"), multi_node=False)]
    assert labels == ["topk", "none"]  # compression is a permission; no other lossy codec is tried
    single = candidate_configs(Config.resolve(env={}), multi_node=False)
    assert [label for label, _, _ in single] == ["none"]


def test_candidates_on_several_nodes_cover_flat_and_hierarchy_chunk_sizes():
    found = candidate_configs(Config.resolve(env={}, compression="fp16"), multi_node=True)
    labels = [label for label, _, _ in found]
    assert labels[0] == "fp16 flat" and "none hierarchical 16 MiB" in labels and len(labels) == 8
    for _label, config, chunk in found:
        assert config.autotune == "off"
        assert (config.hierarchical == "on") == (chunk is not None)
    forced = candidate_configs(Config.resolve(env={}, hierarchical="off"), multi_node=True)
    assert [label for label, _, _ in forced] == ["none flat"]


def test_choose_takes_the_lowest_median():
    assert choose({"a": [1.0, 9.0, 1.1], "b": [1.05, 1.06, 1.07], "c": [2.0]}) == "b"


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["timed", "flat"])
def test_every_rank_applies_the_same_choice(tmp_path, how):
    """`flat`: rank 0 chooses the flat candidate; the hierarchy's groups (in-node sum and gather, cross-node), which
    only the losing candidates used, are destroyed on every rank (on NCCL a communicator and its buffers each)."""
    procs = run_nodes(SCRIPTS / "autotune.py", tmp_path, *([how] if how == "flat" else []))
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = read_ranks(tmp_path, 4)
    assert ranks[0]["chosen"] in ranks[0]["candidates"] and len(ranks[0]["candidates"]) == 8
    assert all(r["chosen"] == ranks[0]["chosen"] and r["labels_seen"] == ranks[0]["labels_seen"] for r in ranks)
    assert all(n == 3 for n in ranks[0]["timed"].values())  # every candidate timed over 3 steps
    assert len({r["digest"] for r in ranks}) == 1  # parameters stayed identical across ranks
    log = "".join(p.stdout for p in procs)
    assert log.count("autotune chose") == 1  # logged once, by rank 0
    if how == "flat":
        assert ranks[0]["chosen"] == "fp16 flat"
        # the default group, the engine's copy, and the hierarchy's three: those go with the losers
        assert all(r["held"] == [5, 2] for r in ranks), [r["held"] for r in ranks]
        assert log.count("the hierarchy's groups, used by no candidate kept, are destroyed") == 4
