"""`trainaccel.shutdown()` is the exact inverse of `init()`: torch as it was found, whatever was used in between."""

from __future__ import annotations

import logging
import socket
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad
from torch.optim import lr_scheduler
from torch.optim import optimizer as optim_module

import trainaccel
from trainaccel import context, observer
from trainaccel.comm import LocalSteps, comm_state


def torch_as_it_is() -> dict[str, object]:
    """Every attribute of torch (and of the process) that init() or a feature it turns on may change."""
    log = logging.getLogger("trainaccel")
    found: dict[str, object] = {
        "DistributedDataParallel.__init__": vars(DistributedDataParallel)["__init__"],
        "Module.load_state_dict": vars(nn.Module)["load_state_dict"],
        "Tensor.backward": vars(torch.Tensor)["backward"],
        "sys.excepthook": sys.excepthook,
        "c10d default timeout": distributed_c10d._get_default_timeout,
        "optimizer pre-hooks": dict(optim_module._global_optimizer_pre_hooks),
        "optimizer post-hooks": dict(optim_module._global_optimizer_post_hooks),
        "logger": (list(log.handlers), log.level, log.propagate),
        "process group": dist.is_initialized(),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("trainaccel")),
    }
    for module in (torch.nn.utils, clip_grad):
        found.update({f"{module.__name__}.{n}": v for n, v in vars(module).items() if "clip" in n or "norm" in n})
    for cls in vars(lr_scheduler).values():
        if isinstance(cls, type) and "step" in vars(cls):
            found[f"{cls.__name__}.step"] = vars(cls)["step"]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_worker_env(monkeypatch, tmp_path):
    """The environment torchrun gives a job of one worker, so that init() starts the process group itself."""
    for name in [n for n in __import__("os").environ if n.startswith("TRAINACCEL_")]:
        monkeypatch.delenv(name)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    return tmp_path


OPTIONS = {
    "defaults": {},
    "fp16 codec, metrics, nan check": {"compression": "fp16", "metrics_every": 2, "nan_check": "warn"},
    "topk, straggler, timeline": {"compression": "topk", "straggler_every": 2, "timeline": "{tmp}/trace.json"},
    "amp bf16 with a policy": {"amp": "bf16", "amp_policy": "auto"},
    "amp fp16 scaled": {"amp": "fp16"},
    "autotune": {"autotune": "on", "compression": "fp16"},
    "local steps": {"local_steps": 2},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_init_then_shutdown_leaves_torch_as_it_found_it(one_worker_env, options):
    before = torch_as_it_is()
    options = {k: v.replace("{tmp}", str(one_worker_env)) if isinstance(v, str) else v for k, v in options.items()}
    trainaccel.init(**options)
    assert dist.is_initialized() and context.patched()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = trainaccel.amp.scaled(torch.optim.SGD(model.parameters(), lr=0.1))
    schedule = lr_scheduler.StepLR(optimizer, 1)
    steps = LocalSteps(model, optimizer) if options.get("local_steps") else None
    for _ in range(4):
        with steps if steps is not None else _nothing():
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
        if steps is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    watched = model.trainaccel
    assert watched.step == 4 and torch_as_it_is() != before

    trainaccel.shutdown()
    assert torch_as_it_is() == before
    assert context.patched() == [] and context.current_config() is None
    # The model built under init() is detached: no hook of ours left on it, its own forward back.
    assert not model._forward_pre_hooks and "forward" not in vars(model)
    assert not hasattr(optimizer, "trainaccel_scaler")
    assert watched.optimizer_steps is None and observer.process_step() == 0
    if comm_state(model) is not None:
        assert getattr(comm_state(model), "observer", watched) is watched  # its state stays readable


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_init_works_again_after_shutdown(one_worker_env):
    before = torch_as_it_is()
    for compression in ("fp16", "none"):
        trainaccel.init(compression=compression)
        model = DistributedDataParallel(nn.Linear(4, 1))
        model(torch.randn(2, 4)).sum().backward()
        assert model.trainaccel.step == 1 and comm_state(model) is not None
        trainaccel.shutdown()
        assert torch_as_it_is() == before


def test_shutdown_without_init_changes_nothing():
    before = torch_as_it_is()
    trainaccel.shutdown()
    assert torch_as_it_is() == before


def test_undo_reports_every_failure_and_undoes_the_rest():
    class Owner:
        value = 1

    context.patch(Owner, "value", 2)
    context.on_undo("a broken undo", lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="could not undo: a broken undo: ZeroDivisionError"):
        context.undo_all()
    assert Owner.value == 1 and context.patched() == []
