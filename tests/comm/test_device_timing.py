"""Timing that means the transfer: auto, autotune and the straggler wait read the device's clock, not the host's.

On a GPU a collective returns once queued (NCCL, and every job of the engine's thread on its stream), so the host's
clock around it reads about 0 s: auto would pick full precision and a sync every step. Here a stand-in device clock
(`trainaccel.comm.clock`) says each span took a known time while the host's says almost none, and each figure must
be the device's. tests/gpu/test_cuda_timing.py does the same with a delay on a real CUDA stream.
"""

import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import clock

DEVICE_S = 0.75  # what the stand-in device clock says every span took


@pytest.fixture
def device_clock(monkeypatch):
    """A stand-in for a GPU's events: marks are tokens, and every span between two of them took DEVICE_S."""
    spans = []

    def seconds(start, end, wait=False):
        spans.append((start, end))
        return DEVICE_S

    monkeypatch.setattr(clock, "mark", lambda device: object())
    monkeypatch.setattr(clock, "seconds", seconds)
    return spans


@pytest.mark.usefixtures("one_process_group")
def test_auto_chooses_from_the_exchanges_device_time(device_clock):
    trainaccel.init(sync_every="auto", start_process_group=False)
    try:
        model = DDP(torch.nn.Linear(4, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(12):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        why = model.trainaccel.diloco.outer._auto.setting.why
        sync_s = float(re.search(r"a full-precision sync ([0-9.]+) s", why).group(1))
        assert sync_s == pytest.approx(DEVICE_S), why  # the host's clock would say a few milliseconds
        assert device_clock  # read through the clock
    finally:
        trainaccel.shutdown()


def test_the_straggler_wait_is_the_device_time_between_its_marks(device_clock):
    from trainaccel.comm.hooks import CommWait

    wait = CommWait()
    wait.mark_ready(torch.device("cpu"))
    fut = torch.futures.Future()
    fut.set_result(torch.zeros(1))
    wait.mark_done(fut)
    assert wait.take() == DEVICE_S


def test_a_span_the_device_has_not_passed_is_left_for_later():
    class Pending:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return 2500.0

    assert clock.seconds(Pending(True), Pending(False)) is None  # never waits unless asked
    assert clock.seconds(Pending(True), Pending(True)) == 2.5
    assert clock.seconds(1.0, 1.5) == 0.5 and clock.seconds(2.0, 1.0) == 0.0


@pytest.mark.usefixtures("one_process_group")
def test_autotune_chooses_by_the_device_time_of_its_steps(monkeypatch):
    """The host's clock says the second candidate is slower (a pause in its steps), the device's that it is faster."""
    import time

    from trainaccel.comm.ddp import register

    model = DDP(torch.nn.Linear(4, 4))
    tuner = register(model, autotune="on", compression="fp16")
    assert [c.label for c in tuner.candidates] == ["fp16", "none"]
    device_s = {"fp16": 1.0, "none": 0.25}
    monkeypatch.setattr(clock, "mark", lambda device: tuner.current.label)
    monkeypatch.setattr(clock, "seconds", lambda start, end, wait=False: device_s[start])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        if tuner.chosen is None and tuner.current.label == "none":
            time.sleep(0.02)
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert tuner.chosen is not None and tuner.chosen.label == "none"
