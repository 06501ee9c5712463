"""sync_every on a GPU: the anchors and the outer momentum live in pinned host memory, staged to the GPU for each
outer step, and the trajectory is the one the same run takes on the CPU (where they stay beside the parameters)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainaccel.comm import OuterSync

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run(device: torch.device, outer: str, fragments: int, overlap: int) -> tuple[list[torch.Tensor], OuterSync]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = OuterSync(
        model.parameters(), sync_every=4, outer_optimizer=outer, sync_fragments=fragments, sync_overlap=overlap
    )
    for i in range(1, 12):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g).to(device), torch.randn(5, 2, generator=g).to(device)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        sync.prepare()
        inner.step()
        sync.step()
    sync.drain()
    return [p.detach().cpu() for p in model.parameters()], sync


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("outer", ["nesterov", "average"])
@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1)])
def test_anchors_in_host_memory_follow_the_cpu_trajectory(device, outer, fragments, overlap):
    got, sync = run(device, outer, fragments, overlap)
    want, _ = run(torch.device("cpu"), outer, fragments, overlap)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    anchors = [a for f in sync.synced()[: len(got)] for a in f[1:]]
    if device.type == "cuda":
        assert all(a.device.type == "cpu" and a.is_pinned() for a in anchors)
        state = sync.state_dict()
        momentum = [s["momentum_buffer"] for o in state["outer"] if o is not None for s in o["state"].values()]
        assert all(m.device.type == "cpu" for m in momentum)
