"""Workers whose optimizer steps reach a DDP model, or none: `accelerate` (an `Accelerator()` without `cpu=True`, on a
machine without GPUs), `alone` (a loop that never wraps its model), `ddp` (a plain DDP model: the options are taken)."""

import sys

import torch
import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(model, optimizer)
        print(f"accelerate: {accelerator.num_processes} process(es), model {type(model).__name__}", flush=True)
    elif mode == "ddp":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    for _ in range(4):
        loss = model(torch.randn(8, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
