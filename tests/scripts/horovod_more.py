"""trainaccel.horovod process sets, join, gradients, sparse allreduce and re-init on real Gloo workers.

Each rank writes OUT_DIR/rank{r}.json with a list of failed checks (empty when all hold).
"""

import sys

import torch
from checks import Checks

import trainaccel.horovod as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = Checks()
check, raises = checks.check, checks.raises
close = torch.allclose

# Gradients, with Horovod's convention; every rank's upstream gradient differs (g_k = k + 1).
g = [torch.full((2, 3), float(k + 1)) for k in range(n)]
x = torch.ones(2, 3, requires_grad=True)
hvd.allreduce(x, op=hvd.Sum).backward(g[r])
check("allreduce Sum grad", close(x.grad, sum(g)))
x.grad = None
hvd.allreduce(x).backward(g[r])
check("allreduce Average grad", close(x.grad, sum(g) / n))
x = torch.ones(r + 1, 2, requires_grad=True)  # rank k sends k+1 rows
rows = sum(k + 1 for k in range(n))
upstream = [torch.arange(rows * 2.0).reshape(rows, 2) * (k + 1) for k in range(n)]
hvd.allgather(x).backward(upstream[r])
offset = sum(k + 1 for k in range(r))
check("allgather grad", close(x.grad, (sum(upstream) / n)[offset : offset + r + 1]))
x = torch.ones(3, requires_grad=True)
hvd.broadcast(x, root_rank=n - 1).backward(torch.full((3,), float(r + 1)))
check("broadcast grad", close(x.grad, torch.full((3,), sum(range(1, n + 1)) / n if r == n - 1 else 0.0)))
x = (torch.arange(n * 2.0).reshape(n, 2) + 10 * r).requires_grad_()
out, received = hvd.alltoall(x, splits=[1] * n)
(out * 2).sum().backward()
check("alltoall grad", close(x.grad, torch.full_like(x, 2.0)) and not received.requires_grad)
x = (torch.arange(n * 2.0).reshape(n, 2) * (r + 1)).requires_grad_()
hvd.reducescatter(x, op=hvd.Sum).backward(torch.full((1, 2), float(r + 1)))
check("reducescatter Sum grad", close(x.grad, torch.cat([torch.full((1, 2), float(k + 1)) for k in range(n)]) * n))
xs = [torch.ones(2, requires_grad=True), torch.ones(3, dtype=torch.float64, requires_grad=True)]
sum(t.sum() * (r + 1) for t in hvd.grouped_allreduce(xs, op=hvd.Sum)).backward()
check("grouped_allreduce grad", all(close(t.grad, torch.full_like(t, n * (n + 1) / 2)) for t in xs))

# The grouped allreduce fuses one buffer per dtype; a dtype layout that differs raises everywhere.
mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64 if r == 0 else torch.float32)]
raises("grouped dtypes", lambda: hvd.grouped_allreduce(mixed), RuntimeError, "differ across ranks")

# Sparse allreduce gathers indices and values: rank k touches rows k and k+1.
sparse = torch.sparse_coo_tensor([[r, r + 1], [0, 1]], [1.0, 2.0], (n + 1, 2), check_invariants=True)
dense = sum(
    torch.sparse_coo_tensor([[k, k + 1], [0, 1]], [1.0, 2.0], (n + 1, 2), check_invariants=True).to_dense()
    for k in range(n)
)
check("sparse_allreduce_async", close(hvd.sparse_allreduce_async(sparse, "s", hvd.Sum)().to_dense(), dense))

# Process sets: evens and odds, every rank registers both in the same order.
evens, odds = [k for k in range(n) if k % 2 == 0], [k for k in range(n) if k % 2 == 1]
even_set, odd_set = hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))
mine, other = (even_set, odd_set) if r % 2 == 0 else (odd_set, even_set)
members = mine.ranks
check(
    "set queries",
    mine.size() == len(members)
    and mine.rank() == members.index(r)
    and mine.included()
    and other.included() is False
    and other.rank() is None
    and hvd.global_process_set.size() == n,
)
t = torch.full((2,), float(r + 1))
check(
    "allreduce in a set",
    torch.equal(hvd.allreduce(t, op=hvd.Sum, process_set=mine), torch.full((2,), float(sum(k + 1 for k in members)))),
)
check("allgather in a set", hvd.allgather(t[:1], process_set=mine).tolist() == [float(k + 1) for k in members])
check("broadcast in a set", hvd.broadcast(t, members[-1], process_set=mine).tolist() == [float(members[-1] + 1)] * 2)
check(
    "alltoall in a set",
    hvd.alltoall(torch.full((len(members),), float(r)), process_set=mine).tolist() == [float(k) for k in members],
)
check(
    "reducescatter in a set",
    hvd.reducescatter(torch.ones(len(members), 2), op=hvd.Sum, process_set=mine).tolist()
    == [[float(len(members))] * 2],
)
check(
    "objects in a set",
    hvd.allgather_object(r, process_set=mine) == members
    and hvd.broadcast_object(r, members[0], process_set=mine) == members[0],
)
hvd.barrier(process_set=mine)
raises("foreign set", lambda: hvd.allreduce(t, process_set=other), ValueError, f"rank {r} is not in")
raises(
    "root outside the set",
    lambda: hvd.broadcast(t, other.ranks[0], process_set=mine),
    ValueError,
    "a rank of the process set",
)
raises("duplicate set", lambda: hvd.add_process_set(evens), ValueError, "already exists")
raises("bad ranks", lambda: hvd.add_process_set([0, n]), ValueError, f"distinct ranks from 0 to {n - 1}")
if len(members) > 1:
    raises(
        "mismatch in a set", lambda: hvd.allreduce(torch.ones(r + 1), process_set=mine), RuntimeError, "shapes differ"
    )

# DistributedOptimizer on the even set: evens average, odd ranks step on their own gradients.
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=even_set
)
model(torch.full((1, 3), float(r + 1))).sum().backward()
opt.step()
weights = hvd.allgather(model.weight.detach())
expected_grad = (
    torch.full((1, 3), sum(k + 1.0 for k in evens) / len(evens)) if r % 2 == 0 else torch.full((1, 3), r + 1.0)
)
check("optimizer on a set", close(model.weight.grad, expected_grad) and close(weights[evens[0]], weights[evens[-1]]))
check(
    "remove_process_set",
    hvd.remove_process_set(odd_set)
    and hvd.remove_process_set(even_set)
    and not hvd.remove_process_set(even_set)
    and not hvd.remove_process_set(hvd.global_process_set),
)
raises("removed set", lambda: hvd.allreduce(t, process_set=even_set), ValueError, "not registered")

# join: rank 0 runs out of data first; the others go on reducing, rank 0 contributes the identity.
if r == 0:
    last = hvd.join()
else:
    avg = hvd.allreduce(torch.full((2,), float(r)), name="after join")
    check("Average with a joined rank", close(avg, torch.full((2,), sum(range(1, n)) / n)))
    mx = hvd.allreduce(torch.full((2,), -5.0 - r), op=hvd.Max)
    check("Max with a joined rank", torch.equal(mx, torch.full((2,), -6.0)))
    i16 = hvd.allreduce(torch.full((2,), r, dtype=torch.int16), op=hvd.Sum)  # widened to int32 for Gloo
    check("int16 with a joined rank", i16.dtype == torch.int16 and i16.tolist() == [sum(range(1, n))] * 2)
    raises("allgather after join", lambda: hvd.allgather(torch.ones(1)), RuntimeError, "[0] have joined")
    last = hvd.join()
check("join returns the last to join", hvd.allgather_object(last) == [n - 1] * n)


# DistributedOptimizer with join: rank k has k+1 batches. Once a rank joins it adds zeros (the
# average still divides by size()); the last to join holds the trained model and broadcasts it.
def batch(k: int, step: int) -> torch.Tensor:
    return torch.full((2, 3), float(k + step))


torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
reference = torch.nn.Linear(3, 1)
reference.load_state_dict(model.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
for step in range(r + 1):
    opt.zero_grad()
    model(batch(r, step)).pow(2).sum().backward()
    opt.step()
last = hvd.join()
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
for step in range(n):
    ref_opt.zero_grad()
    sum(reference(batch(k, step)).pow(2).sum() for k in range(step, n)).div(n).backward()
    ref_opt.step()
check("optimizer with join", last == n - 1 and close(model.weight.detach(), reference.weight.detach(), atol=1e-6))


# trainaccel's sparsifying codecs in DistributedOptimizer: each rank sends its top 2 of 8, and
# what it did not send is added to its next gradient (error feedback).
coeffs = [torch.roll(torch.arange(1.0, 9.0), 3 * k) * (-1) ** k for k in range(n)]  # distinct magnitudes


def top2(t: torch.Tensor) -> torch.Tensor:
    kept = torch.zeros_like(t)
    idx = t.abs().topk(2).indices
    kept[idx] = t[idx]
    return kept


p8 = torch.nn.Parameter(torch.zeros(8))
opt = hvd.DistributedOptimizer(torch.optim.SGD([p8], lr=0.0), [("p8", p8)], compression=hvd.Compression.topk(0.25))
residuals = [torch.zeros(8) for _ in range(n)]
for step in range(2):
    opt.zero_grad()
    (p8 * coeffs[r]).sum().backward()
    opt.step()
    corrected = [c + res for c, res in zip(coeffs, residuals)]
    residuals = [c - top2(c) for c in corrected]
    check(f"topk step {step}", close(p8.grad, sum(top2(c) for c in corrected) / n))
# A step whose gradient is not finite on one rank (a GradScaler's overflow step, a loss spike): the
# bucket is reduced exactly, as a plain allreduce would, and the residuals are cleared, so no
# infinity is kept in a residual to be sent at later steps.
opt.zero_grad()
(p8 * (coeffs[r] * float("inf") if r == 0 else coeffs[r])).sum().backward()
opt.step()
check("topk non-finite step passed on exactly", bool(torch.isposinf(p8.grad).all()))
opt.zero_grad()
(p8 * coeffs[r]).sum().backward()
opt.step()
check("topk step after a non-finite one", close(p8.grad, sum(top2(c) for c in coeffs) / n))
raises(
    "topk in allreduce",
    lambda: hvd.allreduce(torch.ones(2), compression=hvd.Compression.topk()),
    ValueError,
    "pass it to DistributedOptimizer",
)
opt = hvd.DistributedOptimizer(torch.optim.SGD([p8], lr=0.0), [("p8", p8)], compression=hvd.Compression.bf16)
opt.zero_grad()
(p8 * coeffs[r]).sum().backward()
opt.step()
check("bf16 compression", close(p8.grad, sum(coeffs) / n) and p8.grad.dtype == torch.float32)

# shutdown and init again, with a process set registered at init.
hvd.shutdown()
hvd.init(process_sets=[hvd.ProcessSet(evens)])
check("re-init", hvd.size() == n and hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n)
raises("static process set", lambda: hvd.add_process_set(evens), ValueError, "already exists")

checks.write(sys.argv[1], r)
hvd.shutdown()
