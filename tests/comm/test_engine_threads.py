"""The engine's two job threads (per-step jobs, DiLoCo's syncs): where jobs run inline instead, and the NCCL
communicators built at registration. The order the threads keep per group is tested in test_one_owner.py."""

import threading

import pytest
import torch
import torch.distributed as dist

from trainaccel.comm import scheduler


@pytest.mark.parametrize(
    "env, device, inline",
    [
        ({}, "cuda", False),
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cuda", True),  # one hardware queue (Megatron-style TP sets it)
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "cuda", False),
        ({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"}, "cuda", True),  # an MPS client
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cpu", False),  # Gloo blocks: no kernel queue to keep in order
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, None, False),
    ],
)
def test_jobs_run_inline_where_the_gpus_streams_share_one_queue(monkeypatch, env, device, inline):
    for name in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MPS_PIPE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert scheduler.issues_inline(torch.device(device) if device else None) is inline


def test_an_inline_job_runs_on_the_submitting_thread_after_the_jobs_before_it(one_process_group, monkeypatch):
    order = []
    release = threading.Event()
    queued = scheduler.sync_thread().submit(lambda: release.wait(10) and order.append("queued"))
    monkeypatch.setattr(scheduler, "issues_inline", lambda device: True)  # a stand-in for a single-queue GPU
    release.set()
    fut = scheduler.comm_thread().submit(lambda: order.append(threading.current_thread().name) or torch.ones(1))
    assert fut.done() and order == ["queued", "MainThread"]  # ran here, after the other thread's job
    assert queued.done()


class _Backend:
    def __init__(self, initialized: bool = False):
        self.supports_splitting, self.initialized, self.connected = True, initialized, []

    def _is_initialized(self) -> bool:
        return self.initialized

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.connected.append(device)
        self.initialized = True


class _Group:
    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device: torch.device):
        if self.backend is None:
            raise RuntimeError("no backend for cuda")
        return self.backend


def test_connect_builds_each_nccl_communicator_once_on_the_calling_thread():
    """A stand-in backend (NCCL's methods): built now for a GPU, not for the CPU, not twice, not without a backend."""
    fresh, built, gloo = _Backend(), _Backend(initialized=True), _Backend()
    gloo.supports_splitting = False
    groups = (_Group(fresh), _Group(built), _Group(gloo), _Group(None), None, dist.GroupMember.NON_GROUP_MEMBER)
    scheduler.connect(groups, torch.device("cpu"))
    assert fresh.connected == []
    scheduler.connect(groups, torch.device("cuda", 0))
    scheduler.connect(groups, torch.device("cuda", 0))  # (a second model over the same groups)
    assert fresh.connected == [torch.device("cuda", 0)] and built.connected == [] and gloo.connected == []
