"""`trainaccel.shard()`: which blocks are sharded, what is refused, and training equal to DDP under full and hybrid."""

import pytest
import torch

from conftest import SCRIPTS, read_ranks, run, run_nodes, trainaccel_cmd
from trainaccel.sharding import ShardError, blocks, shard


def mlp(*widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def test_blocks_are_found_bottom_up_by_size():
    model = torch.nn.Sequential(mlp(100, 100, 100), torch.nn.Linear(100, 100), torch.nn.Linear(100, 2))
    assert [name for name, _ in blocks(model, 10_000)] == ["0.0", "0.2", "1"]  # 10100 each; the head stays at the root
    assert [name for name, _ in blocks(model, 20_000)] == ["0"]  # two layers together; the others are too small
    assert blocks(model, 10**9) == []


def test_what_cannot_be_sharded_is_refused_with_one_line():
    tied = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ShardError, match=r"cannot shard '0' on its own: its parameter is also '1.weight' \(tied\)"):
        blocks(tied, 10_000)
    assert blocks(tied, 10**6) == []  # one unit at the root holds both: nothing to refuse
    sparse = torch.nn.Sequential(torch.nn.EmbeddingBag(100, 8, sparse=True), torch.nn.Linear(8, 2))
    with pytest.raises(ShardError, match=r"cannot shard 0: EmbeddingBag\(sparse=True\) makes sparse gradients"):
        shard(sparse)
    with pytest.raises(ValueError, match="invalid mode='zero3'; accepted: full, hybrid"):
        shard(mlp(4, 4), "zero3")
    with pytest.raises(ValueError, match=r"invalid min_params=0; accepted: an integer >= 1 \(parameters per block\)"):
        shard(mlp(4, 4), min_params=0)
    with pytest.raises(RuntimeError, match=r"shard\(\) needs the default process group"):
        shard(mlp(4, 4))


def check(ranks, mesh):
    for rank in ranks:
        assert rank["sharded_type"] == "DTensor" and rank["mesh"] == mesh
        assert rank["losses"]["sharded"] == pytest.approx(rank["losses"]["ddp"], rel=1e-5, abs=1e-6)
        assert rank["losses"]["ddp"][0] != rank["losses"]["ddp"][-1]  # it trained
    assert ranks[0]["state_dict_equal"]


@pytest.mark.multiprocess
def test_full_sharding_trains_as_ddp_and_gives_the_same_full_state_dict(tmp_path):
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, SCRIPTS / "shard_train.py", tmp_path, "full"]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check(read_ranks(tmp_path, 2), [2])


@pytest.mark.multiprocess
def test_hybrid_sharding_on_two_nodes_trains_as_ddp(tmp_path):
    for proc in run_nodes(
        SCRIPTS / "shard_train.py", tmp_path, "hybrid", per_node=2, launcher=[*trainaccel_cmd(), "run"]
    ):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    check(read_ranks(tmp_path, 4), [2, 2])
