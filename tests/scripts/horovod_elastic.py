"""An elastic Horovod training script; only the imports differ from Horovod.

Usage: horovod_elastic.py OUT_DIR TAG [--crash-step N] [--crash-kind runtime|internal|lose-node] [--epochs E]

Each worker appends JSON events to OUT_DIR/TAG-<restart>-rank<rank>.jsonl: its start point,
every batch's dataset indices (before the commit that makes it count) and reset callbacks.
Rank 1 of the first incarnation fails at step --crash-step (lose-node: its torchrun agent and it are killed,
as when its node goes away). Rank 0 saves the final parameters.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainaccel.horovod as hvd
from trainaccel.horovod import elastic
from trainaccel.horovod.exceptions import HorovodInternalError

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("tag")
parser.add_argument("--crash-step", type=int, default=-1)
parser.add_argument("--crash-kind", choices=["runtime", "internal", "lose-node"], default="runtime")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

N, BATCH = 80, 4
hvd.init()
torch.manual_seed(1234 + hvd.rank())  # different on each rank: the first sync must fix that
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
events = open(args.out / f"{args.tag}-{restart}-rank{hvd.rank()}.jsonl", "a")


def emit(**event) -> None:
    events.write(json.dumps(event) + "\n")
    events.flush()


data = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.arange(N), torch.randn(N, 10, generator=data), torch.randn(N, 1, generator=data))
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
state.register_reset_callbacks([lambda: emit(event="reset", size=hvd.size())])


@elastic.run
def train(state: elastic.TorchState) -> None:
    emit(event="start", epoch=state.epoch, step=state.step, size=hvd.size())
    for epoch in range(state.epoch, args.epochs):
        for i, (idx, xb, yb) in enumerate(loader):
            if state.step == args.crash_step and restart == "0" and hvd.rank() == 1:
                if args.crash_kind == "lose-node":
                    os.kill(os.getppid(), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise (HorovodInternalError if args.crash_kind == "internal" else RuntimeError)("injected failure")
            optimizer.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            optimizer.step()
            state.step += 1
            emit(event="batch", epoch=epoch, step=state.step, indices=idx.tolist())
            state.sampler.record_batch(i, BATCH)
            state.commit()
        state.epoch = epoch + 1
        state.sampler.set_epoch(epoch + 1)
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save([p.detach() for p in model.parameters()], args.out / f"{args.tag}-params.pt")
