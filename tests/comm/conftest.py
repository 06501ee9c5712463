"""Fixtures of the engine's tests."""

import pytest
import torch.distributed as dist

import trainaccel


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A Gloo group of world size 1 for the tests of one module; what `register` started is undone after."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    trainaccel.shutdown()  # the heartbeat and the optimizer-step hooks that register() installs
    dist.destroy_process_group()
