"""A plain DDP training script with no trainaccel import, as users write them."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out-dir", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--scaled", action="store_true", help="add the one line fp16 needs (imports trainaccel)")
parser.add_argument("--lr-drop-at", type=int, help="divide the learning rate by 10 at this step")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
inner_dtypes = set()  # what the first layer computes in: a plain forward hook, as any script may add
model.module[0].register_forward_hook(lambda module, inputs, output: inner_dtypes.add(str(output.dtype)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.scaled:
    import trainaccel.amp

    optimizer = trainaccel.amp.scaled(optimizer)
g = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
losses, output_dtypes = [], set()
for step in range(args.steps):
    if step == args.lr_drop_at:
        optimizer.param_groups[0]["lr"] /= 10
    x = torch.randn(16, 32, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)
    output = model(x)
    output_dtypes.add(str(output.dtype))
    loss = nn.functional.mse_loss(output, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

observer = getattr(model, "trainaccel", None)
state = observer.comm if observer is not None else None
amp = observer.amp if observer is not None else None
scaler = getattr(optimizer, "trainaccel_scaler", None)
result = {
    "rank": rank,
    "world_size": dist.get_world_size(),
    "comm_hook": model._get_ddp_logging_data().get("comm_hook"),
    "bucket_bytes_cap": model.bucket_bytes_cap,
    "trainaccel": state is not None,
    "compression": state.codec.name if state else None,
    "bytes_per_step": state.bytes_per_step() if state else None,
    "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
    "inner_dtypes": sorted(inner_dtypes),
    "output_dtypes": sorted(output_dtypes),
    "losses": losses,
    "autocast_forwards": amp.autocast_forwards if amp else None,
    "grad_scale": scaler.get_scale() if scaler else None,
    "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "argv": os.sys.argv,
    "name": __name__,
}
with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
# As DDP scripts end on torch 2.13's CPU Gloo (else a worker can abort at exit under plain torchrun):
# the last collectives finished, the DDP model dropped, a moment for Gloo's threads, then the group.
dist.barrier()
del model, optimizer
time.sleep(0.05)
dist.destroy_process_group()
