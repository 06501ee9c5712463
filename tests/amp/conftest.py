"""What the AMP tests share: one worker's process group, and a check that shutdown() undid every patch."""

import os

import pytest
import torch.distributed as dist

import trainaccel
from amp.helpers import patchable


@pytest.fixture
def one_worker(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("TRAINACCEL_"):
            monkeypatch.delenv(name)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    originals = patchable()
    yield
    dist.destroy_process_group()
    trainaccel.shutdown()
    assert patchable() == originals  # shutdown() undid every patch
