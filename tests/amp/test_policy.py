"""PrecisionPolicy's decisions, table by table, over a synthetic run; the integer-policy class; resuming."""

import json
import math

import pytest
import torch

from trainaccel.amp import MixedPrecision_TrainingPolicy, PrecisionPolicy, parse_policy

T, F = True, False
NAN = math.nan


def decide(policy, per="epoch", **series):
    """Call the policy once per unit, with the n-th value of each series."""
    length = len(next(iter(series.values())))
    return [policy.enabled(**{per: t}, **{k: v[t] for k, v in series.items()}) for t in range(length)]


class OverflowingScaler:
    """A real GradScaler on CPU; `step(overflow)` runs one optimizer step, with inf gradients when asked."""

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1)

    def step(self, overflow: bool) -> None:
        self.optimizer.zero_grad()
        self.scaler.scale((self.weight * 2).sum()).backward()
        if overflow:
            self.weight.grad.fill_(math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()


@pytest.mark.parametrize(
    "start, end, expected",
    [
        (2, 5, [F, F, T, T, T, T, F, F]),
        (2, None, [F, F, T, T, T, T, T, T]),
        (0, 0, [T, F, F, F, F, F, F, F]),
    ],
)
def test_time(start, end, expected):
    policy = PrecisionPolicy("time", start=start, end=end)
    assert [policy.enabled(epoch=e) for e in range(8)] == expected


LRS = [0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01, 0.001, 0.001, 0.001]


@pytest.mark.parametrize(
    "start, end, hold, expected",
    [
        (1, None, 2, [F, T, T, F, F, T, T, F, F, T]),  # each schedule step: 2 epochs of full precision
        (4, None, 2, [F, F, F, F, F, T, T, F, F, T]),  # a hold that began before start still runs out
        (1, 8, 1, [F, T, T, F, T, T, T, F, T, F]),
        (0, None, 0, [T] * 10),  # hold 0: learning-rate changes are ignored
    ],
)
def test_lr(start, end, hold, expected):
    assert decide(PrecisionPolicy("lr", start=start, end=end, hold=hold), lr=LRS) == expected


# A loss curve: falling from 2.0, a spike at step 10, NaN at 15, a spike at 21.
LOSSES = [2.0 - 0.1 * s for s in range(10)] + [
    3.0,
    1.0,
    1.0,
    1.0,
    1.0,
    NAN,
    1.0,
    1.0,
    1.0,
    1.0,
    1.0,
    2.5,
    1.0,
    1.0,
    1.0,
]


@pytest.mark.parametrize(
    "interval, interval_hold, expected",
    [
        (None, None, [T] * 10 + [F, F, F, T, T, F, F, F, T, T, T, F, F, F, T]),
        (10, 3, [T] * 10 + [F, F, F, T, T, T, T, T, T, T, T, F, F, F, T]),  # NaN at 15: outside [10, 13), [20, 23)
        (20, 5, [T] * 10 + [T, T, T, T, T, T, T, T, T, T, T, F, F, F, T]),  # only [20, 25) is checked
    ],
)
def test_loss(interval, interval_hold, expected):
    policy = PrecisionPolicy("loss", hold=3, spike=0.5, per="step", interval=interval, interval_hold=interval_hold)
    assert decide(policy, per="step", loss=LOSSES) == expected
    if not expected[-1]:
        assert "full precision until step" in policy.reason


def test_the_first_check_window_starts_at_interval():
    policy = PrecisionPolicy("loss", hold=2, per="step", interval=10, interval_hold=3)
    assert decide(policy, per="step", loss=[1.0, NAN, 1.0, 1.0] + [1.0] * 6 + [NAN, 1.0, 1.0]) == [T] * 10 + [F, F, T]


def test_loss_with_a_gradscaler_that_keeps_overflowing():
    run = OverflowingScaler()
    overflows = [F, F, F, F, F, T, T, T, F, F, F, F, F, F, T, F, F, F, F, F]  # 3 in a row, then 1 alone
    policy = PrecisionPolicy("loss", hold=4, overflows=3, window=5, per="step")
    decisions = []
    for step, overflow in enumerate(overflows):
        decisions.append(policy.enabled(step=step, scaler=run.scaler))  # before the step: sees the last update
        run.step(overflow)
    # The third shrink is seen at step 8: full precision for steps 8-11; the lone overflow changes nothing.
    assert decisions == [T] * 8 + [F, F, F, F] + [T] * 8
    assert run.scaler.get_scale() == 1024.0 / 16


def test_auto_combines_time_lr_and_loss_per_step():
    lrs = [0.1] * 6 + [0.05] * 14
    losses = [1.0] * 12 + [9.0] + [1.0] * 7
    policy = PrecisionPolicy(start=3, end=17, hold=2)  # mode auto, per step
    assert policy.mode == "auto" and policy.per == "step"
    expected = [F, F, F, T, T, T, F, F, T, T, T, T, F, F, T, T, T, T, F, F]
    assert decide(policy, per="step", lr=lrs, loss=losses) == expected


def test_the_integer_policies():
    zero = MixedPrecision_TrainingPolicy(0, start_time=2, end_time=4)
    assert [zero.enable_mixed_precision(e) for e in range(6)] == [F, F, T, T, T, F]
    one = MixedPrecision_TrainingPolicy(1, start_time=1, hold_time=2)
    assert [one.enable_mixed_precision(e, lr=lr) for e, lr in enumerate(LRS)] == [F, T, T, F, F, T, T, F, F, T]
    two = MixedPrecision_TrainingPolicy(2, interval_time=3, interval_hold_time=1)
    losses = [1.0, 0.9, 0.8, 5.0, 0.8, 5.0, 6.0, 0.8]  # spikes at 3 (checked), 5 (not), 6 (checked)
    assert [two.enable_mixed_precision(e, loss=loss) for e, loss in enumerate(losses)] == [T, T, T, F, T, T, F, T]
    scaler = torch.amp.GradScaler("cpu")
    assert MixedPrecision_TrainingPolicy(0, start_time=0).enable_mixed_precision(0, scaler) is True


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: MixedPrecision_TrainingPolicy(3),
            "invalid policy=3; accepted: 0 (time), 1 (time + learning rate), 2 (loss)",
        ),
        (lambda: MixedPrecision_TrainingPolicy(1), "policy 1 (time + learning rate) requires hold_time"),
        (
            lambda: MixedPrecision_TrainingPolicy(1, hold_time=2).enable_mixed_precision(3),
            "policy 1 (time + learning rate) requires lr=",
        ),
        (lambda: MixedPrecision_TrainingPolicy(2).enable_mixed_precision(3), "policy 2 (loss) requires loss="),
        (
            lambda: MixedPrecision_TrainingPolicy(1, hold_time=2).enable_mixed_precision(3, 0.1, 0.5),
            "scaler=0.1 is a number",
        ),
        (lambda: PrecisionPolicy("fast"), "invalid mode='fast'; accepted: time, lr, loss, auto"),
        (
            lambda: PrecisionPolicy("time", start=5, end=2),
            "invalid end=2; accepted: None (to the end of training) or an integer >= start (5)",
        ),
        (
            lambda: PrecisionPolicy(interval=10, interval_hold=20),
            "invalid interval_hold=20; accepted: an integer from 1 to interval (10)",
        ),
        (lambda: PrecisionPolicy(dtype="int8"), "invalid dtype='int8'"),
        (
            lambda: PrecisionPolicy("time").enabled(step=3),
            "this policy decides per epoch: pass epoch= as an integer >= 0 (got None)",
        ),
        (lambda: PrecisionPolicy("lr").enabled(epoch=3), "mode 'lr' needs lr="),
        (lambda: PrecisionPolicy(lr_tolerance=-1), "invalid lr_tolerance=-1; accepted: a number >= 0"),
        (
            lambda: parse_policy("auto:speed=3"),
            "invalid setting 'speed=3'; accepted: setting=value with settings start, end",
        ),
        (lambda: parse_policy("auto:hold"), "invalid setting 'hold'"),
        (lambda: parse_policy("auto:spike=big"), "invalid spike='big'; accepted: a number"),
        (lambda: parse_policy("sometimes"), "invalid mode='sometimes'"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(
        (ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")
    ):
        make()


def test_a_resumed_policy_decides_identically():
    lrs = [0.1] * 15 + [0.01] * 25
    losses = [1.0 - 0.01 * s for s in range(40)]
    losses[18], losses[30] = 4.0, NAN
    overflows = [s in (20, 21, 22, 33) for s in range(40)]

    def run(policy, scaler, steps):
        decisions = []
        for s in steps:
            decisions.append(policy.enabled(step=s, lr=lrs[s], loss=losses[s], scaler=scaler.scaler))
            scaler.step(overflows[s])
        return decisions

    settings = dict(start=2, hold=3, overflows=2, window=4, interval=10, interval_hold=6)
    whole = run(PrecisionPolicy(**settings), OverflowingScaler(), range(40))
    assert F in whole[15:] and whole.count(F) < 40  # the run has decisions of both kinds after the cut
    scaler = OverflowingScaler()
    first = PrecisionPolicy(**settings)
    before = run(first, scaler, range(16))
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = PrecisionPolicy(**settings)
    resumed.load_state_dict(state)
    assert resumed.decision == first.decision and resumed.reason == first.reason
    assert before + run(resumed, scaler, range(16, 40)) == whole
    with pytest.raises(ValueError, match=r"other settings \(hold\)"):
        PrecisionPolicy(**{**settings, "hold": 4}).load_state_dict(state)
    compat = MixedPrecision_TrainingPolicy(1, start_time=0, hold_time=2)
    compat.enable_mixed_precision(0, lr=0.1)
    again = MixedPrecision_TrainingPolicy(1, start_time=0, hold_time=2)
    again.load_state_dict(compat.state_dict())
    assert again.enable_mixed_precision(1, lr=0.01) is False  # it remembers the last learning rate


def test_autocast_applies_the_latest_decision():
    policy = PrecisionPolicy("time", start=1)
    x = torch.ones(4, 4)
    policy.enabled(epoch=0)
    with policy.autocast("cpu"):
        assert (x @ x).dtype == torch.float32
    policy.enabled(epoch=1)
    with policy.autocast("cpu"):
        assert (x @ x).dtype == torch.bfloat16
    assert policy.device_dtype("cuda") == torch.float16
    assert PrecisionPolicy(dtype="bf16").device_dtype("cuda") == torch.bfloat16


def test_lr_tolerance_ignores_small_moves_in_auto_and_none_in_lr():
    lrs = [0.1, 0.099, 0.098, 0.097, 0.01, 0.01, 0.01, 0.01]  # a smooth decay, then a step down
    auto = PrecisionPolicy(hold=2)  # tolerance 10% by default in auto
    assert decide(auto, per="step", lr=lrs) == [T, T, T, T, F, F, T, T]
    strict = PrecisionPolicy("lr", hold=2, per="step")  # any change
    assert decide(strict, per="step", lr=lrs) == [T, F, F, F, F, F, T, T]
    loose = PrecisionPolicy("lr", hold=2, per="step", lr_tolerance=0.95)
    assert decide(loose, per="step", lr=lrs) == [T] * 8


def test_parse_policy_reads_settings_by_name():
    policy = parse_policy(" Auto : start=3, end=none, hold=2, interval-hold=5, interval=10, spike=0.25 ")
    settings = policy.state_dict()["settings"]
    assert (policy.mode, policy.per) == ("auto", "step")
    assert {k: settings[k] for k in ("start", "end", "hold", "interval", "interval_hold", "spike")} == {
        "start": 3,
        "end": None,
        "hold": 2,
        "interval": 10,
        "interval_hold": 5,
        "spike": 0.25,
    }
    assert parse_policy("time", per="epoch").per == "epoch"
