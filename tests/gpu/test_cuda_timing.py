"""Timing that means the transfer on a GPU: an exchange delayed on the communication stream is timed with the delay.

A known delay (`torch.cuda._sleep`) queued on the stream that carries the exchange returns to the host at once: the
host's clock around it would read about 0 s. auto's timed exchange must include it, as must the straggler wait.
"""

import time

import pytest
import torch

from trainaccel.comm import clock
from trainaccel.comm.scheduler import CommThread

pytestmark = pytest.mark.gpu

DELAY_S = 0.2


@pytest.fixture
def thread():
    thread = CommThread(name="trainaccel-comm-timing")
    yield thread
    thread.stop()


def _cycles(device: torch.device, seconds: float) -> int:
    """GPU clock cycles that take about `seconds` (measured: clock rates differ between GPUs)."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds / (start.elapsed_time(end) / 1000))


def test_auto_times_an_exchange_by_the_stream_that_carries_it(thread, device, needs_cuda):
    from trainaccel.comm.outer_sync import _Auto
    from trainaccel.config import Config

    cycles = _cycles(device, DELAY_S)
    auto = _Auto(Config(sync_every="auto"), 1000)

    def exchange() -> torch.Tensor:  # a transfer the host only queues, as NCCL's is
        torch.cuda._sleep(cycles)
        return torch.ones(1, device=device)

    host = time.perf_counter()
    thread.submit(auto.timed(exchange, device), device).wait()
    host = time.perf_counter() - host
    assert host < DELAY_S / 2, f"the host waited {host:.3f} s: the stand-in transfer was not queued"
    assert auto.take_exchanged(wait=True) >= 0.8 * DELAY_S


def test_a_span_still_running_on_the_device_is_read_later(device, needs_cuda):
    cycles = _cycles(device, DELAY_S)
    start = clock.mark(device)
    torch.cuda._sleep(cycles)
    end = clock.mark(device)
    assert clock.seconds(start, end) is None  # not passed yet: read later, never waited for
    assert clock.seconds(start, end, wait=True) >= 0.8 * DELAY_S
