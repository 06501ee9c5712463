"""sync_every on a GPU: the anchors and the outer momentum live in pinned host memory, staged to the GPU for each
outer step, and the trajectory is the one the same run takes on the CPU (where they stay beside the parameters)."""

import threading
import warnings

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


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("outer", ["nesterov", "average"])
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_sync_waits_for_the_device_once_not_once_per_tensor(device, needs_cuda, outer, overlap):
    # The anchors' copies to and from pinned host memory are queued on the stream; the host waits for the device
    # once per sync (the homes are then read on the host), where a blocking copy per tensor waited 2 x 12 times.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6))).to(device)  # 12 tensors
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = OuterSync(model.parameters(), sync_every=2, outer_optimizer=outer, sync_overlap=overlap)
    data = [(torch.randn(5, 8, device=device), torch.randn(5, 8, device=device)) for _ in range(10)]

    def step(x, y):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        sync.prepare()
        inner.step()
        sync.step()

    for x, y in data[:4]:  # the anchors made, the first outer step's momentum given its home
        step(x, y)
    torch.cuda.synchronize(device)
    syncs_before = sync.syncs
    waits, training = [], threading.current_thread()  # the training thread's (not the communication thread's)

    def note(message, *args, **kwargs):
        if threading.current_thread() is training and "synchroniz" in str(message):
            waits.append(str(message))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            for x, y in data[4:]:
                step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    applied = sync.syncs - syncs_before
    assert applied == 3 and len(waits) <= applied, waits
