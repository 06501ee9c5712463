"""Plain DDP scripts in the settings where two threads could share a process group, one after another in one job.

Run under `trainaccel run` with sync options (e.g. `--sync-every 4 --sync-scope node --sync-warmup 6`) on 2 emulated
nodes x 2 workers, with TRAINACCEL_CHECK_OWNERS=1; each rank writes OUT_DIR/rank{r}.json: per setting, a digest of
its parameters (equal within a node under node scope) and of what state_dict() returns (the synced model, equal on
every rank), and the groups it joined. With TEST_DEVICE=cuda each worker trains on its own GPU over NCCL
(tests/gpu/test_cuda_many_gpus.py). Settings: a branch unused on some steps (find_unused_parameters), SyncBatchNorm's collectives over every
worker and over the node's workers, two DDP models, static_graph.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 24
CUDA = os.environ.get("TEST_DEVICE") == "cuda"
# Emulated nodes share one machine's GPUs: each worker takes the GPU of its global rank.
DEVICE = torch.device("cuda", int(os.environ["RANK"]) % torch.cuda.device_count()) if CUDA else torch.device("cpu")
SETTINGS = ["find_unused", "sync_bn_global", "sync_bn_node", "two_models", "static_graph"]


class SyncNorm(nn.BatchNorm1d):
    """SyncBatchNorm's collectives (an all-gather in forward, an all-reduce in backward) on a CPU model: DDP refuses
    nn.SyncBatchNorm on the CPU, and these issue from the same threads as on a GPU (the training thread, autograd's)."""

    def __init__(self, features: int, group):
        super().__init__(features)
        self.group = group

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from trainaccel.batchnorm import gathered_batch_norm, running_stats_factor

        return gathered_batch_norm(self, input, running_stats_factor(self), self.group)


def norm(setting: str) -> nn.Module:
    if setting == "sync_bn_global":
        return SyncNorm(16, None)
    if setting == "sync_bn_node":
        from trainaccel.comm.topology import node_group  # what convert_sync_batchnorm(scope="node") uses

        return SyncNorm(16, node_group())
    return nn.Identity()


class Net(nn.Module):
    def __init__(self, setting: str):
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.norm = norm(setting)
        self.head = nn.Linear(16, 4)
        self.other = nn.Linear(16, 4) if setting == "find_unused" else None

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.norm(self.body(x)))
        return self.other(h) if self.other is not None and step % 3 == 0 else self.head(h)


def wrap(setting: str, seed: int) -> DDP:
    torch.manual_seed(seed)
    module = Net(setting).to(DEVICE)
    return DDP(module, find_unused_parameters=setting == "find_unused", static_graph=setting == "static_graph")


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(setting: str, rank: int) -> dict:
    models = [wrap(setting, 0)] + ([wrap(setting, 1)] if setting == "two_models" else [])
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 12, generator=g).to(DEVICE), torch.randn(8, 4, generator=g).to(DEVICE)
        loss = sum(nn.functional.mse_loss(m(x, step), y) for m in models)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {
        "replica": digest(p for m in models for p in m.module.parameters()),
        "synced": digest(t for m in models for t in m.module.state_dict().values() if t.is_floating_point()),
        "loss": float(loss),
    }


if CUDA:
    torch.cuda.set_device(DEVICE)
dist.init_process_group("nccl" if CUDA else "gloo")
rank = dist.get_rank()
joined = []  # the process groups built after the script's own that this rank is a member of: its communicators
new_group = dist.new_group


def counting(ranks=None, *args, **kwargs):
    group = new_group(ranks, *args, **kwargs)
    if rank in (ranks or range(dist.get_world_size())):
        joined.append(sorted(ranks or range(dist.get_world_size())))
    return group


dist.new_group = counting
result = {"node": os.environ.get("GROUP_RANK"), **{s: train(s, rank) for s in sys.argv[2].split(",")}}
result["groups"] = joined
# Which of the engine's threads issued each group's jobs (the check trainaccel run installed; nothing imported here).
checked = sys.modules.get("trainaccel.comm.owners")
result["queues"] = sorted([ranks, queue or ""] for _, ranks, _, queue in checked.owners()) if checked else None
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
