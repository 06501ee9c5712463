"""sync_every=auto's noise gauge: the replicas' spread and the mean change's square from one replica's sampled change."""

import json
import textwrap

import pytest
import torch

from conftest import run, trainaccel_cmd
from trainaccel.comm.outer_sync import noise_figures


def _replicas(n: int, elements: int, signal: float, noise: float, seed: int = 0) -> torch.Tensor:
    """`n` replicas' changes: a shared direction of squared norm `signal` plus each one's own noise of `noise` in all."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(elements, generator=gen)
    shared *= (signal / shared.dot(shared)) ** 0.5
    own = torch.randn(n, elements, generator=gen) * (noise / elements) ** 0.5
    return shared + own


def test_two_replicas_give_the_exact_formula():
    mine, theirs = torch.tensor([3.0, 1.0, 2.0]), torch.tensor([1.0, -1.0, 2.0])
    mean = (mine + theirs) / 2
    spread, signal = noise_figures(mine, 1, 2, mean).tolist()
    a, b = mine.dot(mine).item(), mine.dot(mean).item()  # |mine|^2 = 14, mine . mean = 10
    assert spread == pytest.approx((a - b) * 2) == pytest.approx(8.0)
    assert signal == pytest.approx(b - (a - b)) == pytest.approx(6.0)


@pytest.mark.parametrize("replicas", [2, 4, 16])
@pytest.mark.parametrize("noise_to_signal", [0.1, 1.0, 10.0])
def test_each_replica_estimates_the_spread_and_signal(replicas, noise_to_signal):
    changes = _replicas(replicas, 2**16, 1.0, noise_to_signal)
    mean = changes.mean(0)
    figures = torch.stack([noise_figures(c, 1, replicas, mean) for c in changes]).mean(0)
    spread, signal = figures.tolist()
    assert spread == pytest.approx(noise_to_signal, rel=0.05)
    assert signal == pytest.approx(1.0, rel=0.05 + 0.05 * noise_to_signal / replicas)


def test_a_sample_of_every_kth_element_estimates_the_same_ratio():
    changes = _replicas(4, 2**18, 1.0, 3.0)
    mean = changes.mean(0)
    whole = torch.stack([noise_figures(c, 1, 4, mean) for c in changes]).sum(0)
    stride = 16
    sampled = torch.stack([noise_figures(c[::stride], stride, 4, mean) for c in changes]).sum(0)
    assert (sampled[0] / sampled[1]).item() == pytest.approx((whole[0] / whole[1]).item(), rel=0.1)


def test_the_codecs_error_in_the_mean_does_not_count_as_spread():
    changes = _replicas(2, 2**16, 1.0, 1.0)
    mean = changes.mean(0)
    lossy = mean + torch.randn(mean.shape, generator=torch.Generator().manual_seed(7)) * (2.0 / mean.numel()) ** 0.5
    exact = torch.stack([noise_figures(c, 1, 2, mean) for c in changes]).sum(0)
    coded = torch.stack([noise_figures(c, 1, 2, lossy) for c in changes]).sum(0)
    assert coded.tolist() == pytest.approx(exact.tolist(), rel=0.1)


def test_one_replica_has_no_spread():
    assert noise_figures(torch.ones(4), 1, 1, torch.ones(4)).tolist() == [0.0, 0.0]


GAUGED = """
import json
import sys
import time

import torch
import torch.distributed as dist

from trainaccel.comm import DiLoCo

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(2, 1, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
diloco = DiLoCo(model, optimizer, sync_every="auto")
for step in range(1, 41):
    time.sleep(0.01)  # a step the 2-element sync fits in: full precision
    # Every step the same: a shared direction (1, 0) and this rank's own (0, +-0.5), whatever H auto picks.
    model.weight.grad = torch.tensor([[1.0, 0.5 if rank == 0 else -0.5]])
    optimizer.step()
    if step == 30:
        saved = diloco.state_dict()
auto = diloco.outer._auto
resumed = DiLoCo(model, optimizer, sync_every="auto")
resumed.load_state_dict(saved)
result = {
    "codec": diloco.outer._codec.name,
    "gauged": auto.gauged,
    "ratio": auto.noise_ratio(),
    "saved": saved["auto"]["gauged"],
    "resumed": [list(r) for r in resumed.outer._auto.gauged],
}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_the_gauge_reads_every_ranks_spread_alike_and_a_checkpoint_keeps_it(tmp_path):
    """Two replicas whose change per step is (1, 0) +- (0, 0.5): a replica's spread about the mean is 0.25 a step
    squared, its unbiased estimate from 2 replicas 2 x 0.25 on each rank, the mean's square 1 - 0.25: the ratio 2/3."""
    script = tmp_path / "gauged.py"
    script.write_text(textwrap.dedent(GAUGED))
    proc = run([*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, script, tmp_path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["codec"] == "none"
    assert first["gauged"] and first["gauged"] == second["gauged"]  # summed over the ranks: the same on each
    for interval, spread, signal in first["gauged"]:
        steps = interval  # each round: one sync of the last H steps' change
        # (float32 changes: the parameters' rounding as they move)
        assert spread == pytest.approx(2 * 2 * 0.25 * steps**2, rel=1e-4)
        assert signal == pytest.approx(2 * 0.75 * steps**2, rel=1e-4)
    assert first["ratio"] == pytest.approx(2 / 3, rel=1e-4)
    assert first["saved"] and first["saved"] == first["resumed"]
