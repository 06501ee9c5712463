"""hvd.elastic: a job that torchrun restarts resumes from its last commit, on as many workers or more."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SCRIPTS, run, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

N = 80  # samples in the script's dataset


def launch(out: Path, tag: str, workers: int, *flags, script_args=(), env=None):
    return run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            workers,
            *flags,
            SCRIPTS / "horovod_elastic.py",
            out,
            tag,
            *script_args,
        ],
        env=env,
    )


def incarnation(out: Path, tag: str, restart: int) -> list[list[dict]]:
    """Each rank's events in one incarnation of the job, in rank order."""
    files = sorted(out.glob(f"{tag}-{restart}-rank*.jsonl"), key=lambda f: int(f.stem.rsplit("rank", 1)[1]))
    assert files, f"no events for {tag} restart {restart}"
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def start(ranks: list[list[dict]]) -> tuple[int, int, int]:
    """(epoch, step, size) at which every rank of an incarnation began training."""
    starts = {(e["epoch"], e["step"], e["size"]) for events in ranks for e in events if e["event"] == "start"}
    assert len(starts) == 1, starts
    return starts.pop()


def processed(incarnations: list[list[list[dict]]]) -> dict[int, Counter]:
    """How often each index was trained on, per epoch, counting only batches a later incarnation kept."""
    counts: dict[int, Counter] = {}
    for k, ranks in enumerate(incarnations):
        # A batch counts if its commit was reached: the next incarnation starts at or after its step.
        limit = start(incarnations[k + 1])[1] if k + 1 < len(incarnations) else float("inf")
        for events in ranks:
            for e in events:
                if e["event"] == "batch" and e["step"] <= limit:
                    counts.setdefault(e["epoch"], Counter()).update(e["indices"])
    return counts


def resets(ranks: list[list[dict]]) -> list[int]:
    return [e["size"] for events in ranks for e in events if e["event"] == "reset"]


def uninterrupted(workers: int = 2, epochs: int = 2) -> list[torch.Tensor]:
    """The script's job without a failure, in one process: each step averages every rank's batch gradients."""
    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 10, generator=data), torch.randn(N, 1, generator=data)
    torch.manual_seed(1234)  # rank 0's initialization, which the first sync spreads
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        # ElasticSampler: the epoch shuffled from seed 7 + epoch, dealt out round robin; batches of 4.
        order = torch.randperm(N, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        shares = [order[r::workers] for r in range(workers)]
        for i in range(0, len(shares[0]), 4):
            grads = []
            for share in shares:
                model.zero_grad()
                F.mse_loss(model(x[share[i : i + 4]]), y[share[i : i + 4]]).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *each in zip(model.parameters(), *grads):
                p.grad = sum(each) / workers
            optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_restart_resumes_from_the_last_commit(tmp_path):
    failed = launch(tmp_path, "crash", 2, "--max-restarts", 1, script_args=["--crash-step", 5])
    output = failed.stdout + failed.stderr
    assert failed.returncode == 0, output
    assert "hvd.elastic: resumed from commit 5 (world size 2 -> 2" in output, output
    runs = [incarnation(tmp_path, "crash", 0), incarnation(tmp_path, "crash", 1)]
    assert [start(r) for r in runs] == [(0, 0, 2), (0, 5, 2)]
    everything = Counter(range(N))
    assert processed(runs) == {0: everything, 1: everything}
    assert resets(runs[1]) == []  # same world size: no reset callbacks
    # Model, momentum and sample order all came back: the result is the uninterrupted job's.
    for got, want in zip(torch.load(tmp_path / "crash-params.pt"), uninterrupted()):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.comm_full  # a sibling of the restart's resume from the last commit
def test_failure_without_restarts_then_resume_on_more_workers(tmp_path):
    state = tmp_path / "state"
    env = {"TRAINACCEL_ELASTIC_DIR": str(state)}
    # No --max-restarts (torchrun's default is 0): the failure ends the job, the commit stays on disk.
    first = launch(
        tmp_path, "two", 2, script_args=["--crash-step", 4, "--epochs", 1, "--crash-kind", "internal"], env=env
    )
    output = first.stdout + first.stderr
    assert first.returncode != 0, output
    lines = [line for line in output.splitlines() if "hvd.elastic: HorovodInternalError: injected failure" in line]
    assert lines, output
    assert "no restarts left (--max-restarts 0), so the job ends at commit 4" in lines[0]
    assert f"a relaunch with TRAINACCEL_ELASTIC_DIR={state} resumes from it" in lines[0]
    assert sorted(f.name.rsplit("-", 1)[1] for f in state.glob("*.pt")) == ["local0.pt", "local1.pt"]

    second = launch(tmp_path, "three", 3, script_args=["--epochs", 1], env=env)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert "hvd.elastic: resumed from commit 4 (world size 2 -> 3" in output, output
    runs = [incarnation(tmp_path, "two", 0), incarnation(tmp_path, "three", 0)]
    assert start(runs[1]) == (0, 4, 3)
    assert resets(runs[1]) == [3, 3, 3]  # the callback ran on every worker, after the change 2 -> 3
    assert processed(runs) == {0: Counter(range(N))}
    assert list(state.glob("*.pt")) == []  # a finished job removes its commit files


SAMPLER_CHECKS = """
import torch, trainaccel.horovod as hvd
from trainaccel.horovod import elastic
hvd.init()

def refused(call, error, text):
    try:
        call()
    except error as e:
        assert text in str(e), (text, str(e))
    else:
        raise SystemExit(f"no {error.__name__} for {text}")

data = list(range(10))
s = elastic.ElasticSampler(data, shuffle=False)
assert list(s) == data and len(s) == 10
s.record_batch(0, 4)
s.record_indices([9])
assert s.processed_indices == {0, 1, 2, 3, 9}
s.reset()
assert list(s) == [4, 5, 6, 7, 8] and len(s) == 5
saved = s.state_dict()
assert saved == {"epoch": 0, "processed_indices": {0, 1, 2, 3, 9}}, saved
t = elastic.ElasticSampler(data, shuffle=False)
t.load_state_dict(saved)
assert list(t) == [4, 5, 6, 7, 8]
t.set_epoch(1)
assert list(t) == data and t.processed_indices == set() and t.epoch == 1

a, b = elastic.ElasticSampler(data, seed=3), elastic.ElasticSampler(data, seed=3)
order = list(a)
assert order == list(b) and sorted(order) == data and order != data
a.record_batch(1, 3)  # the second batch of three
a.reset()
assert list(a) == order[:3] + order[6:]  # what is left keeps the epoch's order
b.set_epoch(1)
assert list(b) != order

refused(lambda: elastic.ElasticSampler(data, seed="1"), TypeError, "invalid seed='1' (str)")
refused(lambda: elastic.ElasticSampler(data, shuffle=1), TypeError, "invalid shuffle=1")
refused(lambda: elastic.ElasticSampler(5), TypeError, "needs a dataset with a length, got int")
refused(lambda: t.set_epoch(1.5), TypeError, "invalid epoch=1.5")
refused(lambda: t.load_state_dict({"epoch": 0}), KeyError, "lacks ['processed_indices']")

@elastic.run
def train(state):
    return state.epoch

refused(lambda: train(5), TypeError, "the first argument of train must be an hvd.elastic State")
refused(lambda: elastic.run(42), TypeError, "decorates a function, got 42")
refused(lambda: elastic.run(lambda: None), TypeError, "must take the state as its first positional argument")
refused(lambda: elastic.ObjectState(commit=1), ValueError, "invalid state attribute name(s) ['commit']")
refused(lambda: elastic.ObjectState(_x=1), ValueError, "['_x']")
refused(lambda: elastic.ObjectState().register_reset_callbacks([1]), TypeError, "reset callback 1 is not callable")
assert train(elastic.ObjectState(epoch=7)) == 7

# restore() goes back to the last commit, in this process.
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def step():
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
step()
state = elastic.TorchState(model=model, optimizer=opt, sampler=s, epoch=0, history=[1])
state.commit()
weight, momentum = model.weight.clone(), opt.state[model.weight]["momentum_buffer"].clone()
for _ in range(2):
    step()
    state.epoch += 1
    state.history.append(2)
    s.record_indices([4])
    state.restore()
    assert torch.equal(model.weight, weight)
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    assert state.epoch == 0 and state.history == [1] and 4 not in s.processed_indices
print("ok")
"""


def test_sampler_and_state_in_one_process(tmp_path):
    proc = run([sys.executable, "-c", SAMPLER_CHECKS], env={"TRAINACCEL_ELASTIC_DIR": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert len(list(tmp_path.glob("*-local0.pt"))) == 1  # the commit outside run() was written too


RESUME = """
import sys, fractions, trainaccel.horovod as hvd
from trainaccel.horovod import elastic
from trainaccel.horovod.exceptions import HorovodInternalError
hvd.init()
state = elastic.ObjectState(step=0, share=fractions.Fraction(1, 3))  # not loadable with weights_only

@elastic.run
def train(state):
    print("start", state.step, flush=True)
    for _ in range(3):
        state.step += 1
        state.commit()
    if sys.argv[1] == "fail":
        raise HorovodInternalError("lost a peer")

train(state)
"""


def test_commits_outlive_the_process(tmp_path):
    env = {"TRAINACCEL_ELASTIC_DIR": str(tmp_path)}
    failed = run([sys.executable, "-c", RESUME, "fail"], env=env)
    assert failed.returncode != 0 and "start 0" in failed.stdout
    assert "nothing restarts this worker outside torchrun, so the job ends at commit 3" in failed.stderr, failed.stderr
    assert len(list(tmp_path.glob("*.pt"))) == 1
    done = run([sys.executable, "-c", RESUME, "ok"], env=env)
    assert done.returncode == 0 and "start 3" in done.stdout, done.stdout + done.stderr
    assert list(tmp_path.glob("*.pt")) == []
