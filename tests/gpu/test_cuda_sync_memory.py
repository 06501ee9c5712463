"""A sync's device memory on a GPU, for a model of 1 billion parameters: at most its fragment's float32 size beside
the model (the change, filled from the pinned anchors tensor by tensor), plus a chunk's for the outer step.

Measured with max_memory_allocated over the inner step a sync runs in, against what the step held before it; the
anchors and the outer momentum live in pinned host memory. Built as it was, a sync held about 12 bytes a parameter
(float32 parameters, device copies of the anchors, the change) and more again while applying it.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainaccel.comm import OuterSync, outer_sync

pytestmark = pytest.mark.gpu

WIDTH, LAYERS = 8192, 16  # 16 x 67.1 M parameters: 1.07 B, 2.1 GB in bf16


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_sync_of_a_billion_parameters_holds_four_bytes_each_beside_the_model(device, needs_cuda, overlap):
    with torch.device(device):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert params >= 1_000_000_000
    inner = torch.optim.SGD(model.parameters(), lr=1e-4)
    sync = OuterSync(model.parameters(), sync_every=2, outer_optimizer="nesterov", sync_overlap=overlap)
    extra = []
    for _ in range(6):
        x = torch.randn(4, WIDTH, device=device, dtype=torch.bfloat16)
        inner.zero_grad()
        model(x).float().square().mean().backward()
        sync.prepare()
        inner.step()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        sync.step()  # a sync begins at every second step (and is applied, unless overlapped: then at the next)
        torch.cuda.synchronize(device)
        extra.append(torch.cuda.max_memory_allocated(device) - before)
    sync.drain()
    assert sync.syncs >= 2
    chunk = 3 * 4 * outer_sync.STAGE_ELEMENTS  # a chunk's anchors, momentum and the outer step's own temporary
    largest = WIDTH * WIDTH * 4
    bound = 4 * params + chunk + 2 * largest + 64 * 2**20
    print(f"sync_overlap={overlap}: {max(extra) / params:.2f} bytes a parameter at most beside the model", flush=True)
    assert max(extra) <= bound, [e / params for e in extra]
