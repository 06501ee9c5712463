"""Train one model sharded with trainaccel.shard() and the same model under plain DDP, side by side; write both.

Argv: OUT_DIR MODE (full or hybrid). AdamW, 6 steps, each rank its own batches. Writes per rank the
losses of both, and on rank 0 whether the full state dicts agree.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import trainaccel

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
)
reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
sharded = trainaccel.shard(model, mode, min_params=1000)
optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sharded, reference)]
generator = torch.Generator().manual_seed(rank)
losses = {"sharded": [], "ddp": []}
for _ in range(6):
    x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 4, generator=generator)
    for name, m, optimizer in zip(("sharded", "ddp"), (sharded, reference), optimizers):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        optimizer.step()
        losses[name].append(loss.item())
full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
plain = reference.module.state_dict()
result = {
    "losses": losses,
    "sharded_type": type(next(sharded.parameters())).__name__,
    "mesh": list(next(sharded.parameters()).device_mesh.shape),
}
if rank == 0:
    result["state_dict_equal"] = sorted(full) == sorted(plain) and all(
        torch.allclose(full[k], plain[k], atol=1e-6) for k in plain
    )
(out_dir / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
