"""A plain DDP training script, nothing of trainaccel's in it: `torchrun` or `trainaccel run` starts it."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(dist.get_rank())
for step in range(200):
    x = torch.randn(64, 32, generator=data).to(device)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 50 == 49 and dist.get_rank() == 0:
        print(f"step {step + 1}: loss {loss.item():.4f}")
dist.destroy_process_group()
