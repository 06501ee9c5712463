"""DistributedOptimizer and the broadcasts: a Horovod-style script matches single-process training."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SCRIPTS, run, run_checks, trainaccel_cmd

pytestmark = pytest.mark.multiprocess


def reference(world: int, passes: int) -> list[torch.Tensor]:
    """One process, the same data: each step's batch is every rank's batches together."""
    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 10, generator=data), torch.randn(128, 1, generator=data)
    torch.manual_seed(1234)  # rank 0's initialization, which broadcast_parameters spreads
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # DistributedSampler without shuffle: pad to a multiple of world with the first indices, deal out.
    total = -(-128 // world) * world
    indices = list(range(128)) + list(range(total - 128))
    per_rank = [indices[r:total:world] for r in range(world)]
    batches = -(-len(per_rank[0]) // 8)  # DataLoader keeps the last, shorter batch
    for _ in range(2):
        for step in range(0, batches, passes):
            optimizer.zero_grad()
            for i in range(step, step + passes):
                # Horovod averages the ranks' mean losses' gradients: equal batch sizes per rank.
                for r in range(world):
                    idx = per_rank[r][i * 8 : (i + 1) * 8]
                    (F.mse_loss(model(x[idx]), y[idx]) / (passes * world)).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("workers, passes", [(3, 1), (2, 2)])  # 3 splits unevenly; (2, 1) added only time
def test_horovod_script_matches_single_process_training(tmp_path, workers, passes):
    out = tmp_path / "params.pt"
    proc = run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            workers,
            SCRIPTS / "horovod_train.py",
            out,
            passes,
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = torch.load(out)
    assert trained["size"] == workers
    for got, want in zip(trained["params"], reference(workers, passes)):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_bad_arguments_are_refused():
    code = """
import torch, trainaccel.horovod as hvd
from torch import nn
hvd.init()
m = nn.Linear(2, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for kwargs, message in [
    (dict(named_parameters=[("w", m.weight), ("w", m.bias)]), "must be unique; repeated: w"),
    (dict(named_parameters=[("w", m.weight)]), "1 optimizer parameter(s) are not in it"),
    (dict(backward_passes_per_step=0), "invalid backward_passes_per_step=0"),
    (dict(op=hvd.Adasum), "Adasum is not supported"),
]:
    try:
        hvd.DistributedOptimizer(opt, **kwargs)
    except ValueError as e:
        assert message in str(e), (message, str(e))
    else:
        raise SystemExit(f"no error for {kwargs}")
wrapped = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
assert isinstance(wrapped, torch.optim.SGD)
m(torch.ones(1, 2)).sum().backward()
wrapped.step()
"""
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("workers", [3])  # 3 splits unevenly; 2 added only time
def test_unused_parameters_synchronize_and_groups(tmp_path, workers):
    run_checks("horovod_unused.py", tmp_path, workers)


@pytest.mark.parametrize("workers", [3])  # 3 splits unevenly; 2 added only time
def test_optimizer_options_and_every_optimizer_state(tmp_path, workers):
    ranks = run_checks("horovod_optimizer_options.py", tmp_path, workers)
    assert {"Adam", "SGD", "RMSprop", "Adagrad"} <= set(ranks[0]["optimizers"])


def test_broadcast_optimizer_state_gives_a_fresh_optimizer_zero_gradients():
    # Horovod's observable side effect (its test_broadcast_state_no_grad), without its zero-gradient step.
    code = """
import copy
import torch, trainaccel.horovod as hvd
from torch import nn
hvd.init()
m = nn.Module()
m.frozen = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
m.w, m.b = nn.Parameter(torch.rand(4)), nn.Parameter(torch.rand(4))
m.b.grad = torch.full((4,), 7.0)
plain = copy.deepcopy(m)
before = [p.detach().clone() for p in m.parameters()]
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1),
                               named_parameters=m.named_parameters())
hvd.broadcast_optimizer_state(opt, root_rank=0)
assert m.frozen.grad is None
assert torch.equal(m.w.grad, torch.zeros(4))
assert torch.equal(m.b.grad, torch.full((4,), 7.0)), "a gradient already there is kept"
assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)), "no step: no weight decay applied"
assert opt.state_dict()["state"] == {}, "no state from a step with zero gradients"
# Training goes on exactly as with a fresh torch optimizer (dampening shows a momentum buffer made up early).
ref = torch.optim.SGD([plain.w, plain.b], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
for _ in range(2):
    for model, o in ((m, opt), (plain, ref)):
        o.zero_grad()
        (model.w * model.b).sum().backward()
        o.step()
assert torch.equal(m.w, plain.w) and torch.equal(m.b, plain.b)
# Sparse gradients must find sparse zeros to accumulate into.
emb = nn.Embedding(5, 2, sparse=True)
sparse_adam = torch.optim.SparseAdam(emb.parameters())
hvd.broadcast_optimizer_state(sparse_adam, root_rank=0)
assert emb.weight.grad.is_sparse
emb(torch.tensor([1, 2])).sum().backward()
sparse_adam.step()
model = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Linear(2, 1))
hvd.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), root_rank=0, model=model)
assert model[0].weight.grad.is_sparse and not model[1].weight.grad.is_sparse
# An optimizer with state keeps its gradients as they are.
opt.zero_grad()
hvd.broadcast_optimizer_state(opt, root_rank=0)
assert m.w.grad is None
"""
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sync_every_trains_diloco_with_no_gradient_exchange(tmp_path):
    ranks = run_checks("horovod_sync_every.py", tmp_path, 2)
    assert ranks[0]["grad"] != ranks[1]["grad"]
    assert ranks[0]["after_sync"] == ranks[1]["after_sync"]  # started equal though rank 1 changed its copy


# Rank 1 starts its backward late; rank 0's backward queues its buckets and returns at once.
NO_WAIT_IN_BACKWARD = """
import json, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
from torch import nn
import trainaccel.horovod as hvd

LATE = 2.0
hvd.init()
rank, size = hvd.rank(), hvd.size()
failures, info = [], {}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
start = [p.detach().clone() for p in model.parameters()]
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), num_groups=2
)
data = torch.Generator().manual_seed(1)
xs, ys = torch.randn(size, 4, 8, generator=data), torch.randn(size, 4, 1, generator=data)

# The reference: plain SGD on the gradients of every rank's loss, averaged by hand.
grads = [torch.zeros_like(p) for p in start]
for r in range(size):
    copy = [p.clone().requires_grad_() for p in start]
    hidden = torch.tanh(F.linear(xs[r], copy[0], copy[1]))
    F.mse_loss(F.linear(hidden, copy[2], copy[3]), ys[r]).backward()
    for g, p in zip(grads, copy):
        g += p.grad / size
want = [p - 0.1 * g for p, g in zip(start, grads)]

hvd.barrier()
if rank == 1:
    time.sleep(LATE)
loss = F.mse_loss(model(xs[rank]), ys[rank])
began = time.perf_counter()
loss.backward()
info["backward_s"] = time.perf_counter() - began
# A collective called while buckets are in flight comes after them on every rank.
if hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item() != size * (size + 1) / 2:
    failures.append("allreduce between backward and step")
opt.step()
for i, (p, w) in enumerate(zip(model.parameters(), want)):
    if not torch.allclose(p, w, atol=1e-6):
        failures.append(f"parameter {i} off the reference by {(p - w).abs().max().item()}")

# An error of a bucket's negotiation comes from step(), on every rank, and the ranks stay in step.
wide = nn.Linear(4, 2 + rank, bias=False)
opt = hvd.DistributedOptimizer(torch.optim.SGD(wide.parameters(), lr=0.1), named_parameters=wide.named_parameters())
info["raised_in"] = "backward"
try:
    wide(torch.ones(1, 4)).sum().backward()
    info["raised_in"] = "step"
    opt.step()
except RuntimeError as e:
    info["error"] = str(e)
else:
    info["raised_in"] = None
if hvd.allreduce(torch.ones(1), op=hvd.Sum).item() != size:
    failures.append("allreduce after the error")
hvd.shutdown()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"failures": failures, **info}))
"""


def test_backward_does_not_wait_for_the_other_ranks(tmp_path):
    script = tmp_path / "no_wait_in_backward.py"
    script.write_text(NO_WAIT_IN_BACKWARD)
    ranks = run_checks(script, tmp_path, 2)
    # Rank 1 started its backward 2 s late: rank 0's backward did not wait for it (a generous margin).
    assert ranks[0]["backward_s"] < 1.0, ranks[0]["backward_s"]
    assert [r["raised_in"] for r in ranks] == ["step", "step"]
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"] == "allreduce: tensor shapes differ across ranks (rank 0 (8,), rank 1 (12,))"


@pytest.mark.parametrize("scale", ["dynamic", "peak", 8.0])
def test_an_fp16_scale_the_horovod_optimizer_cannot_apply_is_refused(monkeypatch, scale):
    from trainaccel.config import Config
    from trainaccel.horovod import optimizer

    monkeypatch.setattr(optimizer, "current_config", lambda: Config.resolve(compression="fp16", fp16_scale=scale))
    with pytest.raises(ValueError, match=f"fp16_scale={scale} scales the fp16 of trainaccel's DDP hook"):
        optimizer._launch_options(optimizer.Compression.none, None)
    monkeypatch.setattr(optimizer, "current_config", lambda: Config.resolve(compression="fp16"))
    assert optimizer._launch_options(optimizer.Compression.none, None) == (optimizer.Compression.fp16, None)


RESPONSE_CACHE = """
import json, sys
from pathlib import Path
import torch
from torch import nn
import trainaccel.horovod as hvd
from trainaccel.horovod import negotiation

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
rounds = []
for step in range(6):
    opt.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    rounds.append([negotiation.exchanges(0), negotiation.cache_hits(0)])
for _ in range(2):  # kept once agreed
    hvd.allreduce(torch.ones(3), name="metric")
try:  # the same name, another shape on rank 1: not the kept one, so the descriptors are gathered and compared
    hvd.allreduce(torch.ones(3 + rank), name="metric")
    error = None
except RuntimeError as e:
    error = str(e)
params = [p.detach().flatten().tolist() for p in model.parameters()]
hvd.shutdown()
Path(sys.argv[1], f"rank{rank}.json").write_text(
    json.dumps({"failures": [], "rounds": rounds, "error": error, "params": params})
)
"""


def test_descriptors_agreed_once_are_kept_and_later_exchanges_send_a_number(tmp_path):
    """Horovod's response cache: from the second step on, each bucket's exchange is one all-reduce of 16 bytes,
    not every worker's descriptor; a call that differs from the kept one is still compared and refused alike."""
    script = tmp_path / "response_cache.py"
    script.write_text(RESPONSE_CACHE)
    ranks = run_checks(script, tmp_path, 3)
    for r in ranks:
        (first_rounds, first_hits), *later = r["rounds"]
        assert first_hits == 0 and first_rounds > 0
        rounds, hits = later[-1]
        assert hits > 0 and rounds - first_rounds == hits, r["rounds"]  # every later exchange settled by its number
        assert (
            r["error"]
            == "allreduce 'metric': tensor shapes differ across ranks (rank 0 (3,), rank 1 (4,), rank 2 (5,))"
        )
    assert ranks[0]["params"] == ranks[1]["params"] == ranks[2]["params"]
