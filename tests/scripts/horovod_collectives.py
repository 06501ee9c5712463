"""trainaccel.horovod collectives on real Gloo workers, checked against values every rank can compute.

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


check("size", n == int(sys.argv[2]))
check("topology", (hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank()) == (n, r, 1, 0))
check("homogeneous", hvd.is_homogeneous() is True)
check("builds", hvd.gloo_built() and not hvd.mpi_built() and not hvd.mpi_enabled())

values = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + k for k in range(n)]  # rank k's tensor
mine = values[r]
for dtype in (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64):
    stack = torch.stack([v.to(dtype) for v in values])
    expected = {
        hvd.Sum: stack.sum(0),
        hvd.Min: stack.min(0).values,
        hvd.Max: stack.max(0).values,
        hvd.Product: stack.prod(0),
        hvd.Average: stack.sum(0) / n if dtype.is_floating_point else stack.sum(0).div(n, rounding_mode="floor"),
    }
    for op, want in expected.items():
        got = hvd.allreduce(mine.to(dtype), op=op)
        check(
            f"allreduce {dtype} {op.name}",
            got.dtype == dtype and torch.allclose(got.double(), want.double(), rtol=1e-3),
        )
check("allreduce average=False is Sum", torch.equal(hvd.allreduce(mine, average=False), sum(values)))
scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
check("pre/postscale", torch.allclose(scaled, sum(values)))
fp16 = hvd.allreduce(mine, compression=hvd.Compression.fp16)
check("fp16 compression", fp16.dtype == torch.float32 and torch.allclose(fp16, sum(values) / n, rtol=1e-3))
inplace = mine.clone()
check("allreduce_ in place", hvd.allreduce_(inplace) is inplace and torch.allclose(inplace, sum(values) / n))
check("input untouched", torch.equal(mine, values[r]))
handle = hvd.allreduce_async(mine, name="async.sum", op=hvd.Sum)
raises("duplicate name", lambda: hvd.allreduce_async(mine, name="async.sum"), ValueError, "already in flight")
check("async", torch.equal(hvd.synchronize(handle), sum(values)) and hvd.poll(handle))

# Every async form returns a handle for poll/synchronize and refuses a second op of the same name.
for label, start in [
    ("allgather_async", lambda name: hvd.allgather_async(mine, name=name)),
    ("broadcast_async", lambda name: hvd.broadcast_async(mine, 0, name=name)),
    ("broadcast_async_", lambda name: hvd.broadcast_async_(mine.clone(), 0, name=name)),
    ("alltoall_async", lambda name: hvd.alltoall_async(torch.ones(n, 2), name=name)),
    ("reducescatter_async", lambda name: hvd.reducescatter_async(torch.ones(n, 2), name=name)),
    ("grouped_allgather_async", lambda name: hvd.grouped_allgather_async([mine], name=name)),
    ("grouped_reducescatter_async", lambda name: hvd.grouped_reducescatter_async([torch.ones(n)], name=name)),
    ("allreduce_async_", lambda name: hvd.allreduce_async_(mine.clone(), name=name)),
    ("grouped_allreduce_async_", lambda name: hvd.grouped_allreduce_async_([mine.clone()], name=name)),
]:
    handle = start(f"{label}.x")
    raises(
        f"{label} duplicate name", lambda start=start, label=label: start(f"{label}.x"), ValueError, "already in flight"
    )
    result = hvd.synchronize(handle)
    check(f"{label} result", result is not None and hvd.poll(handle))
    hvd.synchronize(start(f"{label}.x"))  # the name is free again

# allgather: rank k sends k+1 rows filled with k.
rows = torch.full((r + 1, 3), float(r))
gathered = hvd.allgather(rows)
check(
    "allgather uneven first dims",
    torch.equal(gathered, torch.cat([torch.full((k + 1, 3), float(k)) for k in range(n)])),
)
check("allgather fp16", hvd.allgather(rows.half()).dtype == torch.float16)

# alltoall: rank r sends k+1 rows (filled with 10*r + k) to rank k.
send = torch.cat([torch.full((k + 1, 2), float(10 * r + k)) for k in range(n)])
out, received = hvd.alltoall(send, splits=[k + 1 for k in range(n)])
check("alltoall splits", received.tolist() == [r + 1] * n)
check("alltoall data", torch.equal(out, torch.cat([torch.full((r + 1, 2), float(10 * k + r)) for k in range(n)])))
even = hvd.alltoall(torch.arange(float(n * 2)).reshape(n, 2) + 100 * r)
check(
    "alltoall even", torch.equal(even, torch.stack([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * k for k in range(n)]))
)
raises("alltoall bad splits", lambda: hvd.alltoall(send, splits=[1] * n), ValueError, "add up to the first dimension")

# reducescatter: rows split as evenly as possible, lower ranks first.
rows = 2 * n + 1
total = sum(torch.arange(float(rows * 2)).reshape(rows, 2) * (k + 1) for k in range(n))
share = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
start = sum(share[:r])
got = hvd.reducescatter(torch.arange(float(rows * 2)).reshape(rows, 2) * (r + 1), op=hvd.Sum)
check("reducescatter sum", torch.equal(got, total[start : start + share[r]]))
got = hvd.reducescatter(torch.arange(float(rows * 2)).reshape(rows, 2) * (r + 1))
check("reducescatter average", torch.allclose(got, total[start : start + share[r]] / n))

# grouped forms: one call, a list in, a list out, each element as its single-tensor op.
pair = [mine, mine * 2]
check(
    "grouped_allreduce",
    all(torch.allclose(g, sum(values) * f / n) for g, f in zip(hvd.grouped_allreduce(pair), (1, 2))),
)
inplace = [t.clone() for t in pair]
check(
    "grouped_allreduce_",
    hvd.grouped_allreduce_(inplace, op=hvd.Sum)[1] is inplace[1] and torch.allclose(inplace[1], sum(values) * 2),
)
h = hvd.grouped_allreduce_async(pair, name="group", op=hvd.Max)
got = hvd.synchronize(h)
check(
    "grouped_allreduce_async", hvd.poll(h) and torch.equal(got[0], values[-1]) and torch.equal(got[1], values[-1] * 2)
)
g = hvd.grouped_allgather([torch.full((r + 1,), float(r)), torch.full((1, 2), float(r))])
check("grouped_allgather", g[0].numel() == sum(k + 1 for k in range(n)) and g[1].shape == (n, 2))
rs = hvd.grouped_reducescatter([torch.ones(n, 2), torch.ones(2 * n)], op=hvd.Sum)
check(
    "grouped_reducescatter",
    torch.equal(rs[0], torch.full((1, 2), float(n))) and torch.equal(rs[1], torch.full((2,), float(n))),
)

root = n - 1
b = hvd.broadcast(mine, root_rank=root)
check("broadcast", torch.equal(b, values[root]) and torch.equal(mine, values[r]))
inplace = mine.clone()
hvd.broadcast_(inplace, root_rank=0)
check("broadcast_", torch.equal(inplace, values[0]))
check("broadcast_object", hvd.broadcast_object({"from": r}, root_rank=root) == {"from": root})
check("allgather_object", hvd.allgather_object(("rank", r)) == [("rank", k) for k in range(n)])
hvd.barrier()

# CPU float16 through every collective (Gloo moves and sums half precision).
half = values[r].half()
check("broadcast fp16", torch.equal(hvd.broadcast(half, root_rank=root), values[root].half()))
out16 = hvd.alltoall(torch.full((n, 2), float(r)).half())
check("alltoall fp16", out16.dtype == torch.float16 and out16[:, 0].tolist() == [float(k) for k in range(n)])
rs16 = hvd.reducescatter(torch.ones(n, 2).half(), op=hvd.Sum)
check("reducescatter fp16", rs16.dtype == torch.float16 and torch.equal(rs16, torch.full((1, 2), float(n)).half()))
gr16 = hvd.grouped_allreduce([half, half * 2], op=hvd.Sum)
check(
    "grouped_allreduce fp16",
    all(t.dtype == torch.float16 for t in gr16) and torch.allclose(gr16[1].float(), sum(values) * 2),
)
check("allgather_object fp16 tensor", hvd.allgather_object(half)[root].dtype == torch.float16)

# Mismatches raise the same error on every rank instead of hanging.
raises("shape mismatch", lambda: hvd.allreduce(torch.ones(r + 2)), RuntimeError, "tensor shapes differ across ranks")
raises(
    "dtype mismatch",
    lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64)),
    RuntimeError,
    "tensor dtypes differ across ranks",
)
raises(
    "allgather trailing dims",
    lambda: hvd.allgather(torch.ones(2, r + 1)),
    RuntimeError,
    "shapes (beyond the first dimension) differ",
)
raises("broadcast roots", lambda: hvd.broadcast(torch.ones(2), root_rank=r), RuntimeError, "root ranks differ")
raises(
    "op mismatch",
    lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max),
    RuntimeError,
    "reduction ops differ",
)
raises("adasum", lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum), ValueError, "Adasum is not supported")
check("still in step after errors", torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))))

checks.write(sys.argv[1], r)
hvd.shutdown()
