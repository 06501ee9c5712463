"""Every codec x hierarchy on/off x the DDP settings users set, trained on real Gloo workers in one job.

Run as 2 emulated nodes x 2 workers. For each cell a small regression task is trained for STEPS
steps through `trainaccel.comm.register`; plain DDP (no hook) is trained once per setting as the
reference. Rank 0 writes OUT_DIR/matrix.json: per cell the first and final evaluation loss, whether
every parameter is bitwise equal on all ranks, the largest difference from plain DDP's parameters,
the exact retries, the steps the engine saw skipped, and trainaccel's host reads of tensors (bool, item, tolist...)
from step 3 on, by thread: on a GPU each of them waits for the device.
Usage: engine_matrix.py OUT_DIR [CODEC,...]
"""

import collections
import contextlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import register

STEPS, SPIKE_STEP, SPIKE, SKIP_NORM = 30, 12, 1e8, 1e4
IN, HIDDEN, OUT, BATCH, VOCAB = 16, 32, 4, 16, 64
CODECS = ["none", "fp16", "fp16-peak", "bf16", "topk", "randomk", "powersgd"]
# Columns that are a codec with options of its own. "fp16" is fp16_scale=auto's on the CPU: dynamic.
COLUMNS = {"fp16-peak": {"compression": "fp16", "fp16_scale": "peak"}}
SETTINGS = [
    "plain",
    "find_unused",
    "bucket_view",
    "static_graph",
    "no_sync",
    "mixed_dtype",
    "fp16_model",
    "bf16_model",
    "sparse",
    "two_models",
    "spike",
]

SOURCE = os.path.dirname(trainaccel.__file__)
reads: collections.Counter = collections.Counter()  # (thread, function) -> host reads while `counting`
counting = False


def count_reads(name: str) -> None:
    """Count the calls of `torch.Tensor.<name>` made directly by trainaccel's code, by thread and function."""
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if counting:
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(SOURCE):
                thread = "training" if threading.current_thread() is threading.main_thread() else "comm"
                reads[f"{thread} {caller.co_name}"] += 1
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


for method in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
    count_reads(method)

teacher = torch.Generator().manual_seed(1234)
W1, W2 = torch.randn(IN, HIDDEN, generator=teacher) / IN**0.5, torch.randn(HIDDEN, OUT, generator=teacher) / HIDDEN**0.5
TABLE = torch.randn(VOCAB, IN, generator=teacher)


def batch(setting: str, generator: torch.Generator, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    if setting == "sparse":
        ids = torch.randint(VOCAB, (size, 4), generator=generator)
        return ids, torch.tanh(TABLE[ids].mean(1) @ W1) @ W2
    x = torch.randn(size, IN, generator=generator)
    return x, torch.tanh(x @ W1) @ W2


class Net(nn.Module):
    """The student: an MLP (with an embedding bag in front for `sparse`, a sometimes-used branch for `find_unused`)."""

    def __init__(self, setting: str):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, IN, sparse=True) if setting == "sparse" else None
        self.hidden, self.out = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT) if setting == "find_unused" else None
        if setting == "mixed_dtype":
            self.hidden.double()
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x).mean(1)
        h = torch.tanh(self.hidden(x.to(self.hidden.weight.dtype))).to(self.out.weight.dtype)
        y = self.out(h)
        return y + self.branch(h) * 0.1 if self.use_branch else y


def build(setting: str, options: dict | None) -> tuple[list[DDP], list, list[torch.optim.Optimizer]]:
    """The DDP model(s) of a setting, each registered with `options` (None: plain DDP), and their optimizers."""
    kwargs = {
        "find_unused_parameters": setting == "find_unused",
        "gradient_as_bucket_view": setting == "bucket_view",
        "static_graph": setting == "static_graph",
    }
    net = Net(setting)
    if setting in ("fp16_model", "bf16_model"):
        net.to(torch.float16 if setting == "fp16_model" else torch.bfloat16)
    parts = [net] if setting != "two_models" else [nn.Sequential(net.hidden, nn.Tanh()), net.out]
    models = [DDP(part, **kwargs) for part in parts]
    # compression_warmup=1: the codecs start at step 2, so the spike at step 12 meets them.
    options = None if options is None else {"compression_warmup": 1, **options}
    states = [register(model, **options) if options is not None else None for model in models]
    optimizers = []
    for model in models:
        dense = [p for name, p in model.module.named_parameters() if not name.startswith("embedding")]
        groups = [{"params": dense}]
        if setting == "sparse":  # SGD's momentum does not take sparse gradients; rows learn slowly without it
            groups.append({"params": list(model.module.embedding.parameters()), "lr": 1.0, "momentum": 0.0})
        optimizers.append(torch.optim.SGD(groups, lr=0.05, momentum=0.9))
    return models, states, optimizers


def forward(models: list[DDP], x: torch.Tensor) -> torch.Tensor:
    for model in models:
        x = model(x)
    return x.float()


def evaluate(models: list[DDP], setting: str) -> float:
    x, y = batch(setting, torch.Generator().manual_seed(99), 512)
    with torch.no_grad():
        return nn.functional.mse_loss(forward([m.module for m in models], x), y).item()


def train(setting: str, options: dict | None, spike: float = 1.0) -> dict:
    """Train one cell; `spike` multiplies the loss at SPIKE_STEP (the script then skips that step, as its check says)."""
    global counting
    models, states, optimizers = build(setting, options)
    reads.clear()
    counted = 0
    data = torch.Generator().manual_seed(dist.get_rank())
    first, skipped = evaluate(models, setting), []
    for step in range(1, STEPS + 1):
        # The spiked step and the one after it take the exact retry and drop residuals: their reads are expected.
        counting = step >= 3 and not (setting == "spike" and step in (SPIKE_STEP, SPIKE_STEP + 1))
        counted += counting
        if setting == "find_unused":
            models[0].module.use_branch = step % 2 == 0
        micro = 2 if setting == "no_sync" else 1
        for i in range(micro):
            x, y = batch(setting, data)
            sync = contextlib.nullcontext() if i == micro - 1 else models[0].no_sync()
            with sync:
                loss = nn.functional.mse_loss(forward(models, x), y) / micro
                (loss * (spike if step == SPIKE_STEP and setting == "spike" else 1.0)).backward()
        if setting == "spike":
            # The user's own guard: skip a step whose gradient is not finite or far too large.
            norm = torch.nn.utils.clip_grad_norm_([p for m in models for p in m.parameters()], float("inf"))
            if not torch.isfinite(norm) or norm > SKIP_NORM or (spike == 1.0 and step == SPIKE_STEP):
                skipped.append(step)
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                continue
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    counting = False
    params = torch.cat([p.detach().double().flatten() for m in models for p in m.parameters()])
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {
        "first": first,
        "final": evaluate(models, setting),
        "replicas_equal": all(torch.equal(g, params) for g in gathered),
        "params": params,
        "fallbacks": sum(s.fallbacks for s in states if s is not None and not s.builtin),
        "skipped_by_engine": sum(s.skipped_steps for s in states if s is not None and not s.builtin),
        "skipped": skipped,
        "hierarchical": any(s.hierarchical for s in states if s is not None),
        "host_reads": dict(reads),
        "steps_counted": counted,
    }


dist.init_process_group("gloo")
out_dir = sys.argv[1]
codecs = sys.argv[2].split(",") if len(sys.argv) > 2 else CODECS
results: dict = {}
began = time.perf_counter()
for setting in SETTINGS:
    plain = train(setting, None)
    results[f"plain/{setting}"] = {k: v for k, v in plain.items() if k != "params"}
    for codec in codecs:
        for hierarchical in ("off", "on"):
            # nan_check=warn: `none` flat would otherwise hand the bucket to DDP's own C++ allreduce.
            # compression_ratio=0.1: randomk sends every element once per 10 steps, several times in the run.
            options = {
                "compression": codec,
                "hierarchical": hierarchical,
                "nan_check": "warn",
                "compression_ratio": 0.1,
                **COLUMNS.get(codec, {}),
            }
            cell = train(setting, options, SPIKE)
            cell["max_diff_from_plain"] = (cell.pop("params") - plain["params"]).abs().max().item()
            if setting == "spike":  # the same run with that step skipped and no spike
                cell["final_without_spike"] = train(setting, options)["final"]
            results[f"{codec}/{hierarchical}/{setting}"] = cell
results["seconds"] = time.perf_counter() - began
if dist.get_rank() == 0:
    with open(f"{out_dir}/matrix.json", "w") as f:
        json.dump(results, f, indent=1)
dist.barrier()
dist.destroy_process_group()
