"""DistributedOptimizer's options and broadcast_optimizer_state over every torch.optim optimizer.

Rank k's gradient for a parameter is a known tensor c_k, so each rank can compute the expected
reduced gradient itself. Each rank writes OUT_DIR/rank{r}.json with a list of failed checks.
"""

import sys

import torch
from checks import Checks

import trainaccel.horovod as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = Checks()
check, close = checks.check, torch.allclose
coeffs = [torch.arange(4.0) * (k + 1) - k for k in range(n)]  # rank k's gradient


def reduced_grads(**options) -> list[torch.Tensor]:
    """One step of a two-parameter model whose gradients are c_r and 2 c_r; returns the reduced .grad."""
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.0), [("a", a), ("b", b)], **options)
    opt.zero_grad()
    ((a + 2 * b) * coeffs[r]).sum().backward()
    opt.step()
    return [a.grad, b.grad]


mean, total = sum(coeffs) / n, sum(coeffs)
for label, options, want in [
    ("Average", {}, mean),
    ("Sum", {"op": hvd.Sum}, total),
    ("predivide", {"gradient_predivide_factor": 2.0}, mean),
    ("num_groups", {"num_groups": 2}, mean),
    ("fp16", {"compression": hvd.Compression.fp16}, mean),
]:
    a_grad, b_grad = reduced_grads(**options)
    check(f"optimizer {label}", close(a_grad, want, atol=1e-3) and close(b_grad, 2 * want, atol=1e-3))

# Explicit groups: each list of parameters is one bucket; parameters left out get their own.
a, b, c = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b, c], lr=0.0), [("a", a), ("b", b), ("c", c)], groups=[[a, c]])
((a + b + c) * coeffs[r]).sum().backward()
opt.step()
check("explicit groups", all(close(p.grad, mean) for p in (a, b, c)) and len(opt._buckets) == 2)

# Sparse gradients: rank k looks up rows k and k+1 of an embedding.
for as_dense in (False, True):
    emb = torch.nn.Embedding(n + 1, 2, sparse=True)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.0), emb.named_parameters(), sparse_as_dense=as_dense
    )
    emb(torch.tensor([r, r + 1])).sum().backward()
    opt.step()
    want = torch.zeros(n + 1, 2)
    for k in range(n):
        want[k] += 1.0 / n
        want[k + 1] += 1.0 / n
    check(f"sparse_as_dense={as_dense}", emb.weight.grad.is_sparse and close(emb.weight.grad.to_dense(), want))


def same(a, b) -> bool:
    """Equal state dicts: tensors equal elementwise, containers item by item."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# broadcast_optimizer_state: every torch.optim optimizer, state and hyperparameters from the root.
classes = sorted(
    (
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c not in (torch.optim.Optimizer, torch.optim.LBFGS, torch.optim.SparseAdam)
    ),
    key=lambda c: c.__name__,
)
for cls in classes:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 3))  # 2-D: every optimizer accepts it (Muon needs 2-D)
    optimizer = cls([weight], lr=0.01 * (r + 1))
    weight.grad = torch.full((3, 3), float(r + 1))
    optimizer.step()  # rank-dependent state
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    root = hvd.allgather_object(optimizer.state_dict())[0]
    check(
        f"broadcast_optimizer_state {cls.__name__}",
        same(optimizer.state_dict(), root) and optimizer.param_groups[0]["lr"] == 0.01,
    )
checks.info["optimizers"] = [c.__name__ for c in classes]

checks.write(sys.argv[1], r)
hvd.shutdown()
