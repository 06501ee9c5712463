"""The communication thread's futures with a CUDA device: a consumer on another stream waits for the job's kernels."""

import contextlib

import pytest
import torch

from trainaccel.comm.scheduler import CommThread

pytestmark = pytest.mark.gpu


@pytest.fixture
def thread():
    thread = CommThread(name="trainaccel-comm-test")
    yield thread
    thread.stop()


def slow_job(a: torch.Tensor):
    """Kernels that keep the GPU busy for tens of milliseconds after the host has queued them and returned."""

    def job() -> torch.Tensor:
        x = a
        for _ in range(30):
            x = torch.tanh(x @ a)
        return x

    return job


def test_a_consumer_on_another_stream_sees_the_finished_result(thread, device, needs_cuda):
    a = torch.randn(4096, 4096, device=device, generator=torch.Generator(device=device).manual_seed(0)) / 64
    expected = slow_job(a)().sum()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    for _ in range(3):  # a race, if there were one, need not show the first time
        fut = thread.submit(slow_job(a), device)
        with torch.cuda.stream(side):
            seen = fut.wait().sum()  # queued on `side`: it must wait for the job's kernels on the thread's stream
        torch.cuda.synchronize()
        torch.testing.assert_close(seen, expected, rtol=1e-4, atol=1e-3)  # garbage, if read too early, is far off


def test_then_callbacks_and_errors_with_a_cuda_future(thread, device):
    a = torch.randn(512, 512, device=device) / 23
    doubled = thread.submit(slow_job(a), device).then(lambda f: f.value() * 2)
    side = torch.cuda.Stream() if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        result = doubled.wait().clone()
    if side is not None:
        torch.cuda.synchronize()
    torch.testing.assert_close(result, slow_job(a)() * 2, rtol=1e-4, atol=1e-4)
    assert result.device == device

    def fails() -> torch.Tensor:
        raise FloatingPointError("on the communication thread")

    with pytest.raises(FloatingPointError, match="on the communication thread"):
        thread.submit(fails, device).wait()
    # The thread goes on after a failed job.
    torch.testing.assert_close(thread.submit(lambda: a + 1, device).wait(), a + 1)
