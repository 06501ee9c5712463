"""`sync_every=auto`'s policy: the interval, fragments, overlap and outer codec from a measured step and sync.

The first round (`FIRST` inner steps) is a measurement: one fragment unless given, its sync waiting for a full-precision
exchange (`MEASURING_CODEC`); a model over `PROBE_ELEMENTS` times a probe instead (`probe_size`), then syncs the round's
change in the setting chosen. Between two replicas over Gloo, DDP's broadcast as it wrapped the model has already timed
the link (`Broadcast`): the first round then waits for nothing and syncs its change in the setting chosen.
From the slowest rank's step time and the least any rank waited for that exchange (the others also waited for the
slowest to arrive), `choose()` picks the setting once; each later round's exchanges, timed on
the communication thread, re-choose the interval only (`rechoose()`): fragments and codec change where it is exact.

- outer codec: the least lossy of none, bf16, int8, fp4 whose whole-model sync fits in one inner step (fp4 if none
  does): one step of overlap can then hide it.
- fragments: the fewest (at most `MAX_FRAGMENTS`) whose each exchange takes at most half a step, a margin for the
  codec's work and the training sharing the machine.
- overlap: 1 step, where the syncs at the interval chosen take over half of `SHARE` of the time unhidden (0 below:
  hiding them gains under 5%). Measured on the text task: one step of overlap cost no quality, a whole round's did
  (+7.7%); on a GPT-2 under gradient accumulation, whose syncs took 2% of the time, it widened the worst seed's loss.
- interval H: the smallest whose syncs, counted as if nothing were hidden, take at most `SHARE` of the time, and at
  most the quality cap (`quality_cap`): `H_CAP` at the peak learning rate, times the square root of the peak over the
  learning rate now as a schedule lowers it (H grows as the learning rate falls, as in Gu et al.'s quadratic
  synchronization rule, ICLR 2024, but more slowly: the square itself cost quality on the text task). At the peak a
  longer interval bought speed with quality (docs/results.md#why-auto-chooses-as-it-does); the replicas' disagreement
  was no guide to it: it fell as H grew while the loss rose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainaccel.comm.codecs import get_codec

FIRST = 4  # the measuring round's inner steps
# The measuring round's codec. bf16 would halve its wait (2-3% of a 300-step run at 100 Mbit/s) but measured the link
# at 33-40 MB/s where full precision measured 56 (500 Mbit/s, 3 nodes): its fixed costs weigh more on half the bytes.
MEASURING_CODEC = "none"
# A model larger than this (float32 elements) is not synced in full precision to measure the link: its first round
# ends with a timed full-precision exchange of zeros (`probe_size`: an eighth of the model, at most this many, 32 MiB
# or 2.7 s at 100 Mbit/s between 2 replicas), scaled to the model by `choose()`, then syncs the round in the setting
# chosen. A 1B-parameter model's whole-model sync in full precision would wait for 4 GB, 5 minutes at 100 Mbit/s.
# Smaller models measure by their sync: on the text task (1.8M) a 2 MiB probe chose bf16 over int8 more often at
# 500 Mbit/s and ended worse (docs/results.md#why-auto-chooses-as-it-does).
PROBE_ELEMENTS = 8 * 2**20
PROBE_SHARE = 8  # the probe is this fraction of the model: ResNet-50's 12.2 MiB waits 1.1 s at 100 Mbit/s, not 2.8
# Before the timed probe, an untimed exchange of this many of its zeros: it connects the peers (NCCL does on first use),
# lines them up, and spends a link's burst allowance (after 16 KiB, the emulated links' 256 KB token bucket made a 2 MiB
# probe measure 66 MB/s on a 500 Mbit/s link), so the probe sees the sustained rate.
PROBE_WARMUP = 2**16
WINDOW = 20  # step times kept for the median
ROUNDS = 5  # rounds whose figures' medians re-choose H
SHARE = 0.1  # the syncs' largest share of the time (the 90%-of-the-ceiling mark) that sets H below its cap
H_CAP = 4  # the longest interval auto picks at the peak learning rate: quality falls with longer ones
H_MOST = 500  # the longest interval auto ever picks, however low the learning rate
# The noise gauge reads a sync's change at every k-th element, this many at most (256 KiB of float32 per fragment).
GAUGE_ELEMENTS = 2**16
# Rounds whose spread and mean change the gauge sums (48 steps at H=4: per 30 steps the ratio swung 2x on the text
# task). Measured and said, not yet acted on: at a fixed H it falls as the batch grows, as the interval quality allows
# does, and rises as the learning rate falls.
GAUGE_ROUNDS = 12
MAX_FRAGMENTS = 4
CODECS = ("none", "bf16", "int8", "fp4")  # least lossy first
# The options auto picks where they are left at their defaults (Config's), and their defaults.
PICKED = {"sync_fragments": 1, "sync_overlap": 0, "outer_compression": "none"}


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a choice is made from: the same figures on every rank."""

    step_s: float  # median inner step, the slowest rank's
    sync_s: float  # a whole-model sync's exchange in `codec`, the least any rank waited
    codec: str
    elements: int  # parameter elements a replica syncs
    replicas: int  # replicas the change is averaged over
    probed: int = 0  # elements the timed exchange carried where it was a probe (0: the whole model's sync)
    broadcast: int = 0  # bytes of the broadcast timed where it was DDP's as it wrapped the model (0: a sync or probe)
    lr_drop: float = 1.0  # the peak learning rate over the learning rate now, the least of any rank's (`quality_cap`)


@dataclasses.dataclass(frozen=True)
class Broadcast:
    """DDP's broadcast of rank 0's model as it wrapped it, timed on this rank."""

    seconds: float  # from the call to its return on this rank (rank 0's ends once its sends are buffered: not timed)
    nbytes: int  # the parameters and buffers it broadcast
    sent: bool  # this rank was its source


@dataclasses.dataclass(frozen=True)
class Setting:
    """auto's choice, and why in words."""

    interval: int
    fragments: int
    overlap: int
    codec: str
    why: str

    def line(self, given: frozenset[str] = frozenset()) -> str:
        """The one line auto logs for this setting; `given`: the options the user set (not auto's picks)."""

        def mark(option: str) -> str:
            return " (set)" if option in given else ""

        return (
            f"sync_every=auto: H={self.interval}, {self.fragments} fragment{'s' if self.fragments > 1 else ''}"
            f"{mark('sync_fragments')}, overlap {self.overlap}{mark('sync_overlap')}, "
            f"{self.codec}{mark('outer_compression')} ({self.why})"
        )


def left_to_auto(config: Any) -> frozenset[str]:
    """The options of `PICKED` that `config` leaves at their defaults: auto picks those (a value equal to the default
    counts as left: to fix one of them, give sync_every an integer)."""
    return frozenset(option for option, default in PICKED.items() if getattr(config, option) == default)


def probe_size(elements: int) -> int:
    """The elements of the probe that measures a model of `elements`: an eighth of a model over PROBE_ELEMENTS, at most
    that many; 0 for a smaller model, which its whole-model sync measures."""
    return min(PROBE_ELEMENTS, elements // PROBE_SHARE) if elements > PROBE_ELEMENTS else 0


def received_bytes(codec: str, elements: int, replicas: int) -> float:
    """Bytes each replica receives for one sync of `elements` float32 values in `codec`."""
    made = get_codec(codec)
    if made.summable:  # a ring allreduce: reduce-scatter, then all-gather
        width = 4 if codec == "none" else 2
        return 2 * width * elements * (replicas - 1) / max(replicas, 1)
    return (replicas - 1) * made.payload_bytes(elements)  # gathered: every other replica's payload


def choose(measured: Measured, free: frozenset[str], fragments: int, overlap: int, codec: str, tensors: int) -> Setting:
    """The setting for `measured`; options not in `free` keep the given `fragments`, `overlap`, `codec`; at most
    `tensors` fragments (a fragment holds whole tensors)."""
    step, replicas, elements = measured.step_s, max(measured.replicas, 2), measured.elements
    measured_bytes = measured.broadcast or received_bytes(measured.codec, measured.probed or elements, replicas)

    def sync_in(name: str) -> float:
        return measured.sync_s * received_bytes(name, elements, replicas) / measured_bytes

    what = "a full-precision sync" if measured.codec == "none" else f"a {measured.codec} sync"
    if measured.probed:
        what = f"a full-precision probe of {measured.probed * 4 / 2**20:.3g} MiB"
    if measured.broadcast:
        what = f"DDP's broadcast of {measured.broadcast / 2**20:.3g} MiB"
    said = f"step {step:.3f} s, {what} {measured.sync_s:.3f} s"
    if measured.sync_s > 0:
        said += f" at {measured_bytes / measured.sync_s / 1e6:.0f} MB/s"
    reasons = []
    if "outer_compression" in free:
        codec = next((c for c in CODECS if sync_in(c) <= step), min(CODECS, key=sync_in))
        fits = "under one step" if sync_in(codec) <= step else "the least, still over a step"
        named = "full precision" if codec == "none" else codec
        reasons.append(f"{named} makes it {sync_in(codec):.3f} s, {fits}")
    sync_s = sync_in(codec)
    if "sync_fragments" in free:
        most = max(1, min(MAX_FRAGMENTS, tensors))
        fragments = next((f for f in range(1, most + 1) if sync_s / f <= step / 2), most)
        if fragments > 1:
            fits = "under half a step each" if sync_s / fragments <= step / 2 else "the most auto makes"
            reasons.append(f"{fragments} fragments of {sync_s / fragments:.3f} s, {fits}")
    if "sync_overlap" in free:
        # A step of overlap hides the syncs behind training at the price of one stale step; where they take under
        # half the share unhidden it buys under 5% of the time. On a GPT-2 under gradient accumulation (syncs 2% of
        # the time at H=1; 11 seeds) auto ended -2.0% against plain DDP in the median, +5.2% at worst, without it;
        # -0.7% and +10.8% with it (docs/results.md#syncing-every-few-steps-at-500-and-100-mbits).
        unhidden = _share(sync_s, step, interval_within(sync_s, step, max(fragments, 1))[0])
        overlap = 1 if unhidden > SHARE / 2 else 0
    interval, why = interval_within(sync_s, step, max(fragments, overlap, 1), lr_drop=measured.lr_drop)
    if "sync_overlap" in free and not overlap:
        why += f"; no overlap: syncs take {unhidden:.0%} of the time unhidden"
    reasons = [f"{said}: {', '.join(reasons)}" if reasons else said, why]
    return Setting(interval, fragments, overlap, codec, "; ".join(reasons))


def _share(sync_s: float, step_s: float, interval: int) -> float:
    """The share of the time syncs of `sync_s` every `interval` steps of `step_s` take, nothing hidden."""
    total = interval * step_s + sync_s
    return sync_s / total if total > 0 else 1.0


def rechoose(setting: Setting, step_s: float, exchanged_s: float, lr_drop: float = 1.0) -> Setting:
    """`setting` with its interval chosen again from re-measured figures (medians of the last rounds; structure kept)
    and the learning rate's drop from its peak (`quality_cap`).

    Up as soon as syncs take more than SHARE of the time (as far as the cap allows), down only where the shorter H
    keeps them within half of it: a figure near the boundary does not move H back and forth. Down at once to a cap
    that fell below it (the learning rate rose again).
    """
    least, cap = max(setting.fragments, setting.overlap, 1), quality_cap(lr_drop)
    interval, why = interval_within(exchanged_s, step_s, least, lr_drop=lr_drop)
    if interval < setting.interval and max(cap, least) >= setting.interval:  # down only as far as half the share
        interval, why = interval_within(exchanged_s, step_s, least, SHARE / 2, lr_drop)
        interval = min(interval, setting.interval)
    if interval == setting.interval:
        return setting
    why = f"step {step_s:.3f} s, a round's exchanges {exchanged_s:.3f} s, re-measured; {why}"
    return dataclasses.replace(setting, interval=interval, why=why)


def quality_cap(lr_drop: float) -> int:
    """The longest interval quality allows where the learning rate is `lr_drop` times below its peak: H_CAP times the
    drop's square root, at most H_MOST (12 at the end of a cosine schedule to a tenth). The square (Gu et al.'s
    quadratic rule) ended +0.7 points worse than H_CAP throughout on the text task, the root +0.1 (docs/results.md)."""
    if math.isnan(lr_drop) or lr_drop <= 1:
        return H_CAP
    return int(min(H_MOST, max(H_CAP, math.floor(H_CAP * math.sqrt(min(lr_drop, H_MOST**2)) + 1e-9))))


def interval_within(
    sync_s: float, step_s: float, least: int, share: float = SHARE, lr_drop: float = 1.0
) -> tuple[int, str]:
    """H: the smallest (at least `least`) whose syncs of `sync_s` take at most `share` of the time, at most the quality
    cap where the learning rate is `lr_drop` times below its peak (`quality_cap`)."""
    needed = interval_for(sync_s, step_s, share)
    cap = max(quality_cap(lr_drop), least)
    if needed >= cap:
        if lr_drop > 1:
            return cap, f"H capped at {cap} for quality, the learning rate {lr_drop:.2f}x below its peak"
        return cap, f"H capped at {cap} for quality"
    interval = max(needed, least)
    return interval, f"H={interval} keeps syncs within {share:.0%} of the time even unhidden"


def interval_for(sync_s: float, step_s: float, share: float = SHARE, most: int = 500) -> int:
    """The smallest number of inner steps between syncs for which syncs take at most `share` of the time."""
    if step_s <= 0:
        return most
    needed = sync_s * (1 - share) / (share * step_s)  # sync / (interval * step + sync) <= share
    return int(min(most, max(1, math.ceil(needed - 1e-9))))
