"""A training script as a Horovod user writes it; only the import differs from Horovod.

Usage: horovod_train.py OUT_PT [BACKWARD_PASSES_PER_STEP]. Rank 0 saves the final parameters.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import trainaccel.horovod as hvd

hvd.init()
torch.manual_seed(1234 + hvd.rank())  # different on each rank: broadcast_parameters must fix that

passes = int(sys.argv[2]) if len(sys.argv) > 2 else 1
data = torch.Generator().manual_seed(0)
x, y = torch.randn(128, 10, generator=data), torch.randn(128, 1, generator=data)
dataset = TensorDataset(x, y)
sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
loader = DataLoader(dataset, batch_size=8, sampler=sampler)

model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=passes
)

for _epoch in range(2):
    for i, (xb, yb) in enumerate(loader):
        loss = F.mse_loss(model(xb), yb) / passes
        loss.backward()
        if (i + 1) % passes == 0:
            optimizer.step()
            optimizer.zero_grad()

if hvd.rank() == 0:
    torch.save({"params": [p.detach() for p in model.parameters()], "size": hvd.size()}, sys.argv[1])
