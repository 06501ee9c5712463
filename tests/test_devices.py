"""Which GPU is a worker's, and where a collective's tensors live, decided from the launcher's variables and the
group's backends (CUDA is stood in for: this is how the decisions read on any machine)."""

import pytest
import torch
import torch.distributed as dist

import trainaccel
from trainaccel import devices


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `count` visible GPUs; records set_device calls."""
    state = {"count": 0, "current": 0, "set": []}

    def set_device(index):
        state["set"].append(index)
        state["current"] = index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return state


@pytest.mark.parametrize(
    "count, local_rank, expected",
    [
        (0, "3", None),  # no CUDA
        (1, "3", 0),  # CUDA_VISIBLE_DEVICES gives each worker its own GPU: the one it sees
        (8, "3", 3),
        (8, "0", 0),
    ],
)
def test_a_workers_gpu_is_its_local_rank_among_those_it_sees(gpus, count, local_rank, expected):
    gpus["count"] = count
    assert devices.local_cuda_index({"LOCAL_RANK": local_rank}) == expected


def test_a_local_rank_beyond_the_visible_gpus_is_refused_naming_both(gpus):
    gpus["count"] = 2
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3, and this worker sees 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"):
        devices.local_cuda_index({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_workers_gpu_becomes_current_unless_the_script_chose_one(gpus):
    gpus["count"] = 4
    assert devices.select_local_device({"LOCAL_RANK": "2"}) == torch.device("cuda", 2)
    assert gpus["set"] == [2]
    gpus["current"], gpus["set"] = 1, []  # the script's own set_device(1)
    assert devices.select_local_device({"LOCAL_RANK": "2"}) == torch.device("cuda", 1)
    assert gpus["set"] == []


def test_init_selects_the_workers_gpu_whoever_starts_the_group(gpus, monkeypatch):
    """The zero-code case: the script calls init_process_group itself, after trainaccel's bootstrap ran init()."""
    gpus["count"] = 4
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    try:
        trainaccel.init(start_process_group=False)
        assert gpus["set"] == [3]
    finally:
        trainaccel.shutdown()


@pytest.mark.parametrize(
    "backend, cpu, on_cuda, gpu_tensors_on",
    [
        ("gloo", True, "gloo", "cpu"),
        ("nccl", False, "nccl", "cuda:1"),
        # what init() starts on a GPU machine: a GPU model's tensors cross on NCCL, not through host memory and Gloo
        ("cpu:gloo,cuda:nccl", True, "nccl", "cuda:1"),
        ("mpi", True, "mpi", "cpu"),
    ],
)
def test_a_collectives_device_follows_the_groups_backends(gpus, monkeypatch, backend, cpu, on_cuda, gpu_tensors_on):
    gpus["count"], gpus["current"] = 2, 1
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert devices.uses_cpu() is cpu
    assert devices.group_device() == (torch.device("cpu") if cpu else torch.device("cuda", 1))
    assert devices.group_device(near=torch.device("cuda", 1)) == torch.device(gpu_tensors_on)
    assert devices.group_device(near=torch.device("cpu")) == devices.group_device()  # a CPU module's: as before
    assert devices.backend_of(None, torch.device("cuda", 1)) == on_cuda
    assert devices.backend_of(None, torch.device("cpu")) == ("gloo" if backend.startswith("cpu:") else backend)
