"""Named asynchronous operations wait for the other workers, as under Horovod's coordinator."""

import pytest

from conftest import SCRIPTS, run_checks

pytestmark = pytest.mark.multiprocess

WORKER = r"""
import sys

import torch

sys.path.insert(0, sys.argv[2])  # tests/scripts: checks.py
from checks import Checks

import trainaccel.horovod as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = Checks()
check, raises = checks.check, checks.raises
total = float(sum(range(1, n + 1)))  # the sum of every rank's r + 1
rows = [(n + 1) // n + (1 if k < (n + 1) % n else 0) for k in range(n)]  # reducescatter's shares of n + 1 rows
starts = {
    "allreduce": (lambda name: hvd.allreduce_async(torch.full((n + 1, 2), r + 1.0), name=name, op=hvd.Sum),
                  torch.full((n + 1, 2), total)),
    "allgather": (lambda name: hvd.allgather_async(torch.full((r + 1, 2), float(r)), name=name),
                  torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])),
    "broadcast": (lambda name: hvd.broadcast_async(torch.full((3,), r + 1.0), root_rank=0, name=name),
                  torch.full((3,), 1.0)),
    "reducescatter": (lambda name: hvd.reducescatter_async(torch.full((n + 1, 2), r + 1.0), name=name, op=hvd.Sum),
                      torch.full((rows[r], 2), total)),
}

# Horovod's test_horovod_*_duplicate_name_error: rank 0 starts an operation named "dup" and a
# second one, which fails on rank 0 alone, while the others wait in a barrier; then the others.
for kind, (start, expected) in starts.items():
    name = f"{kind}.dup"
    if r == 0:
        first = start(name)
        check(f"{kind}: waits for the others", not hvd.poll(first))
        raises(f"{kind}: duplicate on rank 0", lambda: start(name), ValueError, "already in flight")
    hvd.barrier()
    if r > 0:
        first = start(name)
        raises(f"{kind}: duplicate on rank {r}", lambda: start(name), ValueError, "already in flight")
    hvd.barrier()
    check(f"{kind}: result", torch.equal(hvd.synchronize(first), expected))

# Named operations started in different orders are matched by name (their shapes differ, so
# matching them in call order would raise).
order = ["order.a", "order.b"] if r % 2 == 0 else ["order.b", "order.a"]
values = {"order.a": torch.full((2,), float(r)), "order.b": torch.full((3,), 10.0 * r)}
handles = {name: hvd.allreduce_async(values[name], name=name, op=hvd.Sum) for name in order}
check("by name: a", torch.equal(hvd.synchronize(handles["order.a"]), torch.full((2,), float(sum(range(n))))))
check("by name: b", torch.equal(hvd.synchronize(handles["order.b"]), torch.full((3,), 10.0 * sum(range(n)))))

# A parked operation that does not match the others' fails on its synchronize; the workers
# that called it last raise at once, and everyone stays in step.
if r == 0:
    bad = hvd.allreduce_async(torch.ones(2), name="bad")
    hvd.barrier()
    hvd.barrier()
    raises("parked mismatch, rank 0", lambda: hvd.synchronize(bad), RuntimeError, "tensor shapes differ")
else:
    hvd.barrier()
    raises("parked mismatch", lambda: hvd.allreduce_async(torch.ones(3), name="bad"), RuntimeError, "tensor shapes differ")
    hvd.barrier()

# One name for two different operations, and unnamed operations out of order, still raise on every rank.
clash = (lambda: hvd.allreduce_async(torch.ones(2), name="clash")) if r == 0 else (lambda: hvd.allgather_async(torch.ones(2), name="clash"))
raises("same name, different operations", clash, RuntimeError, "ranks called different operations")
unnamed = (lambda: hvd.allreduce_async(torch.ones(2))) if r == 0 else hvd.barrier
raises("unnamed, out of order", unnamed, RuntimeError, "ranks called different operations")

check("still in step", torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))))
checks.write(sys.argv[1], r)
hvd.shutdown()
"""


@pytest.mark.parametrize("workers", [2, 3])
def test_named_operations_wait_for_the_others(tmp_path, workers):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    run_checks(script, out, workers, SCRIPTS)
