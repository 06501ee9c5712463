"""Timing that means the transfer on a GPU: an exchange delayed on the communication stream is timed with the delay.

A known delay (`torch.cuda._sleep`) queued on the stream that carries the exchange returns to the host at once: the
host's clock around it would read about 0 s. The marks auto, autotune and the straggler wait take must include it.
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


def test_an_exchange_on_the_communication_stream_is_timed_with_its_delay(thread, device, needs_cuda):
    """As auto times each sync's exchange (`_Auto.timed`): marks on the job's stream, around work the host queues."""
    cycles = _cycles(device, DELAY_S)
    spans = []

    def exchange() -> torch.Tensor:  # a transfer the host only queues, as NCCL's is
        start = clock.mark(device)
        torch.cuda._sleep(cycles)
        spans.append((start, clock.mark(device)))
        return torch.ones(1, device=device)

    host = time.perf_counter()
    thread.submit(exchange, device).wait()
    host = time.perf_counter() - host
    assert host < DELAY_S / 2, f"the host waited {host:.3f} s: the stand-in transfer was not queued"
    assert clock.seconds(*spans[0], wait=True) >= 0.8 * DELAY_S


def test_a_span_still_running_on_the_device_is_read_later(device, needs_cuda):
    cycles = _cycles(device, DELAY_S)
    start = clock.mark(device)
    torch.cuda._sleep(cycles)
    end = clock.mark(device)
    assert clock.seconds(start, end) is None  # not passed yet: read later, never waited for
    assert clock.seconds(start, end, wait=True) >= 0.8 * DELAY_S
