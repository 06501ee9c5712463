"""A script's own NCCL-only group (`init_process_group("nccl")`, the zero-code case): every tensor trainaccel hands a
collective must be on the GPU, and the engine's timings must be the device's."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import conftest as root_conftest
import trainaccel
from gpu.helpers import Net, batches, train
from trainaccel import devices

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_only(device, monkeypatch):
    """One worker whose script starts an NCCL-only default group itself, after trainaccel.init()."""
    if device.type != "cuda":
        pytest.skip("an NCCL group needs CUDA")
    for name in [n for n in os.environ if n.startswith("TRAINACCEL_")]:
        monkeypatch.delenv(name)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(root_conftest.free_port())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield device
    trainaccel.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_an_nccl_only_group_takes_the_gpu_for_every_collective(nccl_only):
    trainaccel.init(start_process_group=False)
    dist.init_process_group("nccl")
    assert not devices.uses_cpu() and devices.group_device() == nccl_only


@pytest.mark.parametrize(
    "options, probe",
    [
        ({"sync_every": "auto"}, False),  # auto's timings were a CPU float64 tensor all-reduced over the group
        ({"sync_every": "auto"}, True),  # a model over the probe's size: its first round times a probe on the GPU
        ({"sync_every": 2, "outer_compression": "fp4", "sync_fragments": 2, "sync_overlap": 1}, False),
        ({"compression": "fp16", "metrics_every": 2, "straggler_every": 2}, False),  # metrics and stragglers pool on it
    ],
)
def test_zero_code_trains_on_a_scripts_nccl_only_group(nccl_only, options, probe, monkeypatch):
    if probe:
        from trainaccel.comm import auto_setting

        monkeypatch.setattr(auto_setting, "PROBE_ELEMENTS", 16)
    trainaccel.init(start_process_group=False, **options)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(nccl_only), device_ids=[nccl_only.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = train(model, optimizer, batches(nccl_only, 30))
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) < sum(losses[:5]), losses
    diloco = model.trainaccel.diloco
    if diloco is not None:
        assert diloco.syncs > 0


def test_the_wait_for_peers_is_timed_on_the_device(nccl_only):
    """Straggler detection's wait: CUDA events, read at the next step once complete."""
    from trainaccel.comm.hooks import CommWait

    wait = CommWait()
    wait.mark_ready(nccl_only)
    torch.cuda._sleep(10_000_000)  # about 5-10 ms of device time between the two events
    done = torch.futures.Future(devices=[nccl_only])
    done.set_result(torch.ones(1, device=nccl_only))
    wait.mark_done(done)
    torch.cuda.synchronize()
    assert wait.take() > 0.001


@pytest.mark.parametrize("options", [{"compression": "fp16"}, {"sync_every": 2, "sync_fragments": 2}])
def test_the_engines_communicators_are_built_at_registration_not_in_backward(nccl_only, options):
    """Built lazily at the first collective on an engine thread, a communicator's set-up could wait behind a kernel of
    the training thread (scheduler.connect): they are built on the registering thread, before the first backward."""
    from trainaccel.comm.scheduler import COMM, SYNC, engine_group

    trainaccel.init(start_process_group=False, **options)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(nccl_only), device_ids=[nccl_only.index])
    torch.optim.SGD(model.parameters(), lr=0.05)  # zero-code DiLoCo takes the model at its optimizer
    x, _ = batches(nccl_only, 1)[0]
    model(x)  # registration (the forward): no backward yet
    group = engine_group(model.process_group, SYNC if "sync_every" in options else COMM)
    assert group._get_backend(nccl_only)._is_initialized()
