"""SyncBatchNorm: workers together normalize, differentiate and track statistics as one BatchNorm over all batches."""

import pytest
import torch
from torch import nn

from conftest import SCRIPTS, run, trainaccel_cmd
from trainaccel.horovod.sync_batch_norm import SyncBatchNorm

CASES = ["even_2d", "uneven_float32", "empty_rank", "no_running_stats"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch per worker count covers every case; the test for each case reads its records."""
    done = {}

    def get(workers: int) -> list[dict]:
        if workers not in done:
            out = tmp_path_factory.mktemp(f"sync_bn_{workers}")
            proc = run(
                [
                    *trainaccel_cmd(),
                    "run",
                    "--standalone",
                    "--nproc-per-node",
                    workers,
                    SCRIPTS / "horovod_sync_bn.py",
                    out,
                ]
            )
            done[workers] = (
                proc.stdout + proc.stderr
                if proc.returncode
                else [torch.load(out / f"rank{r}.pt") for r in range(workers)]
            )
        assert not isinstance(done[workers], str), done[workers]
        return done[workers]

    return get


def check_against_batch_norm(records: list[dict]) -> None:
    """Replay the records' batches, joined in rank order, through one torch BatchNorm and compare."""
    first = records[0]["steps"][0]["x"]
    tol = dict(atol=1e-4, rtol=1e-4) if first.dtype == torch.float32 else dict(atol=1e-5, rtol=1e-5)
    track = "running_mean" in records[0]
    ref = (nn.BatchNorm2d if first.dim() == 4 else nn.BatchNorm1d)(
        first.shape[1], momentum=records[0]["momentum"], track_running_stats=track
    ).to(first.dtype)
    with torch.no_grad():
        ref.weight.copy_(records[0]["weight"])
        ref.bias.copy_(records[0]["bias"])
    for step in range(len(records[0]["steps"])):
        steps = [rec["steps"][step] for rec in records]
        x = torch.cat([s["x"] for s in steps]).requires_grad_()
        ref.zero_grad()
        out = ref(x)
        (out * torch.cat([s["g"] for s in steps])).sum().backward()
        torch.testing.assert_close(torch.cat([s["out"] for s in steps]), out.detach(), **tol)
        torch.testing.assert_close(torch.cat([s["dx"] for s in steps]), x.grad, **tol)
        # Each rank holds its own batch's share of the parameter gradients; together they are the whole.
        torch.testing.assert_close(sum(s["dw"] for s in steps), ref.weight.grad, **tol)
        torch.testing.assert_close(sum(s["db"] for s in steps), ref.bias.grad, **tol)
    ref.eval()
    if track:
        for rec in records:
            torch.testing.assert_close(rec["running_mean"], ref.running_mean, **tol)
            torch.testing.assert_close(rec["running_var"], ref.running_var, **tol)
            assert rec["num_batches_tracked"] == ref.num_batches_tracked == len(rec["steps"])
            # Eval mode is plain BatchNorm with the running statistics: each rank on its own input.
            torch.testing.assert_close(rec["eval"]["out"], ref(rec["eval"]["x"]), **tol)
    else:  # without running statistics, eval mode still normalizes over the joined batch
        want = ref(torch.cat([rec["eval"]["x"] for rec in records]))
        torch.testing.assert_close(torch.cat([rec["eval"]["out"] for rec in records]), want, **tol)


@pytest.mark.multiprocess  # launched starts the workers
@pytest.mark.parametrize(  # 3 splits unevenly; 2 in CI added only time
    "workers, case", [pytest.param(2, c, marks=pytest.mark.comm_full) for c in CASES] + [(3, c) for c in CASES]
)
def test_workers_match_one_batch_norm_over_the_joined_batch(launched, workers, case):
    records = [ranks[case] for ranks in launched(workers)]
    if case == "empty_rank":
        assert records[1]["steps"][0]["x"].shape[0] == 0
    check_against_batch_norm(records)


@pytest.mark.multiprocess  # launched starts the workers
def test_process_sets_normalize_over_their_own_workers_only(launched):
    records = [ranks["process_sets"] for ranks in launched(3)]
    assert [rec["ranks"] for rec in records] == [[0, 1], [0, 1], [2]]
    check_against_batch_norm(records[:2])
    check_against_batch_norm(records[2:])


def test_bad_input_dimensions_are_refused():
    bn = SyncBatchNorm(3)
    for shape in [(3,), (2, 3, 1, 1, 1, 1)]:
        with pytest.raises(ValueError, match=rf"got {len(shape)}D input") as e:
            bn(torch.randn(shape))
        assert "2D to 5D" in str(e.value)
    with pytest.raises(ValueError, match="expected 3 channels"):
        bn(torch.randn(4, 2))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3))


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (2, 3, 4, 4), (2, 3, 2, 3, 3)])
def test_without_a_job_it_is_batch_norm(shape):
    ref = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    sync, ref = SyncBatchNorm(3, momentum=None).double(), ref(3, momentum=None).double()
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.float64).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        g = torch.randn(shape, dtype=torch.float64)
        (sync(x) * g).sum().backward()
        (ref(x2) * g).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
    for a, b in [
        (sync.weight.grad, ref.weight.grad),
        (sync.bias.grad, ref.bias.grad),
        (sync.running_mean, ref.running_mean),
        (sync.running_var, ref.running_var),
    ]:
        torch.testing.assert_close(a, b)
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(sync.eval()(x), ref.eval()(x))


def test_half_input_keeps_its_dtype_with_float32_statistics():
    x = torch.randn(16, 3, 4) * 2 + 30
    out = SyncBatchNorm(3)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), nn.BatchNorm1d(3)(x.to(torch.bfloat16).float()), atol=0.02, rtol=0.02)
