"""A plain DDP loop for `trainaccel bench faults` (no trainaccel import): one rank meets a fault at one step.

python fault_worker.py --fault hang|stop|kill|abort|raise|slow|none --rank R --at STEP [--steps N] [--step-s S]
    [--peers-no-sync-s S]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

IN_WORKER = ("hang", "stop", "kill", "abort", "raise", "slow", "none")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=IN_WORKER, required=True)
    parser.add_argument("--rank", type=int, required=True, help="the rank that meets the fault")
    parser.add_argument("--at", type=int, required=True, help="the step at which it meets it")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-s", type=float, default=0.2, help="seconds each step sleeps (a step's compute)")
    parser.add_argument("--slow-s", type=float, default=0.0, help="--fault slow: seconds the one slow step takes")
    parser.add_argument(
        "--peers-no-sync-s",
        type=float,
        default=0.0,
        help="at step --at, the other ranks train this long without a collective (DDP no_sync): like ranks blocked "
        "in an NCCL collective, they see no error from a peer that died",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        print(f"rank {rank} step {step}", flush=True)
        if rank == args.rank and step == args.at and args.fault != "none":
            print(f"rank {rank} meets fault {args.fault} at step {step}", flush=True)
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # as when its machine goes away: no error, no goodbye
            elif args.fault == "abort":
                os.abort()  # as NCCL's watchdog ends a worker whose collective timed out: no Python runs
            elif args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # alive to the kernel, never runs again
            elif args.fault == "raise":
                raise RuntimeError(f"rank {rank} failed on purpose at step {step}")
            else:  # hang: a Python-level stall that never ends; slow: one that does
                time.sleep(args.slow_s if args.fault == "slow" else 10**6)
        elif rank != args.rank and step == args.at and args.peers_no_sync_s > 0:
            alone_until = time.monotonic() + args.peers_no_sync_s
            with model.no_sync():  # gradients accumulate locally: no collective to fail
                while time.monotonic() < alone_until:
                    model(torch.randn(8, 16)).square().mean().backward()
                    time.sleep(args.step_s)
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_s)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
