"""Plain DDP training that follows the resume recipe in docs/operations.md (fail fast, resume from a checkpoint).

Argv: OUT_DIR STEPS [--fail-at-step N] [--fault raise|hang|kill|stop] [--every K] [--every-rank].
Steps are numbered 1..STEPS.
Rank 0 saves OUT_DIR/checkpoint.pt atomically after every K-th step (with --every-rank, each rank
saves OUT_DIR/checkpoint-rank{r}.pt: under a lossy codec each rank's engine state is its own);
at start every rank loads it if it exists and continues from the step after it. With --fail-at-step N,
rank 1 meets --fault (raises by default; hangs in Python, is killed or stopped, or its node is lost: its
agent killed with it) at the start of step N
in the first attempt only (TORCHELASTIC_RESTART_COUNT == "0"). At the end rank 0 writes
OUT_DIR/final.pt: the final parameters, the checkpoint step it resumed from (0: none) and the steps
this attempt ran.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("steps", type=int)
parser.add_argument("--fail-at-step", type=int)
parser.add_argument("--fault", choices=["raise", "hang", "kill", "stop", "lose-node"], default="raise")
parser.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps (a step's compute)")
parser.add_argument("--every", type=int, default=2, help="checkpoint every K steps")
parser.add_argument("--every-rank", action="store_true", help="each rank saves and loads a checkpoint of its own")
args = parser.parse_args()

BATCH = 8  # per rank
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")  # under `trainaccel run --max-restarts N`, each attempt gets a fresh store
rank, world = dist.get_rank(), dist.get_world_size()
checkpoint_path = os.path.join(args.out_dir, f"checkpoint-rank{rank}.pt" if args.every_rank else "checkpoint.pt")

# Fixed data: the same on every rank and in every attempt.
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 16, generator=g)
dataset = TensorDataset(x, x[:, :2].sum(dim=1, keepdim=True))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1, drop_last=True)
steps_per_epoch = len(sampler) // BATCH

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

# Resume: every rank loads the last checkpoint, if any, before DDP wraps the model.
start = 0
if os.path.exists(checkpoint_path):
    state = torch.load(checkpoint_path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
ddp = DDP(model)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for a step: a function of the step only, not of how many steps this process ran."""
    epoch, position = divmod(step - 1, steps_per_epoch)
    sampler.set_epoch(epoch)
    indices = list(sampler)[position * BATCH : (position + 1) * BATCH]
    return dataset[indices]


ran = []
for step in range(start + 1, args.steps + 1):
    if rank == 1 and step == args.fail_at_step and attempt == 0:
        print(f"rank 1 meets fault {args.fault} at step {step}", flush=True)
        if args.fault == "lose-node":  # its node goes away: torchrun's agent and this worker at once
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.fault == "hang":
            time.sleep(10**6)
        raise RuntimeError(f"rank 1 failed on purpose at step {step}")
    torch.manual_seed(1000 * step + rank)  # dropout's randomness keyed by step and rank too
    inputs, targets = batch(step)
    loss = nn.functional.mse_loss(ddp(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ran.append(step)
    time.sleep(args.step_s)
    if step % args.every == 0:
        if rank == 0 or args.every_rank:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, checkpoint_path + ".tmp")
            os.replace(checkpoint_path + ".tmp", checkpoint_path)  # a crash never leaves half a file
        dist.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet

if rank == 0:
    result = {"params": model.state_dict(), "resumed_from": start, "ran": ran, "attempt": attempt, "world": world}
    torch.save(result, os.path.join(args.out_dir, "final.pt.tmp"))
    os.replace(os.path.join(args.out_dir, "final.pt.tmp"), os.path.join(args.out_dir, "final.pt"))
# Let Gloo's threads finish with the last collectives before the group is torn down (torch 2.13 on
# CPU can otherwise abort a worker at exit).
dist.barrier()
del ddp
time.sleep(0.05)
dist.destroy_process_group()
