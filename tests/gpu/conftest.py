"""GPU tests: code paths that only run on CUDA. Each is marked `gpu`; without CUDA every `gpu`-marked test is skipped.

`tools/gpu-check` runs them (`pytest -m gpu`) on a GPU machine. `GPU_TESTS_ON_CPU=1` runs them on the CPU instead,
to check the tests' own logic while developing them (the CUDA-only checks, such as streams, skip); it proves
nothing about CUDA.
"""

import os

import pytest
import torch

import conftest as root_conftest

ON_CPU = os.environ.get("GPU_TESTS_ON_CPU") == "1" and not torch.cuda.is_available()
SKIP_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False (tools/gpu-check runs these on a GPU machine)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with every item of the session: a `gpu` test elsewhere is skipped too.
    if torch.cuda.is_available() or ON_CPU:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """This process's GPU (the CPU under GPU_TESTS_ON_CPU=1)."""
    if ON_CPU:
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@pytest.fixture
def needs_cuda(device: torch.device) -> None:
    """For a check that means nothing on the CPU (CUDA streams), even under GPU_TESTS_ON_CPU=1."""
    if device.type != "cuda":
        pytest.skip("needs CUDA streams; GPU_TESTS_ON_CPU runs the rest of this module on the CPU")


@pytest.fixture
def one_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment torchrun gives a job of one worker, so that `trainaccel.init()` starts the process group
    itself, as in a script: on a GPU machine `cpu:gloo,cuda:nccl` (conftest's autouse fixture ends it)."""
    for name in [n for n in os.environ if n.startswith("TRAINACCEL_")]:
        monkeypatch.delenv(name)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(root_conftest.free_port())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
