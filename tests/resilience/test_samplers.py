"""Job-wide DistributedSamplers follow the members present (on_lost_replica=continue): unit cases of the split."""

import pytest
from torch.utils.data.distributed import DistributedSampler

from trainaccel import context
from trainaccel.resilience import samplers

TORCHS = DistributedSampler.__iter__


@pytest.fixture
def job(monkeypatch):
    """A job of 3 workers; this process is rank 1."""
    monkeypatch.setattr(samplers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(samplers.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(samplers.dist, "get_rank", lambda: 1)
    live = [[0, 1, 2]]
    samplers.follow_membership(lambda: live[0])
    yield live
    context.undo_all()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("size", [30, 31])
def test_after_a_loss_each_pass_splits_over_the_workers_present_as_torch_would(job, drop_last, size):
    sampler = DistributedSampler(list(range(size)), num_replicas=3, rank=1, shuffle=True, seed=5, drop_last=drop_last)
    assert list(sampler) == list(DistributedSampler(list(range(size)), 3, 1, True, 5, drop_last))
    job[0] = [0, 1]  # rank 2 lost: this worker is part 1 of 2
    sampler.set_epoch(1)
    expected = DistributedSampler(list(range(size)), num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=drop_last)
    expected.set_epoch(1)
    assert list(sampler) == list(expected) and len(sampler) == len(expected)
    job[0] = [1, 2]  # rank 0 lost instead: this worker is part 0
    expected = DistributedSampler(list(range(size)), num_replicas=2, rank=0, shuffle=True, seed=5, drop_last=drop_last)
    expected.set_epoch(1)
    assert list(sampler) == list(expected)
    job[0] = [0, 1, 2]  # every worker back: the job's split
    sampler.set_epoch(0)
    assert list(sampler) == list(DistributedSampler(list(range(size)), 3, 1, True, 5, drop_last))


def test_a_sampler_built_for_another_split_is_left_as_built(job):
    own = DistributedSampler(list(range(12)), num_replicas=2, rank=0, shuffle=False)  # a subgroup's, say
    job[0] = [0, 1]
    assert list(own) == list(range(0, 12, 2)) and (own.num_replicas, own.rank) == (2, 0)
    job[0] = [1]
    assert list(own) == list(range(0, 12, 2))


def test_without_a_membership_nothing_changes(job):
    sampler = DistributedSampler(list(range(12)), num_replicas=3, rank=1, shuffle=False)
    job[0] = None
    assert list(sampler) == list(range(1, 12, 3))


def test_shutdown_undoes_the_patch(job):
    assert DistributedSampler.__iter__ is not TORCHS
    context.undo_all()
    assert DistributedSampler.__iter__ is TORCHS
