"""sync_every=auto's choice of the whole setting: the policy's picks, the options it leaves alone, every rank alike."""

import dataclasses
import json
import math
import textwrap

import pytest

from conftest import run, trainaccel_cmd
from trainaccel.comm import auto_setting
from trainaccel.comm.auto_setting import (
    H_CAP,
    PICKED,
    PROBE_ELEMENTS,
    PROBE_SHARE,
    PROBE_WARMUP,
    Measured,
    choose,
    left_to_auto,
    probe_size,
    quality_cap,
    received_bytes,
    rechoose,
)
from trainaccel.config import Config

ALL = frozenset(PICKED)
ELEMENTS = 1_840_000  # the text task's language model


def _choose(step_s, sync_s, free=ALL, fragments=1, overlap=0, codec="none", replicas=2, elements=ELEMENTS):
    setting = choose(Measured(step_s, sync_s, "none", elements, replicas), free, fragments, overlap, codec, 30)
    return setting.interval, setting.fragments, setting.overlap, setting.codec


@pytest.mark.parametrize(
    "step_s, sync_s, expected",
    [
        # A fast link: full precision fits in a step, H as short as 10% of the time allows, under the cap.
        (0.1, 0.03, (3, 1, 1, "none")),
        (0.045, 0.02, (4, 1, 1, "none")),
        (0.5, 0.05, (1, 1, 1, "none")),
        # bf16 halves a sync just over a step; int8 quarters one of three steps. Two fragments of under half a
        # step each; H at its quality cap (7 steps would keep 0.076 s of syncs within 10% of the time).
        (0.1, 0.15, (H_CAP, 2, 1, "bf16")),
        (0.1, 0.3, (H_CAP, 2, 1, "int8")),
        # 500 Mbit/s on the text task: fp4 under a step, in two fragments of under half a step.
        (0.045, 0.2, (H_CAP, 2, 1, "fp4")),
        # 100 Mbit/s: fp4 still over a step; the most fragments, and H at its quality cap rather than longer.
        (0.045, 0.8, (H_CAP, 4, 1, "fp4")),
        (0.01, 5.0, (H_CAP, 4, 1, "fp4")),
        # No step time measured: the cap, never an unbounded interval.
        (0.0, 0.5, (H_CAP, 4, 1, "fp4")),
    ],
)
def test_auto_picks_the_least_lossy_codec_that_fits_a_step_and_caps_h(step_s, sync_s, expected):
    assert _choose(step_s, sync_s) == expected


def test_auto_keeps_the_options_the_user_set():
    # Codec set: fragments and overlap are still picked, from that codec's sync.
    free = ALL - {"outer_compression"}
    assert _choose(0.045, 0.8, free, codec="int8") == (H_CAP, 4, 1, "int8")
    assert _choose(0.045, 0.2, free, codec="bf16") == (H_CAP, 4, 1, "bf16")
    # Fragments set: kept, and H is at least one step per fragment (syncs then 3% of the time: no overlap).
    assert _choose(0.5, 0.05, ALL - {"sync_fragments"}, fragments=3) == (3, 3, 0, "none")
    # Overlap set: kept, H at least it.
    assert _choose(0.5, 0.05, ALL - {"sync_overlap"}, overlap=2) == (2, 1, 2, "none")
    # Everything set: only H is auto's.
    assert _choose(0.045, 0.8, frozenset(), 2, 1, "fp4") == (H_CAP, 2, 1, "fp4")


@pytest.mark.parametrize(
    "step_s, sync_s, expected",
    [
        # A GPT-2 under gradient accumulation on loopback: 2% of the time at H=1, nothing worth hiding.
        (0.05, 0.001, (1, 1, 0, "none")),
        (0.5, 0.024, (1, 1, 0, "none")),  # 4.6%: still under half the share
        (0.5, 0.03, (1, 1, 1, "none")),  # 5.7%: hidden by a step of overlap
        (0.1, 0.03, (3, 1, 1, "none")),
    ],
)
def test_overlap_only_where_the_syncs_would_take_over_half_the_share_unhidden(step_s, sync_s, expected):
    setting = choose(Measured(step_s, sync_s, "none", ELEMENTS, 2), ALL, 1, 0, "none", 30)
    assert (setting.interval, setting.fragments, setting.overlap, setting.codec) == expected
    assert ("no overlap: syncs take" in setting.line()) == (setting.overlap == 0)
    # Set by the user, overlap is kept whatever the figures.
    assert _choose(step_s, sync_s, ALL - {"sync_overlap"}, overlap=1)[2] == 1


def test_options_left_at_their_defaults_are_auto_s_to_pick():
    config = Config.resolve(env={}, sync_every="auto")
    assert left_to_auto(config) == ALL
    config = Config.resolve(env={}, sync_every="auto", sync_fragments=2, outer_compression="int8")
    assert left_to_auto(config) == {"sync_overlap"}
    assert left_to_auto(Config.resolve(env={"TRAINACCEL_SYNC_OVERLAP": "1"}, sync_every="auto")) == ALL - {
        "sync_overlap"
    }
    assert all(getattr(Config.resolve(env={}), option) == default for option, default in PICKED.items())


def test_a_gathered_codec_is_not_picked_where_it_sends_more_than_bf16():
    # 32 replicas: every other replica's fp4 payload outweighs a bf16 allreduce.
    assert received_bytes("fp4", ELEMENTS, 32) > received_bytes("bf16", ELEMENTS, 32)
    assert _choose(0.045, 0.8, replicas=32)[3] == "bf16"


def test_later_rounds_rechoose_h_only_and_say_why():
    first = choose(Measured(0.045, 0.2, "none", ELEMENTS, 2), ALL, 1, 0, "none", 30)
    assert first.interval == H_CAP == 4
    cheaper = rechoose(first, 0.045, 0.001)
    assert (cheaper.fragments, cheaper.overlap, cheaper.codec) == (first.fragments, first.overlap, first.codec)
    assert cheaper.interval == 2  # at least a step per fragment
    lower = rechoose(first, 0.045, 0.005)
    assert lower.interval == 3  # down only as far as keeps syncs within 5% of the time (10% would allow 1)
    assert rechoose(first, 0.045, 0.01) is first  # H = 2 would keep 10%, not 5%: no change, nothing said
    assert rechoose(lower, 0.045, 0.015) is lower  # within 10% at H = 3: no change
    assert rechoose(lower, 0.045, 0.02).interval == 4  # up as soon as syncs take more than 10%
    assert rechoose(lower, 0.045, 1.0).interval == H_CAP  # never past the cap
    line = first.line(frozenset({"outer_compression"}))
    assert line.startswith("sync_every=auto: H=4, 2 fragments, overlap 1, fp4 (set) (step 0.045 s, ")
    assert "\n" not in line and "at 37 MB/s" in line


@pytest.mark.parametrize(
    "lr_drop, cap",
    [
        (1.0, 4),
        (0.5, 4),
        (1.5, 4),
        (1.5625, 5),
        (2.0, 5),
        (4.0, 8),
        (10.0, 12),
        (100.0, 40),
        (15625.0, 500),
        (1e9, 500),
        (math.inf, 500),
        (math.nan, 4),
    ],
)
def test_the_quality_cap_grows_as_the_square_root_of_the_learning_rates_drop(lr_drop, cap):
    assert quality_cap(lr_drop) == cap  # at least H_CAP (at the peak, or above it); at most H_MOST


def test_h_follows_the_learning_rate_down_its_schedule_as_far_as_the_syncs_need():
    # The syncs' cost wants H = 12 (0.4 s every 12 steps of 0.3 s: 10% of the time); at the peak, H_CAP.
    first = choose(Measured(0.3, 0.4, "none", ELEMENTS, 2), frozenset(), 1, 0, "none", 30)
    assert first.interval == H_CAP and first.why.endswith("H capped at 4 for quality")
    assert rechoose(first, 0.3, 0.4, lr_drop=1.5) is first  # the learning rate at two thirds of its peak: still 4
    quarter = rechoose(first, 0.3, 0.4, lr_drop=4.0)  # at a quarter: at most 4 x 2
    assert quarter.interval == 8 and quarter.why.endswith(
        "H capped at 8 for quality, the learning rate 4.00x below its peak"
    )
    low = rechoose(quarter, 0.3, 0.4, lr_drop=16.0)  # at a sixteenth: the cap (16) is past what the syncs need
    assert low.interval == 12 and "H=12 keeps syncs within 10% of the time even unhidden" in low.why
    assert rechoose(low, 0.3, 0.4, lr_drop=64.0) is low  # no change, nothing said
    rose = rechoose(low, 0.3, 0.4, lr_drop=2.3)  # a warm restart: down to the cap at once, not by the share's rule
    assert rose.interval == 6 and rose.why.endswith("H capped at 6 for quality, the learning rate 2.30x below its peak")
    # The measuring round's choice takes the drop the ranks agreed on too.
    later = choose(Measured(0.3, 0.4, "none", ELEMENTS, 2, lr_drop=16.0), frozenset(), 1, 0, "none", 30)
    assert later.interval == 12


def test_a_probe_is_scaled_to_the_model_it_stands_for():
    # A probe of a tenth of the model's elements timed at 0.08 s: the whole model's full-precision sync is 0.8 s.
    probed = choose(Measured(0.045, 0.08, "none", ELEMENTS, 2, ELEMENTS // 10), ALL, 1, 0, "none", 30)
    whole = choose(Measured(0.045, 0.8, "none", ELEMENTS, 2), ALL, 1, 0, "none", 30)
    assert (probed.interval, probed.fragments, probed.overlap, probed.codec) == (H_CAP, 4, 1, "fp4")
    assert (whole.interval, whole.fragments, whole.overlap, whole.codec) == (H_CAP, 4, 1, "fp4")
    assert "a full-precision probe of 0.702 MiB 0.080 s at 9 MB/s: fp4 makes it 0.10" in probed.line()
    assert "a full-precision sync 0.800 s at 9 MB/s: fp4 makes it 0.10" in whole.line()


@pytest.mark.parametrize("sync_s", [0.12, 0.6])  # 500 and 100 Mbit/s on the text task
def test_ddps_broadcast_between_two_replicas_stands_for_a_full_precision_sync(sync_s):
    # Between 2 replicas a full-precision ring allreduce brings each one the model's 4 bytes per element, as a broadcast.
    broadcast = Measured(0.05, sync_s, "none", ELEMENTS, 2, broadcast=4 * ELEMENTS)
    synced = Measured(0.05, sync_s, "none", ELEMENTS, 2)
    by_broadcast, by_sync = (choose(m, ALL, 1, 0, "none", 30) for m in (broadcast, synced))
    assert dataclasses.replace(by_broadcast, why="") == dataclasses.replace(by_sync, why="")
    rate = f"at {4 * ELEMENTS / sync_s / 1e6:.0f} MB/s"
    assert f"DDP's broadcast of 7.02 MiB {sync_s:.3f} s {rate}: " in by_broadcast.line()
    assert f"a full-precision sync {sync_s:.3f} s {rate}: " in by_sync.line()
    # Its bytes are what it carried (the buffers too), not the parameters' alone.
    doubled = choose(Measured(0.05, sync_s, "none", ELEMENTS, 2, broadcast=8 * ELEMENTS), ALL, 1, 0, "none", 30)
    assert f"at {8 * ELEMENTS / sync_s / 1e6:.0f} MB/s" in doubled.line()


@pytest.mark.parametrize(
    "elements, probe",
    [
        (263_168, 0),  # a small model: its whole-model sync measures
        (1_841_280, 0),  # the text task's model
        (PROBE_ELEMENTS, 0),
        (PROBE_ELEMENTS + 8, PROBE_ELEMENTS // PROBE_SHARE + 1),  # an eighth of the model
        (25_557_032, 3_194_629),  # ResNet-50: 12.2 MiB instead of 32 MiB
        (10**9, PROBE_ELEMENTS),  # the largest probe
    ],
)
def test_a_probe_is_an_eighth_of_a_large_model_and_at_most_probe_elements(elements, probe):
    assert probe_size(elements) == probe
    assert probe == 0 or PROBE_WARMUP < probe <= elements / PROBE_SHARE


SCRIPT = """
import json, sys, time

import torch
import torch.distributed as dist

from trainaccel.comm import DiLoCo, auto_setting

dist.init_process_group("gloo")
rank = dist.get_rank()
auto_setting.PROBE_ELEMENTS = int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
diloco = DiLoCo(model, optimizer, sync_every="auto", **json.loads(sys.argv[2]))
for step in range(1, 31):
    time.sleep(0.01 * (1 + 2 * rank))  # rank 1 steps slower: every rank decides from the same figures anyway
    model(torch.randn(8, 256, generator=torch.Generator().manual_seed(rank * 100 + step))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == auto_setting.FIRST:
        first_round = [diloco.outer.syncs, diloco.outer.bytes_sent]
    if step == auto_setting.FIRST + 1:  # with one step of overlap: the first round's syncs applied
        first_round += [diloco.outer.syncs, diloco.outer.bytes_sent]
    if step == 20:
        saved = diloco.state_dict()
diloco.sync()
resumed = DiLoCo(model, optimizer, sync_every="auto", **json.loads(sys.argv[2]))  # a new run from the checkpoint
resumed.load_state_dict(saved)
outer = diloco.outer
result = {
    "setting": [outer.interval, len(outer.fragments), outer.overlap, outer._codec.name],
    "feedback": [outer._feedback is not None, resumed.outer._feedback is not None],
    "resumed": [resumed.outer.interval, len(resumed.outer.fragments), resumed.outer.overlap, resumed.outer._codec.name],
    "syncs": outer.syncs,
    "first_round": first_round,
    "params": [float(p.double().sum()) for p in model.parameters()],
}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "options, env, probe",
    [
        ({}, {}, 0),
        # Siblings of the defaults' path with the user's fragments or codec kept (the probe's run keeps fragments too).
        pytest.param({"sync_fragments": 2}, {}, 0, marks=pytest.mark.comm_full),
        pytest.param({}, {"TRAINACCEL_OUTER_COMPRESSION": "bf16"}, 0, marks=pytest.mark.comm_full),
        # The model (263,168 elements) over the probe's size: its first round times a probe, then syncs in the setting
        # chosen; over the whole group, and over the members present.
        ({"sync_fragments": 2}, {}, 100_000),
        pytest.param({"on_lost_replica": "continue"}, {}, 100_000, marks=pytest.mark.comm_full),
    ],
    ids=["defaults", "fragments", "codec", "probe", "probe-members"],
)
def test_every_rank_takes_the_same_setting_and_rank_0_says_it_once(tmp_path, options, env, probe):
    script = tmp_path / "auto.py"
    script.write_text(textwrap.dedent(SCRIPT))
    size = probe or auto_setting.PROBE_ELEMENTS
    probe = min(probe, 263_168 // auto_setting.PROBE_SHARE)  # the probe's elements: an eighth of the model
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, script, tmp_path, json.dumps(options), size],
        env={"TRAINACCEL_LOG_LEVEL": "info", **env},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["setting"] == second["setting"] and first["syncs"] == second["syncs"] >= 3
    assert first["params"] == second["params"]  # sync() averaged them: the same bits
    interval, fragments, overlap, _ = first["setting"]
    assert 1 <= fragments <= 4 and fragments <= interval <= H_CAP
    if "sync_overlap" in options:
        assert overlap == options["sync_overlap"]
    else:  # a step of overlap where the syncs would take over 5% of the time unhidden: the line says which
        assert overlap in (0, 1)
    if "sync_fragments" in options:
        assert fragments == options["sync_fragments"]
    assert first["resumed"][1:] == first["setting"][1:]  # the checkpoint's fragments, overlap and codec
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "sync_every=auto: H=" in line]
    measured = "full-precision probe of 0.125 MiB" if probe else "full-precision sync"  # the measuring round's
    first_choice = [line for line in said if measured in line]
    assert len(first_choice) == 1, said  # once, from rank 0
    assert len(said) == len(set(said)), said  # each change said once
    if "sync_fragments" in options:
        assert f"{fragments} fragments (set)" in first_choice[0]
    if "sync_overlap" not in options:
        assert ("no overlap: syncs take" in first_choice[0]) == (overlap == 0), first_choice[0]
    syncs, sent, applied, sent_by_then = first["first_round"]
    probed = 4 * (probe + min(probe, auto_setting.PROBE_WARMUP))  # the probe's bytes and its untimed first exchange's
    if probe:  # the round's change in the setting chosen (fp4's size to float32's), waited for: every fragment's
        assert syncs == fragments and 263_168 / 2 <= sent - probed <= 4 * 263_168, first["first_round"]
        # One step of overlap applies them at the next step; without it, a sync there may be the next round's.
        assert (applied, sent_by_then) == (syncs, sent) if overlap else applied >= syncs, first["first_round"]
    else:
        assert syncs == (2 if "sync_fragments" in options else 1), first["first_round"]
        # One step of overlap applies them at the next step; without it, a sync there may be the next round's.
        assert applied == syncs if overlap else applied >= syncs, first["first_round"]
        assert sent >= 4 * 263_168, first["first_round"]
    if env:
        # The user's lossy codec, taken after the measuring round or from the checkpoint, has error feedback.
        assert first["setting"][3] == "bf16" and "bf16 (set)" in first_choice[0] and first["feedback"] == [True, True]


ZERO_CODE = """
import json, sys, time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import auto_setting

dist.init_process_group("gloo")
rank = dist.get_rank()
result = {}
for wrap in sys.argv[2:]:  # a model each, in turn
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    ddp = DDP(model, init_sync=wrap == "init_sync")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    outer = ddp.trainaccel.diloco.outer
    for step in range(1, 13):
        time.sleep(0.01)
        g = torch.Generator().manual_seed(rank * 100 + step)
        ddp(torch.randn(8, 256, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == auto_setting.FIRST:
            first_round = [outer.syncs, outer.bytes_sent, outer._auto.setting.line()]
    ddp.trainaccel.diloco.sync()
    result[wrap] = {
        "setting": [outer.interval, len(outer.fragments), outer.overlap, outer._codec.name],
        "first_round": first_round,
        "params": [float(p.double().sum()) for p in model.parameters()],
    }
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""

# workers -> how each wrap's first round is measured: DDP's broadcast between two replicas (of 263,168 float32
# elements: 1.004 MiB), else a full-precision sync (DDP broadcast nothing; Gloo's tree shares the source's link)
MEASURED_BY = {
    2: {"init_sync": "DDP's broadcast of 1 MiB", "no_init_sync": "a full-precision sync"},
    3: {"init_sync": "a full-precision sync"},
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "workers",
    # three: the measuring round's path, which the defaults' test runs too
    [workers if workers == 2 else pytest.param(workers, marks=pytest.mark.comm_full) for workers in MEASURED_BY],
    ids=["two-replicas", "three-replicas"],
)
def test_zero_code_auto_measures_the_link_by_ddps_broadcast_between_two_replicas(tmp_path, workers):
    script = tmp_path / "zero_code_auto.py"
    script.write_text(textwrap.dedent(ZERO_CODE))
    cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", workers, "--sync-every", "auto"]
    env = {"TRAINACCEL_OUTER_COMPRESSION": "fp4"}  # the setting's codec: a first sync in it sends an eighth
    proc = run([*cmd, "--sync-scope", "rank", script, tmp_path, *MEASURED_BY[workers]], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(workers)]
    for wrap, measured_by in MEASURED_BY[workers].items():
        first = ranks[0][wrap]
        assert all(r[wrap]["setting"] == first["setting"] and r[wrap]["params"] == first["params"] for r in ranks)
        syncs, sent, line = first["first_round"]
        assert f"{measured_by} " in line, line
        if measured_by.startswith("DDP"):  # no full-precision sync: the round's change in fp4 (set), waited for
            assert syncs == first["setting"][1] and 263_168 / 4 <= sent <= 263_168, first["first_round"]
        else:  # the measuring round's sync, in full precision, waited for
            assert syncs == 1 and sent >= 4 * 263_168, first["first_round"]


FOLLOWS_LR = """
import json, sys

import torch
import torch.distributed as dist

from trainaccel.comm import DiLoCo, auto_setting

dist.init_process_group("gloo")
rank = dist.get_rank()
auto_setting.SHARE = 1e-4  # syncs may take almost no time: the quality cap alone sets H
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
diloco = DiLoCo(model, optimizer, sync_every="auto")
intervals = []
for step in range(1, 61):
    if step == 10:  # the schedule lowers the learning rate: to an eighth on rank 0, a quarter on rank 1
        optimizer.param_groups[0]["lr"] = 0.0125 if rank == 0 else 0.025
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank * 100 + step))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    intervals.append(diloco.outer.interval)
saved = diloco.state_dict()
resumed = DiLoCo(model, optimizer, sync_every="auto")
resumed.load_state_dict(saved)
result = {"intervals": intervals, "peak": saved["auto"]["peak_lr"], "resumed_peak": resumed.outer._auto.peak_lr}
result.update(rounds=saved["auto"]["rounds"], resumed_rounds=[list(r) for r in resumed.outer._auto.rounds])
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_h_grows_as_the_inner_learning_rate_falls_alike_on_every_rank(tmp_path):
    script = tmp_path / "follows.py"
    script.write_text(textwrap.dedent(FOLLOWS_LR))
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, script, tmp_path],
        env={"TRAINACCEL_LOG_LEVEL": "info"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["intervals"] == second["intervals"]  # the least drop of any rank's: every rank schedules alike
    assert first["intervals"][:12] == [H_CAP] * 12  # at the peak (its drop is read a round after it is measured)
    assert first["intervals"][-1] == quality_cap(4.0) == 8  # rank 1's learning rate fell to a quarter: 4 x 2
    assert first["peak"] == second["peak"] == first["resumed_peak"] == 0.1  # the checkpoint keeps the peak
    # and the rounds H is re-chosen from: a replica that joins schedules its syncs at the others' steps
    assert first["rounds"] and first["rounds"] == second["rounds"] == first["resumed_rounds"]
    lines = (proc.stdout + proc.stderr).splitlines()
    said = [line for line in lines if "sync_every=auto: H=8" in line and "from the checkpoint" not in line]
    assert len(said) == 1 and "H capped at 8 for quality, the learning rate 4.00x below its peak" in said[0], said
