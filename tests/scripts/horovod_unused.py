"""DistributedOptimizer corner cases on real workers: a parameter unused on some ranks, explicit
synchronize() with skip_synchronize() (and the warning without it), and num_groups. Each rank writes
OUT_DIR/rank{r}.json."""

import json
import sys
import warnings

import torch
from torch import nn

import trainaccel.horovod as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 1, bias=False), nn.Linear(4, 1, bias=False)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


for num_groups in (0, 2):
    torch.manual_seed(0)
    model = TwoBranches()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(), num_groups=num_groups
    )
    x = torch.full((1, 4), float(r + 1))
    model(x, use_b=(r == 0)).sum().backward()  # b is used on rank 0 only
    opt.synchronize()
    want_a = torch.full((1, 4), sum(k + 1 for k in range(n)) / n)
    want_b = torch.full((1, 4), 1.0 / n)  # rank 0's gradient, the others count as zero
    if not torch.allclose(model.a.weight.grad, want_a):
        failures.append(f"a grad groups={num_groups}: {model.a.weight.grad}")
    if model.b.weight.grad is None or not torch.allclose(model.b.weight.grad, want_b):
        failures.append(f"b grad groups={num_groups}: {model.b.weight.grad}")
    before = model.a.weight.detach().clone()
    with opt.skip_synchronize():
        opt.step()
    if not torch.allclose(model.a.weight, before - want_a):
        failures.append(f"step after synchronize groups={num_groups}")
    opt.zero_grad()

# Without skip_synchronize(), step() after synchronize() warns once, in Horovod's words (its tests match them).
model(x, use_b=True).sum().backward()
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
messages = [str(w.message) for w in caught]
if len(messages) != 1 or "optimizer.step() called without optimizer.skip_synchronize() context" not in messages[0]:
    failures.append(f"step after synchronize without skip_synchronize warned {messages}")

with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
    json.dump({"failures": failures}, f)
