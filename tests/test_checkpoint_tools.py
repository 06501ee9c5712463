"""Checkpoints written by the common tools, resumed under `trainaccel.init()`: the engine's state comes back, or one
warning says what starts anew.

Each test trains 2 steps under a lossy codec (compression=fp16: its residuals) or sync_every=2 with an int8 outer
codec (the schedule, anchors and residuals; the checkpoint comes right after a sync, where a resume is exact), writes
the checkpoint with the tool itself, and notes what 2 more steps of the uninterrupted run give. Then it restarts as a
new process would (the trained model gone, `shutdown()` and `init()` again), resumes a freshly built model through
the tool and takes those steps. A tool whose file keeps the state dict's metadata (torch.save, Lightning) resumes the
engine's state as saved and the uninterrupted trajectory exactly; one that keeps tensors only must say once what
starts anew, and the steps show the loss is real.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel

OPTIONS = {
    "fp16": {"compression": "fp16"},
    "sync_every": {"sync_every": 2, "outer_compression": "int8"},
}
LOST = {  # what the warning must name
    "fp16": ["fp16's residuals"],
    "sync_every": ["int8's residuals", "the sync schedule"],
}
WARNING = "carries no trainaccel engine state"
STEPS, MORE = 2, 2  # saved after STEPS (under sync_every=2, right after a sync), resumed for MORE (to the next)


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A Gloo group of world size 1 for this module's tests (as tests/comm/conftest.py's)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    trainaccel.shutdown()
    dist.destroy_process_group()


pytestmark = pytest.mark.usefixtures("one_process_group")


# -- the models and their steps -------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def mlp_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean()


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )


def gpt2() -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config())


def gpt2_loss(model: nn.Module, step: int) -> torch.Tensor:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, labels=ids).loss


def train(model: DDP, loss: Callable[[nn.Module, int], torch.Tensor], steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: the engine's is all there is
    for step in steps:
        optimizer.zero_grad()
        loss(model, step).backward()
        optimizer.step()


def restart(options: dict[str, Any]) -> None:
    """What a restarted job's new process has: none of the trained model's engine, init() called anew."""
    trainaccel.shutdown()
    gc.collect()
    trainaccel.init(start_process_group=False, **options)


def same(a: Any, b: Any) -> bool:
    """Nested dicts/lists/tuples of tensors and plain values, equal (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- the tools: write the trained DDP model to a folder; build a fresh model and resume it from there -------------------


def torch_save(model: DDP, folder: Path) -> None:
    torch.save(model.state_dict(), folder / "model.pt")


def torch_load(folder: Path) -> DDP:
    resumed = DDP(mlp())
    resumed.load_state_dict(torch.load(folder / "model.pt"))  # weights_only, torch's default
    return resumed


def torch_save_module(model: DDP, folder: Path) -> None:
    torch.save(model.module.state_dict(), folder / "module.pt")


def torch_load_before_wrapping(folder: Path) -> DDP:
    module = mlp()
    module.load_state_dict(torch.load(folder / "module.pt"))
    return DDP(module)


def safetensors_save(model: DDP, folder: Path) -> None:
    save_file(model.state_dict(), folder / "model.safetensors")


def safetensors_load(folder: Path) -> DDP:
    resumed = DDP(mlp())
    resumed.load_state_dict(load_file(folder / "model.safetensors"))
    return resumed


def dcp_save(model: DDP, folder: Path) -> None:
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder / "dcp")


def dcp_load(folder: Path) -> DDP:
    """DCP's documented resume: its load fills, in place, a state dict built from the fresh model."""
    resumed = DDP(mlp())
    state = {"model": resumed.state_dict()}
    dcp.load(state, checkpoint_id=folder / "dcp")
    resumed.load_state_dict(state["model"])
    return resumed


def dcp_api_save(model: DDP, folder: Path) -> None:
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder / "dcp")


def dcp_api_load(folder: Path) -> DDP:
    resumed = DDP(mlp())
    state = {"model": get_model_state_dict(resumed)}
    dcp.load(state, checkpoint_id=folder / "dcp")
    set_model_state_dict(resumed, state["model"])
    return resumed


def save_pretrained(model: DDP, folder: Path) -> None:
    model.module.save_pretrained(folder / "hf")


def load_state_dict_of_pretrained(folder: Path) -> DDP:
    from transformers import GPT2LMHeadModel

    resumed = DDP(gpt2())
    resumed.module.load_state_dict(GPT2LMHeadModel.from_pretrained(folder / "hf").state_dict())
    return resumed


def from_pretrained(folder: Path) -> DDP:
    from transformers import GPT2LMHeadModel

    return DDP(GPT2LMHeadModel.from_pretrained(folder / "hf").train())


@dataclass
class Tool:
    save: Callable[[DDP, Path], None]
    resume: Callable[[Path], DDP]
    carries: bool  # the file keeps the engine's state; else the resume must say what starts anew
    build: Callable[[], nn.Module] = mlp
    loss: Callable[[nn.Module, int], torch.Tensor] = mlp_loss


TOOLS = {
    "torch.save": Tool(torch_save, torch_load, carries=True),
    "torch.save-module-before-ddp": Tool(torch_save_module, torch_load_before_wrapping, carries=True),
    "safetensors": Tool(safetensors_save, safetensors_load, carries=False),
    "dcp": Tool(dcp_save, dcp_load, carries=False),
    "dcp-state_dict-api": Tool(dcp_api_save, dcp_api_load, carries=False),
    "save_pretrained+load_state_dict": Tool(
        save_pretrained, load_state_dict_of_pretrained, carries=False, build=gpt2, loss=gpt2_loss
    ),
    "save_pretrained+from_pretrained": Tool(
        save_pretrained, from_pretrained, carries=False, build=gpt2, loss=gpt2_loss
    ),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize(
    "tool",
    list(TOOLS),
)
def test_a_resume_through_the_tool_restores_the_engine_state_or_says_what_starts_anew(
    tool, option, tmp_path, trainaccel_messages
):
    t = TOOLS[tool]
    trainaccel.init(start_process_group=False, **OPTIONS[option])
    model = DDP(t.build())
    train(model, t.loss, range(STEPS))
    saved = copy.deepcopy(trainaccel.comm.state_dict(model))  # its tensors are the live ones
    assert saved.get("diloco", {}).get("residuals") or any(b.get("residual") for b in saved.get("buckets", []))
    t.save(model, tmp_path)
    train(model, t.loss, range(STEPS, STEPS + MORE))
    uninterrupted = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    del model
    restart(OPTIONS[option])
    said_before = len(trainaccel_messages)

    resumed = t.resume(tmp_path)
    engine = copy.deepcopy(trainaccel.comm.state_dict(resumed))  # before its first step
    train(resumed, t.loss, range(STEPS, STEPS + MORE))
    said = [m for m in trainaccel_messages[said_before:] if WARNING in m]
    exact = all(torch.equal(p, uninterrupted[name]) for name, p in resumed.module.named_parameters())
    if t.carries:
        assert said == []
        assert same(engine, saved), "the engine's state did not come back as saved"
        assert exact, "the resumed step is not the uninterrupted run's"
    else:
        assert len(said) == 1, f"expected one warning that the engine state starts anew, got {said}"
        assert all(lost in said[0] for lost in LOST[option]), said[0]
        assert "trainaccel.comm.state_dict(model)" in said[0]
        assert not exact  # what was lost mattered: the warning is due


# -- Lightning: its own Trainer saves and resumes ---------------------------------------------------------------------


def lightning_trainer(folder: Path, steps: int, callbacks: list) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp",  # the group is up already: Lightning uses it, and starts no process for one device
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
        callbacks=callbacks,
    )


# Importing Lightning may start a process: with matplotlib installed, its first import scans the fonts (fc-list).
@pytest.mark.multiprocess
@pytest.mark.parametrize("option", OPTIONS)
def test_lightning_save_checkpoint_and_fit_from_it_restore_the_engine_state(option, tmp_path, trainaccel_messages):
    """`trainer.save_checkpoint` keeps `lightning_module.state_dict()` (its metadata too, torch.save pickles it);
    `fit(ckpt_path=...)` loads it into the LightningModule before DDP wraps it."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Engine(L.Callback):
        """The engine's state of the DDP model Lightning built: as training starts, and after each step."""

        def __init__(self):
            self.at_start, self.after = None, []

        def on_train_start(self, trainer, pl_module):
            self.at_start = copy.deepcopy(trainaccel.comm.state_dict(trainer.strategy.model))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after.append(trainaccel.comm.state_dict(trainer.strategy.model))

    torch.manual_seed(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=3)
    trainaccel.init(start_process_group=False, **OPTIONS[option])
    trainer = lightning_trainer(tmp_path, STEPS, [])
    trainer.fit(Module(), data)
    saved = copy.deepcopy(trainaccel.comm.state_dict(trainer.strategy.model))  # the LightningModule, unwrapped
    assert saved.get("diloco", {}).get("residuals") or any(b.get("residual") for b in saved.get("buckets", []))
    gc.collect()  # the DDP model fit() built and dropped at its end: what a later save_checkpoint may find
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    del trainer
    restart(OPTIONS[option])
    said_before = len(trainaccel_messages)

    engine = Engine()
    lightning_trainer(tmp_path, STEPS + MORE, [engine]).fit(Module(), data, ckpt_path=tmp_path / "last.ckpt")
    assert not [m for m in trainaccel_messages[said_before:] if WARNING in m]
    assert same(engine.at_start, saved), "the engine's state did not come back as saved"
    after = engine.after[0]  # one step more: the engine counts on from the checkpoint's steps
    assert (after["diloco"]["steps"] if option == "sync_every" else after["counters"]["steps"]) == STEPS + 1


# -- key rewrites: a script that renames the keys between saving and loading ----------------------------------------


class Outer(nn.Module):
    """A module that holds the model as `net` (a prefix added to every key)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def compiled(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="eager")  # the keys of any backend's module: `_orig_mod.` first


def strip_in_place(prefix: str) -> Callable[[dict], dict]:
    """nanoGPT's resume: `state_dict[k[len(prefix):]] = state_dict.pop(k)`, on the dict itself (its metadata kept)."""

    def rewrite(state: dict) -> dict:
        for key in list(state):
            if key.startswith(prefix):
                state[key[len(prefix) :]] = state.pop(key)
        return state

    return rewrite


def add_in_place(prefix: str) -> Callable[[dict], dict]:
    def rewrite(state: dict) -> dict:
        for key in list(state):
            state[prefix + key] = state.pop(key)
        return state

    return rewrite


@dataclass
class Rewrite:
    build: Callable[[], DDP]  # the trained model
    save: Callable[[DDP], dict]  # the state dict the script saves
    rewrite: Callable[[dict], dict]  # what the script does to it when it resumes
    resume: Callable[[dict], DDP]  # a fresh model loading it, wrapped in DDP
    keeps_metadata: bool = True  # else the state dict is a new dict: the resume must say what starts anew


def _load_then(wrap: Callable[[nn.Module], nn.Module], inner: Callable[[], nn.Module] = mlp):
    def resume(state: dict) -> DDP:
        module = wrap(inner())
        module.load_state_dict(state)
        return DDP(module)

    return resume


def _load_bare_then_compile(state: dict) -> DDP:
    module = mlp()
    module.load_state_dict(state)
    return DDP(compiled(module))


REWRITES = {
    # nanoGPT with compile=True: raw_model (the compiled module) saved, `_orig_mod.` stripped, loaded before compiling.
    "orig_mod-stripped": Rewrite(
        lambda: DDP(compiled(mlp())),
        lambda m: m.module.state_dict(),
        strip_in_place("_orig_mod."),
        _load_bare_then_compile,
    ),
    "module-orig_mod-stripped": Rewrite(
        lambda: DDP(compiled(mlp())),
        lambda m: m.state_dict(),
        strip_in_place("module._orig_mod."),
        _load_bare_then_compile,
    ),
    "module-stripped": Rewrite(
        lambda: DDP(mlp()), lambda m: m.state_dict(), strip_in_place("module."), _load_then(lambda m: m)
    ),
    "orig_mod-added": Rewrite(
        lambda: DDP(mlp()), lambda m: m.module.state_dict(), add_in_place("_orig_mod."), _load_then(compiled)
    ),
    "prefix-added": Rewrite(
        lambda: DDP(mlp()), lambda m: m.module.state_dict(), add_in_place("net."), _load_then(Outer)
    ),
    "new-dict": Rewrite(
        lambda: DDP(mlp()),
        lambda m: m.state_dict(),
        lambda state: {k.removeprefix("module."): v for k, v in state.items()},
        _load_then(lambda m: m),
        keeps_metadata=False,
    ),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("rewrite", REWRITES)
def test_a_resume_through_renamed_keys_restores_the_engine_state_or_says_what_starts_anew(
    rewrite, option, trainaccel_messages
):
    r = REWRITES[rewrite]
    trainaccel.init(start_process_group=False, **OPTIONS[option])
    model = r.build()
    train(model, mlp_loss, range(STEPS))
    saved_engine = copy.deepcopy(trainaccel.comm.state_dict(model))
    saved = copy.deepcopy(r.save(model))  # what torch.save then torch.load would give
    train(model, mlp_loss, range(STEPS, STEPS + MORE))
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    del model
    restart(OPTIONS[option])
    said_before = len(trainaccel_messages)

    resumed = r.resume(r.rewrite(saved))
    engine = copy.deepcopy(trainaccel.comm.state_dict(resumed))
    train(resumed, mlp_loss, range(STEPS, STEPS + MORE))
    said = [m for m in trainaccel_messages[said_before:] if WARNING in m]
    exact = all(torch.equal(p, q) for p, q in zip(resumed.parameters(), uninterrupted))
    if r.keeps_metadata:
        assert said == [], said
        assert same(engine, saved_engine), "the engine's state did not come back as saved"
        assert exact, "the resumed step is not the uninterrupted run's"
    else:
        assert len(said) == 1, f"expected one warning that the engine state starts anew, got {said}"
        assert all(lost in said[0] for lost in LOST[option]), said[0]


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"compression": "fp16"}, "fp16's residuals (what it has not sent yet) starts anew; save "),
        (
            {"compression": "powersgd"},
            "powersgd's residuals and low-rank factors and its step count (its 20 exact warm-up steps run again) "
            "start anew",
        ),
        ({"compression": "topk"}, "topk's residuals (what it has not sent yet) and the step count (its 20 exact"),
        ({"sync_every": 2}, "the sync schedule (the next sync comes sync_every steps after the load) starts anew"),
        (
            {"sync_every": 2, "outer_optimizer": "nesterov", "outer_compression": "int8"},
            "sync_every's outer momentum, int8's residuals (what it has not sent yet) and the sync schedule (the "
            "next sync comes sync_every steps after the load) start anew; save `trainaccel.comm.state_dict(model)` "
            "beside it to keep them",
        ),
    ],
)
def test_what_starts_anew_is_named_in_one_line(options, expected, trainaccel_messages):
    from trainaccel.comm.checkpoint import say_what_starts_anew

    restart(options)
    said_before = len(trainaccel_messages)
    say_what_starts_anew("load_state_dict: no engine state")
    said = trainaccel_messages[said_before:]
    assert len(said) == 1 and expected in said[0], said
