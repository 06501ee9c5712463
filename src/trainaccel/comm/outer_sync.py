"""DiLoCo's algorithm alone: every `sync_every` inner steps, the replicas' averaged parameter change is applied by an
outer optimizer. It knows parameters, a group and a step count; nothing of modules, optimizers or looks.

    outer = OuterSync(model.parameters(), sync_every=50)   # on every rank of the group, the same parameters
    for batch in data:
        loss_fn(model(batch)).backward()
        outer.prepare()       # before the first inner step: rank 0's model everywhere, the anchors taken
        optimizer.step()
        optimizer.zero_grad()
        outer.step()          # an inner step ended: the syncs now due start (and finish, without sync_overlap)

`trainaccel.comm.DiLoCo` applies it to a model and the script's own loop (which steps are inner steps, what a
look sees, DDP's exchange switched off); use this class where a loop of your own decides those.

Streaming (`sync_fragments`, `sync_overlap`): the parameters in fragments synced at staggered steps, each exchange
running on the communication thread behind the next steps of training; its result is applied `sync_overlap` steps
later, with the steps taken meanwhile kept on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm import auto_setting, clock
from trainaccel.comm.auto_setting import interval_for  # noqa: F401 (its home before auto_setting)
from trainaccel.comm.codecs import Codec, ErrorFeedback, get_codec
from trainaccel.comm.exchange import start_exchange, warn_if_gathering_costs_more
from trainaccel.comm.hierarchical import HierarchicalReduce
from trainaccel.comm.scheduler import SYNC, connect, engine_group, sync_thread
from trainaccel.comm.topology import Topology, discover, hierarchy_for
from trainaccel.config import Config
from trainaccel.context import current_config, info_once, note_taken
from trainaccel.devices import backend_of, broadcast_from_first, by_dtype, group_device
from trainaccel.resilience import failfast
from trainaccel.resilience.failfast import HANG_MIN_S, hang_deadline
from trainaccel.resilience.membership import Membership
from trainaccel.resilience.rejoin import training_began

log = logging.getLogger("trainaccel")

FORMAT = 2  # 1: before fragments (one of everything); still read
# sync_every=auto: the first sync after AUTO_FIRST steps measures; its policy is comm/auto_setting.py's.
AUTO_FIRST, AUTO_WINDOW = auto_setting.FIRST, auto_setting.WINDOW
SCOPES = ("rank", "node")


class _Fragment:
    """A share of the parameters with its own anchors, outer optimizer and place in the schedule."""

    __slots__ = {
        "index": "position among the fragments: its error-feedback key and its step within each round",
        "params": "its parameters (a sharded one's own shard): a contiguous run of the model's, about 1/F of them",
        "buffers": "floating-point buffers averaged with its syncs (the last fragment holds them all)",
        "anchors": "float32 parameters after its last regular sync (None until the first inner step); in pinned host "
        "memory for a GPU's parameters (`anchor_home`)",
        "outer": "torch.optim.SGD over the anchors (None for average)",
        "next_sync": "`steps` at which its next regular sync starts",
        "pending": "its exchange in flight: (step at which it is applied, future, parameters when it started)",
        "snapshot": "float32 parameters and buffers as an overlapped sync began, at the anchors' home (kept between "
        "syncs: pinned host memory is slow to allocate); None until the first",
        "residual_before": "while an overlapped sync is in flight: the codec's residuals from before its encode (what "
        "a checkpoint saves, with the anchors that do not hold it yet; None: there was none)",
        "gauged": "while auto's sync is in flight: (this replica's change at every `stride`-th element, stride, "
        "replicas), for `_Auto.noise` (None otherwise)",
    }

    def __init__(self, index: int, params: list[torch.Tensor], buffers: list[torch.Tensor]):
        self.index, self.params, self.buffers = index, params, buffers
        self.anchors: list[torch.Tensor] | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.next_sync = 0
        self.pending: tuple[int, torch.futures.Future, torch.Tensor | None] | None = None
        self.residual_before: dict[Any, torch.Tensor] | None = None
        self.snapshot: torch.Tensor | None = None
        self.gauged: tuple[torch.Tensor, int, int] | None = None

    @property
    def key(self) -> str:
        return f"diloco/{self.index}"


class _Auto:
    """sync_every=auto's state: the options it picks, its measuring round, its setting, the exchanges timed."""

    __slots__ = {
        "free": "the options left to auto (auto_setting.left_to_auto); the others are the user's",
        "given_codec": "outer_compression as configured (used after the measuring round unless auto picks it)",
        "fp16_scale": "Config's fp16_scale, for the codec in use",
        "measuring": "the first round: its syncs wait for a full-precision exchange (MEASURING_CODEC), which is timed; "
        "none run in it where `syncs_after_choosing`",
        "elements": "the parameter elements a replica syncs (where auto_setting.probe_size gives a probe, the first "
        "round times an exchange of that many zeros at its end, then syncs in the setting chosen)",
        "broadcast": "DDP's broadcast as it wrapped the model, where it timed the links the syncs take "
        "(auto_setting.Broadcast, from `OuterSync.note_equal`): the first round syncs after choosing, as with a probe",
        "setting": "the auto_setting.Setting in use (None while measuring)",
        "exchanged": "each regular sync's exchange since the last round's end, as clock marks (start, end) on the "
        "stream that ran it: on a GPU the host's clock would time the queueing, not the transfer",
        "rounds": "the last rounds' (step, exchanged) seconds as every rank shares them: their medians re-choose H",
        "skip": "the round after the first choice is not measured: its syncs' exchanges finish in the next one",
        "noise": "since the last round's end, this rank's sums over syncs of the replicas' spread (the variance of a "
        "replica's change about the mean, V) and of the squared mean change (|D|^2), a float64 pair on the device "
        "(None: no sync yet; `noise_figures`)",
        "gauged": "the last GAUGE_ROUNDS rounds' (H, V, |D|^2), V and |D|^2 summed over every rank: the same on "
        "every rank; `noise_ratio` reads them",
        "peak_lr": "the highest learning rate the inner optimizers had at a round's end (0: none known yet); the "
        "interval's cap grows as the learning rate falls below it (auto_setting.quality_cap)",
    }

    def __init__(self, config: Config, elements: int):
        self.free = auto_setting.left_to_auto(config)
        self.given_codec, self.fp16_scale = config.outer_compression, config.fp16_scale
        self.measuring, self.setting, self.elements = True, None, elements
        self.broadcast: auto_setting.Broadcast | None = None
        self.exchanged: list[tuple[clock.Mark, clock.Mark]] = []
        self.rounds: list[tuple[float, float]] = []
        self.skip = False
        self.peak_lr = 0.0
        self.noise: torch.Tensor | None = None
        self.gauged: list[tuple[float, float, float]] = []

    def lr_drop(self, learning_rate: float | None) -> float:
        """The peak learning rate over `learning_rate` (the inner optimizers' now; None: unknown, taken as the peak),
        the peak raised to it first."""
        if learning_rate is None or not math.isfinite(learning_rate) or learning_rate <= 0:
            return 1.0
        self.peak_lr = max(self.peak_lr, learning_rate)
        return self.peak_lr / learning_rate

    @property
    def probe(self) -> int:
        """The elements of the probe the first round times before syncing in the setting chosen (0: it times its
        sync)."""
        return auto_setting.probe_size(self.elements)

    @property
    def syncs_after_choosing(self) -> bool:
        """The first round does not wait for a full-precision sync: a probe or DDP's broadcast measures the link, and
        the round's change is synced in the setting chosen."""
        return bool(self.probe or self.broadcast)

    def timed(self, exchange: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        """`exchange`, its start and end on `device`'s current stream noted in `exchanged` when it succeeds."""

        def run(*args: Any) -> Any:
            start = clock.mark(device)
            result = exchange(*args)
            self.exchanged.append((start, clock.mark(device)))
            return result

        return run

    def take_exchanged(self, wait: bool) -> float:
        """Seconds of the exchanges noted whose end the device has passed (all of them, waiting, with `wait`), and
        forget them; the others stay for the next round."""
        total, pending = 0.0, []
        for span in self.exchanged:
            took = span if isinstance(span, float) else clock.seconds(*span, wait=wait)
            if took is None:
                pending.append(span)
            else:
                total += took
        self.exchanged[:] = pending
        return total

    def gauge(self, figures: torch.Tensor) -> None:
        """Add a sync's (V, |D|^2) (`noise_figures`) to `noise`."""
        self.noise = figures if self.noise is None else self.noise + figures

    def take_noise(self, device: torch.device) -> torch.Tensor:
        """This rank's (V, |D|^2) sums since the last round's end (on the parameters' device; zeros on `device` where
        there was no sync), and start again from zero."""
        noise, self.noise = self.noise, None
        return torch.zeros(2, dtype=torch.float64, device=device) if noise is None else noise

    def noise_ratio(self) -> float | None:
        """The replicas' spread over the mean change's square, V / |D|^2, over the rounds in `gauged` (None: none
        measured yet). Over a sync's change it rises where the inner steps' noise dominates their direction."""
        spread, signal = sum(r[1] for r in self.gauged), sum(r[2] for r in self.gauged)
        return spread / signal if signal > 0 else None

    def say(self, setting: auto_setting.Setting) -> None:
        self.setting = setting
        info_once(setting.line(frozenset(auto_setting.PICKED) - self.free))


class OuterSync:
    """Anchors, outer optimizers, fragments and their schedule over one group of replicas; `step()` drives it."""

    __slots__ = {
        "sync_every": "inner steps between syncs as configured: an integer, or auto",
        "interval": "inner steps between a fragment's syncs now (auto: chosen from the measured sync and step times)",
        "warmup": "first inner steps before the anchors are taken (sync_warmup): the caller keeps them exchanging",
        "overlap": "inner steps an exchange runs behind training before its result is applied (sync_overlap)",
        "outer_optimizer": "nesterov, sgd or average",
        "scope": "node (one replica per node, each node's workers holding the same parameters) or rank (one each)",
        "group": "the process group replicas are averaged over",
        "steps": "inner steps so far",
        "synced_at": "`steps` when the replicas were last made equal (a sync of the whole model, or sync())",
        "syncs": "regular syncs (outer steps of a fragment) so far",
        "bytes_sent": "bytes this rank has put into syncs' allreduces",
        "nan_check": "off, warn or raise: each sync's averaged change checked for NaN/Inf",
        "live_is_synced": "the live parameters are the synced model (right after a whole-model sync); the caller "
        "clears it when they change",
        "params": "the parameters synced, deduplicated, in the order given",
        "_names": "parameter names by id, for nan_check's message (may be empty)",
        "_fragments": "the parameters split for staggered syncs (one fragment without sync_fragments)",
        "_codec": "the outer_compression codec of the parameter change",
        "_feedback": "its error feedback (lossy codecs), or None",
        "_hierarchy": "the HierarchicalReduce the change goes through (node scope, or multi-node hierarchical)",
        "_engine_group": "the engine's own copy of `group` for the flat exchange",
        "_timing": "auto: [end of the last inner step, recent step seconds (syncs left out), seconds in syncs]",
        "_measured": "auto: the future of the slowest rank's (sync, step) seconds, read at the next round's end",
        "_outer_settings": "(outer_lr, outer_momentum) for the outer optimizers made with the anchors",
        "_auto": "sync_every=auto: what it picks and has measured (`_Auto`); None for an integer sync_every",
        "_hang_timeout": "the job's hang_timeout: how long the syncs wait for a member alive but absent",
        "_membership": "on_lost_replica=continue: the replicas taking part in the syncs (None: the whole group)",
        "_admit_at": "on_lost_replica=continue: `steps` after which replicas started again may join (a round applied)",
        "rejoined_at": "`steps` when this replica rejoined the running job (its rank started again); 0: it did not",
        "inner_state": "on_lost_replica=continue: what a replica rejoining takes of the inner optimizers, {index in "
        "`params`: that parameter's optimizer state}, from the caller that knows them (None: nothing)",
        "learning_rate": "sync_every=auto: the inner optimizers' learning rate now, from the caller that knows them "
        "(None: nothing; a callable that returns None: unknown), which lets the interval grow as a schedule lowers it",
        "joined_inner": "a replica that rejoined: the inner optimizers' state a live member sent ({index in `params`: "
        "state}), each entry until an optimizer of this replica takes it",
        "_synced_buffers": "the floating-point buffers averaged at the last regular sync (float32): the synced ones",
        "_equal_at": "parameters known equal on every rank (just broadcast: by DDP as it wrapped them, or by "
        "hvd.broadcast_parameters): id -> (version, data pointer) then; `_start` broadcasts them only if one changed "
        "since on some rank (None: always)",
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] = (),
        *,
        group: Any = None,
        scope: str = "rank",
        names: dict[int, str] | None = None,
        config: Config | None = None,
        **options: Any,
    ):
        """`params`: the trainable parameters (a sharded one: its local shard); `buffers`: floating-point buffers
        averaged at each sync; `options`: Config's sync_every, outer_optimizer, outer_lr, outer_momentum, sync_warmup,
        sync_fragments, sync_overlap, outer_compression, nan_check, over `config` (or init()'s, or the defaults)."""
        config = resolve(config, {k: v for k, v in options.items() if v is not None})
        note_taken("OuterSync")
        if config.sync_every != "auto" and config.sync_every < 1:
            raise ValueError(
                f"invalid sync_every={config.sync_every!r}; accepted: an integer >= 1, or auto, for DiLoCo"
            )
        if scope not in SCOPES:
            raise ValueError(f"invalid scope={scope!r}; accepted: {', '.join(SCOPES)}")
        if not dist.is_initialized():
            raise RuntimeError("DiLoCo needs the process group: call init_process_group (or trainaccel.init()) first")
        self.sync_every, self.outer_optimizer = config.sync_every, config.outer_optimizer
        self.warmup, self.overlap = config.sync_warmup, config.sync_overlap
        self.group, self.scope = group or dist.group.WORLD, scope
        self.steps = self.synced_at = self.syncs = self.bytes_sent = 0
        self.nan_check, self._names = config.nan_check, dict(names or {})
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: the model has no trainable parameters")
        if config.sync_fragments > len(self.params):
            raise ValueError(
                f"invalid sync_fragments={config.sync_fragments}; accepted: at most the model's {len(self.params)} "
                "trainable parameter tensors (a fragment holds whole tensors)"
            )
        buffers = list(buffers)
        self._fragments = [
            _Fragment(i, [local_part(p) for p in params], buffers if i == config.sync_fragments - 1 else [])
            for i, params in enumerate(split_fragments(self.params, config.sync_fragments))
        ]
        self.interval = self.sync_every
        if self.sync_every == "auto":
            self.interval = max(AUTO_FIRST, self._least_interval())
        self._schedule(self.warmup)
        self._timing: list[Any] = [None, [], 0.0]
        self._measured: torch.futures.Future | None = None
        self._outer_settings = (config.outer_lr, config.outer_momentum)
        device = self.params[0].device if self.params else None
        self._codec = configured = get_codec(config.outer_compression, fp16_scale=config.fp16_scale, device=device)
        self._feedback = ErrorFeedback() if self._codec.lossy else None
        elements = sum(p.numel() for f in self._fragments for p in f.params)
        self._auto = _Auto(config, elements) if self.sync_every == "auto" else None
        if self._auto is not None:  # the measuring round's syncs: full precision, no residual to carry past it
            self._codec, self._feedback = get_codec(auto_setting.MEASURING_CODEC), None
        self._engine_group = engine_group(self.group, SYNC)
        self.live_is_synced, self._synced_buffers = False, []
        self._equal_at: dict[int, tuple[int, int]] | None = None
        self._hierarchy: HierarchicalReduce | None = None
        self._hang_timeout = config.hang_timeout
        self._membership: Membership | None = None
        self.rejoined_at = 0
        self.inner_state: Callable[[], dict[int, dict]] | None = None
        self.learning_rate: Callable[[], float | None] | None = None
        self.joined_inner: dict[int, dict] = {}
        if config.on_lost_replica == "continue":
            self._survive_lost_replicas(config)
        self.use_scope(scope, config.hierarchical)
        connect(self._groups(), self.params[0].device)  # the syncs' communicators, built now on this thread
        if self._membership is not None and failfast.incarnation() > 0:
            self._rejoin()
        # The payloads are gathered across nodes only when the change goes in two levels.
        across = self._hierarchy.topology.num_nodes if self._hierarchy is not None else dist.get_world_size(self.group)
        warn_if_gathering_costs_more(configured, across, "parameter", "outer_compression")

    def use_scope(self, scope: str, hierarchical: str) -> None:
        """Replicas per node (`node`: each node's workers hold one, its change crosses nodes once, a shard from each
        worker) or per rank (the change in two levels where `hierarchical` and the topology say so)."""
        self.scope = scope
        if self._membership is not None:  # on_lost_replica=continue: a node's workers lost together
            self._membership.group_replicas(list(map(list, discover().nodes)) if scope == "node" else None)
            return
        if scope == "node":
            self._hierarchy = _sync_hierarchy(discover(), self._codec, self._feedback)
            return
        topology = hierarchy_for(self.group, hierarchical, True, "syncs reduce", self.params[0].device)
        self._hierarchy = _sync_hierarchy(topology, self._codec, self._feedback) if topology is not None else None

    def _survive_lost_replicas(self, config: Config) -> None:
        """on_lost_replica=continue: the syncs run over the replicas present (`Membership`): under node scope in two
        levels over the nodes present, else flat; a lost peer no longer ends this worker."""
        self._membership = Membership(self._engine_group, config.collective_timeout)
        failfast.survive_lost_peers()
        self._admit_at = -1

    def _rejoin(self) -> None:
        """This rank was started again to rejoin the running job: at the members' next round's end, a live
        replica's synced model, anchors, outer optimizers and schedule (its residuals stay its own)."""
        if self.warmup:
            raise ValueError(
                f"a replica cannot rejoin a job under sync_warmup={self.warmup}: the warm-up's exchange would run "
                "over the stand-in default group; use sync_warmup=0 with on_lost_replica=continue to rejoin"
            )
        failfast.start_heartbeat()  # beating before it asks: the members judge it by its heartbeat
        state = torch.load(io.BytesIO(self._membership.join(self._hang_s())), map_location="cpu", weights_only=True)
        self.load_state_dict(state["outer"], local=False)
        with torch.no_grad():
            for fragment in self._fragments:
                for param, anchor in zip(fragment.params, fragment.anchors):
                    param.copy_(anchor)
            for buffer, value in zip(self._fragments[-1].buffers, state["buffers"]):
                buffer.copy_(value.view_as(buffer))  # (kept flat after a sync)
        self._synced_buffers = [b.to(self.params[0].device) for b in state["buffers"]]
        self.joined_inner = state.get("inner", {})
        self.synced_at, self.live_is_synced, self.rejoined_at = self.steps, True, self.steps
        info_once(f"rejoined the running job at inner step {self.steps} with {len(self.members)} replicas")

    def _join_state(self) -> bytes:
        """What a replica rejoining takes from this one (`_rejoin`): the outer state, the synced buffers, the inner
        optimizers' state (`inner_state`)."""
        state = {"outer": {**self.state_dict(), "residuals": {}}, "buffers": self._synced_buffers}
        state["inner"] = self.inner_state() if self.inner_state is not None else {}
        out = io.BytesIO()
        torch.save(state, out)
        return out.getvalue()

    def _admit(self) -> None:
        """Members at a round's end with nothing in flight: replicas waiting to rejoin become members (the state
        sent on the communication thread, after the syncs already queued there)."""
        self._admit_at = -1
        joiners = self._membership.joiners_at(f"join@{self.steps}")
        if joiners:
            admit = functools.partial(self._membership.admit, f"join@{self.steps}", joiners, self._join_state)
            sync_thread().run(functools.partial(admit, self._hang_s()), groups=self._groups())

    def node_group(self) -> dist.ProcessGroup | None:
        """Under node scope, the group this node's workers average gradients over at every step: the hierarchy's in-node
        group, or for a node started again to rejoin, its workers' own, built at their join (collective on first
        call, on every rank of the job's first start)."""
        if self._membership is not None and self._membership.replica_group is not None:
            return self._membership.replica_group
        # The hierarchy's in-node group: the engine's thread alone issues on it. The job's node group (`node_group`)
        # is the script's (SyncBatchNorm under scope=node all-reduces on it from the training thread).
        return discover().intra_group

    @property
    def members(self) -> list[int]:
        """The global ranks taking part in the syncs (all of the group's, unless on_lost_replica=continue lost some)."""
        if self._membership is not None:
            return list(self._membership.members)
        return dist.get_process_group_ranks(self.group)

    @property
    def started(self) -> bool:
        """Whether the anchors exist (the first inner step after the warm-up has begun)."""
        return self._fragments[0].anchors is not None

    @property
    def next_sync(self) -> int:
        """`steps` at which the next regular sync (of any fragment) starts."""
        return min(f.next_sync for f in self._fragments)

    @property
    def fragments(self) -> list[list[torch.Tensor]]:
        """The parameters of each fragment, in sync order."""
        return [list(f.params) for f in self._fragments]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The floating-point buffers averaged with the syncs."""
        return list(self._fragments[-1].buffers)

    @property
    def feedback(self) -> ErrorFeedback | None:
        """The outer codec's error feedback (this rank's residuals), or None for an exact codec."""
        return self._feedback

    def _least_interval(self) -> int:
        """auto's lower bound: a step of its own per fragment, and each sync applied before the next one starts."""
        return max(len(self._fragments), self.overlap, 1)

    # -- the inner loop ----------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Before an inner step's optimizer step: the first one after the warm-up takes rank 0's model on every rank
        and the anchors (a collective: every rank calls it at the same step)."""
        if not self.started and self.steps >= self.warmup:
            self._start()
        elif self._membership is not None and self._admit_at == self.steps:
            self._admit()

    def step(self) -> None:
        """An inner step ended: count it and apply or start the syncs now due."""
        self.steps += 1
        if self._membership is not None:
            training_began()  # the script's collectives on the default group are refused from now on
        if self.steps == self.warmup:
            self._timing = [None, [], 0.0]  # the warm-up's times included the exchange: auto measures local steps
        now = time.perf_counter()
        last, recent, _ = self._timing
        if last is not None:
            recent.append(now - last)
            del recent[:-AUTO_WINDOW]
        if self.started:
            last = self._fragments[-1]  # its sync applied now and none in flight: a join may follow
            round_applied = (last.pending is not None and last.pending[0] <= self.steps) or (
                last.next_sync == self.steps and not self.overlap
            )
            for fragment in self._fragments:  # results due now first: a fragment's next sync starts on them
                if fragment.pending is not None and fragment.pending[0] <= self.steps:
                    self._finish(fragment, outer=True)
            later = self._auto is not None and self._auto.measuring and self._auto.syncs_after_choosing  # by _choose
            for fragment in self._fragments:
                if fragment.next_sync == self.steps and not later:
                    self._begin(fragment, outer=True)
            if self._fragments[-1].next_sync == self.steps:  # the round's last fragment: the next round
                self._end_round()
            if self._membership is not None and round_applied and all(f.pending is None for f in self._fragments):
                self._admit_at = self.steps  # at the next inner step's start, on every member alike
            took = time.perf_counter() - now
            self._timing[2] += took
            now += took  # the next step's time leaves the syncs out
        self._timing[0] = now

    def _schedule(self, start: int) -> None:
        """The next round: fragment i syncs (i + 1) * interval / F steps after `start`, the last at `interval`."""
        count = len(self._fragments)
        for fragment in self._fragments:
            fragment.next_sync = start + (fragment.index + 1) * self.interval // count

    def _end_round(self) -> None:
        if self._auto is not None:
            self._choose()
        self._schedule(self.steps)

    def _choose(self) -> None:
        """auto: the setting from the measuring round's figures (at once), then the interval from each round's.

        Every rank's (median step, seconds exchanged) go through one MAX allreduce on the communication thread: the
        slowest step and the least wait for the exchanges (the others also waited for the slowest to arrive), the
        same figures on every rank, so every rank decides alike. After the measuring round they are read at the end
        of the next round, without waiting on the exchanges in flight.
        """
        auto = self._auto
        if auto.measuring and auto.broadcast is not None:  # its source's time is not the link's: only the others'
            auto.exchanged[:] = [math.inf if auto.broadcast.sent else auto.broadcast.seconds]
        elif auto.measuring and auto.probe:
            self._probe()
        recent = self._timing[1]
        self._timing[2] = 0.0
        exchanged = auto.take_exchanged(wait=auto.measuring)  # the measuring round's waited for its exchanges
        if auto.skip:
            auto.skip = False
            return
        step_s = sorted(recent)[len(recent) // 2] if recent else 0.0
        group = self._engine_group
        # The least drop of any rank's learning rate from its peak: every rank caps H alike.
        drop = auto.lr_drop(self.learning_rate() if self.learning_rate is not None else None)
        figures = [step_s, -exchanged, -drop, self.interval]
        measured = torch.tensor(figures, dtype=torch.float64, device=group_device(group))
        noise = auto.take_noise(measured.device)

        def slowest_over(group: Any, members: int = 0) -> torch.Tensor:
            # Each try of the membership's from the same figures; the noise copied to the group's device here, on
            # the communication thread, so the training thread does not wait for the device's work to read it.
            mine, spread = measured.clone(), noise.to(measured.device, copy=True)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(spread, group=group)  # the noise gauge's sums over every rank
            return torch.cat([mine, spread])

        if self._membership is not None:  # over the members present, decided alike as a sync is
            slowest = functools.partial(self._membership.run, f"auto@{self.steps}", slowest_over, self._hang_s())
        else:
            slowest = functools.partial(slowest_over, group)
        previous, self._measured = self._measured, sync_thread().submit(slowest, measured.device, self._groups())
        if auto.measuring:  # its syncs waited for their exchanges: nothing in flight, the ranks together
            step_s, least, drop, *_ = self._measured.wait().tolist()
            sync_thread().waited(self._measured)
            self._measured = None
            replicas = len(self.members)
            if self.scope == "node" and self._hierarchy is not None:
                replicas = self._hierarchy.topology.num_nodes
            probed, broadcast = auto.probe, auto.broadcast.nbytes if auto.broadcast is not None else 0
            figures = auto_setting.Measured(
                step_s, -least, self._codec.name, auto.elements, replicas, 0 if broadcast else probed, broadcast, -drop
            )
            fragments, codec = len(self._fragments), auto.given_codec
            self._take(auto_setting.choose(figures, auto.free, fragments, self.overlap, codec, len(self.params)))
            if auto.syncs_after_choosing:  # the round's change, synced now in the setting chosen and waited for: the
                # replicas average after the first round, as when a whole-model sync measures. Overlapped by a step,
                # this first sync ended seeds 2-3 points worse (docs/results.md#why-auto-chooses-as-it-does).
                for fragment in self._fragments:
                    self._begin(fragment, outer=True, wait=True)
            return
        if previous is None:
            return
        step_s, least, drop, interval, spread, signal = previous.wait().tolist()
        auto.rounds = [*auto.rounds[1 - auto_setting.ROUNDS :], (step_s, max(0.0, -least))]
        auto.gauged = [*auto.gauged[1 - auto_setting.GAUGE_ROUNDS :], (interval, spread, signal)]
        steps, exchanges = zip(*auto.rounds)
        median_step, median_exchanged = statistics.median(steps), statistics.median(exchanges)
        setting = auto_setting.rechoose(auto.setting, median_step, median_exchanged, -drop)
        if setting.interval != self.interval:
            ratio = auto.noise_ratio()
            if ratio is not None:  # (measured, not yet a reason: see auto_setting.GAUGE_ROUNDS)
                why = f"{setting.why}; the replicas' spread {ratio:.2f}x their mean change's square"
                setting = dataclasses.replace(setting, why=why)
            self.interval = setting.interval
            auto.say(setting)

    def _probe(self) -> None:
        """auto's measuring round for a model with a probe (auto_setting.probe_size): a sync's exchange of that many
        zeros, by the path the syncs take and timed as theirs are, in place of the whole model's (choose() scales it to
        the model), after an untimed one of PROBE_WARMUP of them (it connects, lines the peers up, spends any burst)."""
        change = torch.zeros(self._auto.probe, device=self.params[0].device)
        for tensor, timed in ((change[: auto_setting.PROBE_WARMUP], False), (change, True)):
            exchange = self._exchange("probe", tensor, None, f"probe@{self.steps}{'' if timed else '-first'}", timed)
            self.bytes_sent += sync_thread().run(exchange, change.device, self._groups())[2]

    def _take(self, setting: auto_setting.Setting) -> None:
        """auto's first choice, right after the measuring round's whole-model sync (or probe): fragments re-split (each
        tensor keeps its anchor and outer momentum), the codec (no residual yet: the syncs so far were exact),
        overlap."""
        auto = self._auto
        auto.measuring, auto.skip = False, True
        if setting.fragments != len(self._fragments):
            self._split(setting.fragments)
        if setting.codec != self._codec.name:
            self._use_codec(setting.codec)
        self.overlap, self.interval = setting.overlap, setting.interval
        auto.say(setting)

    def _split(self, count: int) -> None:
        """The parameters in `count` fragments (none in flight); each tensor keeps its anchor and outer state."""
        old = self._fragments
        params = [p for f in old for p in f.params]  # the local parts, in the order of self.params
        anchors = [a for f in old for a in f.anchors] if self.started else None
        kept = {id(a): f.outer.state[a] for f in old if f.outer is not None for a in f.anchors if a in f.outer.state}
        self._fragments, done = [], 0
        for i, run in enumerate(split_fragments(self.params, count)):
            part = slice(done, done + len(run))
            fragment = _Fragment(i, params[part], old[-1].buffers if i == count - 1 else [])
            if anchors is not None:
                fragment.anchors = anchors[part]
                fragment.outer = self._outer_over(fragment.anchors)
                for anchor in fragment.anchors if fragment.outer is not None else ():
                    if id(anchor) in kept:
                        fragment.outer.state[anchor] = kept[id(anchor)]
            self._fragments.append(fragment)
            done += len(run)

    def _use_codec(self, name: str) -> None:
        """The outer codec from now on, with fresh error feedback (call where no residual is held)."""
        device = self.params[0].device if self.params else None
        self._codec = get_codec(name, fp16_scale=self._auto.fp16_scale, device=device)
        self._feedback = ErrorFeedback() if self._codec.lossy else None
        if self._hierarchy is not None:
            self._hierarchy = _sync_hierarchy(self._hierarchy.topology, self._codec, self._feedback)

    def _resume_auto(self, state: dict[str, Any]) -> None:
        """auto resumed: the checkpoint's fragments, overlap and codec (its picks; the others were checked equal),
        still measuring if it was (a checkpoint without auto's state: as one taken before its choice)."""
        auto = self._auto
        saved = state.get("auto") or {"measuring": True}
        auto.measuring, auto.peak_lr = saved["measuring"], saved.get("peak_lr", 0.0)
        auto.rounds = [tuple(r) for r in saved.get("rounds", [])]  # (a checkpoint from before: none, as then)
        auto.gauged = [tuple(r) for r in saved.get("gauged", [])]
        noise = saved.get("noise")
        auto.noise = torch.tensor(noise, dtype=torch.float64, device=self.params[0].device) if noise else None
        auto.skip = saved.get("skip", False)
        auto.exchanged[:] = []
        if state["sync_fragments"] != len(self._fragments):
            self._split(state["sync_fragments"])
        self.overlap = state["sync_overlap"]
        codec = auto_setting.MEASURING_CODEC if auto.measuring else state["outer_compression"]
        if codec != self._codec.name:
            self._use_codec(codec)
        if not auto.measuring:
            fragments = len(self._fragments)
            auto.say(auto_setting.Setting(state["interval"], fragments, self.overlap, codec, "from the checkpoint"))

    def _codec_setting(self) -> str:
        """The outer codec as set: auto's measuring round syncs in full precision, but the setting is unchanged."""
        return self._auto.given_codec if self._auto is not None and self._auto.measuring else self._codec.name

    def note_equal(self, tensors: Iterable[torch.Tensor], broadcast: auto_setting.Broadcast | None = None) -> None:
        """`tensors` hold the same bits on every rank of the group now (just broadcast): the first inner step
        broadcasts the parameters again only if one of them has changed in place or been replaced since.
        `broadcast`: that broadcast timed (DDP's); where it crossed the links the syncs take, auto measures by it."""
        self._equal_at = {id(t): (t._version, t.data_ptr()) for t in tensors}
        if broadcast is not None and self._auto is not None and self._auto.measuring and self._times_the_link():
            self._auto.broadcast = broadcast

    def _times_the_link(self) -> bool:
        """Whether a broadcast over the group timed the link the syncs take: two replicas, one rank each (any
        broadcast is then one transfer to the other; with more, Gloo's tree shares the source's link among several,
        docs/communication.md), over Gloo (whose broadcast returns when it ends), in the flat exchange."""
        return (
            self._membership is None
            and not self.started
            and dist.get_world_size(self.group) == 2
            and (self.scope == "rank" or self._hierarchy is None or self._hierarchy.topology.num_nodes == 2)
            and backend_of(self.group, self.params[0].device) == "gloo"
        )

    def _still_equal(self) -> bool:
        """Whether every rank's parameters are still as `note_equal` saw them (a collective of one value)."""
        equal_at, self._equal_at = self._equal_at, None
        if equal_at is None:
            return False
        # A parameter changed in place (an optimizer step, load_state_dict, nn.init) has a new version; one replaced
        # (`param.data = ...`), a new pointer. A rank whose own are unchanged cannot know the others' are: all agree.
        mine = all(equal_at.get(id(p)) == (p._version, p.data_ptr()) for p in self.params)
        agreed = torch.tensor([int(mine)], device=group_device(self.group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agreed.item())

    def _start(self) -> None:
        """Rank 0's parameters and buffers on every rank, and the anchors (the first inner step is about to run).

        Parameters still as a broadcast left them on every rank (`note_equal`) are not sent again: on a slow link a
        whole model's broadcast is as long as a sync in full precision. Buffers are (a first forward changed them).
        """
        params = [p for fragment in self._fragments for p in fragment.params]
        if self._membership is not None and failfast.first_ranks() is not None:
            self._from_first_member([*params, *self._fragments[-1].buffers])
        else:
            tensors = [*([] if self._still_equal() else params), *self._fragments[-1].buffers]
            if tensors:
                broadcast_from_first(tensors, self.group)
        self._make_anchors()
        self._synced_buffers = [b.detach().float().clone() for b in self._fragments[-1].buffers]
        self.live_is_synced = True

    def _from_first_member(self, tensors: list[torch.Tensor]) -> None:
        """A job that grows: the lowest member's values in `tensors` on every member, over the members' group (the
        default group is a stand-in, and DDP's broadcast over it sent nothing), on the communication thread."""
        membership, device, groups = self._membership, self.params[0].device, by_dtype(tensors)

        def exchange(group: Any, members: int) -> list[torch.Tensor]:
            first = membership.rank == membership.members[0]
            flats = []
            for same in groups:
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                if not first:
                    flat.zero_()
                dist.all_reduce(flat, group=group)  # the first's values plus zeros: its bits (a try is repeatable)
                flats.append(flat)
            return flats

        share = functools.partial(membership.run, f"start@{self.steps}", exchange, self._hang_s())
        flats = sync_thread().run(share, device, self._groups())
        with torch.no_grad():
            for same, flat in zip(groups, flats):
                for tensor, value in zip(same, flat.split([t.numel() for t in same])):
                    tensor.copy_(value.view_as(tensor))

    def _make_anchors(self) -> None:
        for fragment in self._fragments:
            fragment.anchors = [kept_copy(p) for p in fragment.params]
            fragment.outer = self._outer_over(fragment.anchors)

    def _outer_over(self, anchors: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        """A fragment's outer optimizer over its anchors (None for average)."""
        if self.outer_optimizer == "average":
            return None
        lr, momentum = self._outer_settings
        nesterov = self.outer_optimizer == "nesterov" and momentum > 0  # torch's SGD refuses Nesterov without it
        return torch.optim.SGD(anchors, lr=lr, momentum=momentum, nesterov=nesterov)

    def _begin(self, fragment: _Fragment, outer: bool, wait: bool = False) -> None:
        """Start averaging a fragment's change (anchor - parameters) on the communication thread.

        A regular sync with sync_overlap is applied `overlap` steps later; any other (or with `wait`) finishes here.
        """
        if fragment.pending is not None:  # the schedules keep each sync apart; should one not, it is applied, not lost
            self._finish(fragment, outer=True)
        world = dist.get_world_size(self.group)
        node = self.scope == "node" and self._hierarchy is not None
        replicas = self._hierarchy.topology.num_nodes if node else world
        if self._membership is not None:
            replicas = world = 1  # divided by the members present when the sync runs
        measuring = self._auto is not None and self._auto.measuring  # auto's first round waits for its syncs
        overlapped = outer and self.overlap > 0 and not measuring and not wait
        with torch.no_grad():
            # The change, filled tensor by tensor from the anchors (pinned host memory for a GPU's) and the
            # parameters: a sync's only full-size device buffer (float32, divided: fp16/bf16 sums stay in range,
            # and every rank gets the same bits).
            change = _filled(fragment.params, fragment.anchors, fragment.params[0].device).div_(replicas)
            buffers = torch.cat([b.reshape(-1).float() for b in fragment.buffers]) if fragment.buffers else None
            snapshot = None  # what the steps taken while the exchange runs are measured from: at the anchors' home
            if overlapped:
                snapshot = fragment.snapshot = _snapshot(fragment.snapshot, [*fragment.params, *fragment.buffers])
        if buffers is not None:
            buffers.div_(world)
        if outer and self._auto is not None:  # the noise gauge: this replica's change, undivided, sampled
            stride = -(-change.numel() // auto_setting.GAUGE_ELEMENTS)
            mine = change[::stride] * replicas
            if self._membership is not None:  # the replicas present (nodes under node scope)
                membership = self._membership
                replicas = len(membership.nodes if membership.across is not None else membership.members)
            fragment.gauged = (mine, stride, replicas)
        name = f"{fragment.key}@{self.steps}{'' if outer else '-mean'}"  # the same on every member
        average = self._exchange(fragment.key, change, buffers, name, timed=outer and self._auto is not None)
        if overlapped and self._feedback is not None:  # a checkpoint meanwhile saves it (the encode may run before)
            fragment.residual_before = _residuals_of(self._feedback.residuals, fragment.key)
        # On a GPU: after this step's work, on the thread's stream.
        job = sync_thread().submit(average, change.device, self._groups())
        fragment.pending = (self.steps + (self.overlap if outer else 0), job, snapshot)
        if not overlapped:
            self._finish(fragment, outer)

    def _exchange(
        self, key: str, change: torch.Tensor, buffers: torch.Tensor | None, sync: str, timed: bool
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, int]]:
        """A sync's exchange of `change` and `buffers` (fragment `key`), for the communication thread: over the members
        present (on_lost_replica=continue, under the name `sync`), else over the group, in two levels where the
        hierarchy says; `timed`: auto times it."""
        if self._membership is not None:
            return self._among_members(key, change, buffers, sync, timed=timed)
        node = self.scope == "node" and self._hierarchy is not None
        hierarchy, codec, feedback, group = self._hierarchy, self._codec, self._feedback, self._engine_group
        average = functools.partial(_average, hierarchy, codec, feedback, group, key, change, buffers, node)
        return self._auto.timed(average, change.device) if timed else average

    def _groups(self) -> tuple:
        """The groups the syncs issue on (per-step jobs that issue on one of them next wait for the syncs before)."""
        return (self._engine_group, *(self._hierarchy.groups if self._hierarchy is not None else ()))

    def _hang_s(self) -> float | None:
        """How long a sync waits for a member alive but absent: hang_timeout (auto: from the recent step times)."""
        steps = sorted(self._timing[1])
        hang_s = hang_deadline(self._hang_timeout, [steps[len(steps) // 2] if steps else None])
        if hang_s is None and self._hang_timeout == "auto":  # no step timed yet: auto's least deadline
            hang_s = HANG_MIN_S
        return hang_s

    def _among_members(
        self, key: str, change: torch.Tensor, buffers: torch.Tensor | None, sync: str, timed: bool = False
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, int]]:
        """on_lost_replica=continue: the sync's exchange (of the fragment `key`) over the members present
        (`Membership.run`), each try from the same inputs and the residual as it was before the sync; `timed`: auto
        times the try that succeeded."""
        membership, codec, feedback = self._membership, self._codec, self._feedback
        hang_s = self._hang_s()
        # The fragment's residuals (flat: under `key`; in two levels: one per chunk, under (key, chunk))
        kept = {} if feedback is None else _residuals_of(feedback.residuals, key)

        def exchange(group: Any, members: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
            if feedback is not None:  # a try that is not applied leaves no trace in the residual
                _put_back(feedback.residuals, key, _residuals_of(kept, key))
            if membership.across is not None:  # the nodes present, in two levels (sync_scope=node)
                nodes = tuple(tuple(node) for node in membership.nodes)
                where = next(i for i, node in enumerate(nodes) if membership.rank in node)
                topology = Topology(membership.rank, members, nodes, where, None, membership.in_node, membership.across)
                hierarchy = _sync_hierarchy(topology, codec, feedback)
                mean = hierarchy.reduce(change.div(len(nodes)), key, replicated=True)[0].float()
                sent = hierarchy.bytes_sent  # (across nodes, as the syncs count it)
            else:
                mean, sent = _flat_exchange(codec, feedback, change.div(members), key, group)
                mean = mean.float()
            mine = None
            if buffers is not None:
                mine = buffers.div(members)
                dist.all_reduce(mine, group=group)
                sent += mine.numel() * mine.element_size()
            return mean, mine, sent

        timed_exchange = self._auto.timed(exchange, change.device) if timed else exchange
        return functools.partial(membership.run, sync, timed_exchange, hang_s)

    def _finish(self, fragment: _Fragment, outer: bool) -> None:
        """Apply a fragment's averaged change: the outer step (`outer`) or the replicas' mean (sync()).

        Steps taken while the exchange ran (sync_overlap) stay on top: what they changed since it began is added.
        """
        _, future, snapshot = fragment.pending
        fragment.pending = fragment.residual_before = None
        mean, buffers, sent = future.wait()
        sync_thread().waited(future)  # (a group may pass back to per-step jobs once every sync was waited for)
        self.bytes_sent += sent
        if self.nan_check != "off":
            self._check_finite(fragment, mean, buffers)
        if fragment.gauged is not None:
            self._auto.gauge(noise_figures(*fragment.gauged, mean))
            fragment.gauged = None
        with torch.no_grad():
            means = mean.split([a.numel() for a in fragment.anchors])
            if outer:  # the new anchors: the outer step on the mean change (average: the mean of the replicas)
                for chunk in _chunks(fragment.anchors):
                    with staged([fragment.anchors[i] for i in chunk], fragment.outer, mean.device):
                        if fragment.outer is not None:
                            for i in chunk:
                                fragment.anchors[i].grad = means[i].view_as(fragment.anchors[i])  # its "gradient"
                            fragment.outer.step()  # over this chunk's anchors: the others have no gradient
                            for i in chunk:
                                fragment.anchors[i].grad = None
                        else:
                            for i in chunk:
                                fragment.anchors[i].sub_(means[i].view_as(fragment.anchors[i]))
            tensors = [*fragment.params, *(fragment.buffers if buffers is not None else [])]
            values = [*fragment.anchors, *(buffers.split(sizes(fragment.buffers)) if buffers is not None else [])]
            then = snapshot.split(sizes(tensors)) if snapshot is not None else [None] * len(tensors)
            for i, (tensor, value, before) in enumerate(zip(tensors, values, then)):
                if not outer and i < len(fragment.params):  # sync(): the replicas' mean, the anchor untouched
                    value = value.to(mean.device, non_blocking=True) - means[i].view_as(value)  # (a new tensor)
                if before is None:  # from pinned host memory, in the stream's order: the host does not wait
                    tensor.copy_(value.view_as(tensor), non_blocking=True)
                else:
                    value = value.to(tensor.device, non_blocking=True).view_as(tensor)
                    before = before.to(tensor.device, non_blocking=True).view_as(tensor)
                    if tensor.dtype == torch.float32:  # in place: the same float32 operations, without a copy
                        tensor.sub_(before).add_(value)
                    else:  # in float32, rounded once to the tensor's dtype
                        tensor.copy_((tensor.float() - before).add_(value))
        if outer and buffers is not None:
            self._synced_buffers = [b.clone() for b in buffers.split(sizes(fragment.buffers))]
        if outer:
            self.syncs += 1
            if len(self._fragments) == 1 and snapshot is None:
                self.synced_at = self.steps
                self.live_is_synced = True

    def _check_finite(self, fragment: _Fragment, mean: torch.Tensor, buffers: torch.Tensor | None) -> None:
        """nan_check: a non-finite averaged change (the same bits on every rank, so every rank decides alike)."""
        if bool(mean.isfinite().all()) and (buffers is None or bool(buffers.isfinite().all())):
            return
        bad = [
            self._names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")
            for p, part in zip(fragment.params, mean.split(sizes(fragment.params)))
            if not bool(part.isfinite().all())
        ]
        if buffers is not None and not bool(buffers.isfinite().all()):
            bad.append("floating-point buffers")
        message = (
            f"non-finite parameter change averaged by sync_every={self.sync_every} at inner step {self.steps} in: "
            f"{', '.join(bad)} (nan_check={self.nan_check}): a replica stepped on non-finite gradients since the "
            "last sync"
        )
        if self.nan_check == "raise":
            raise FloatingPointError(message)
        log.warning(message)

    def drain(self) -> None:
        """Apply every exchange in flight now (before a look, a checkpoint or the end)."""
        for fragment in sorted(
            (f for f in self._fragments if f.pending is not None), key=lambda f: (f.pending[0], f.index)
        ):
            self._finish(fragment, outer=True)

    def sync(self, mid_step: bool = False) -> None:
        """Average the replicas now, into every rank's live parameters (a collective: call it on every rank).
        `mid_step`: an inner step has begun changing the parameters (some of its optimizers stepped)."""
        if not self.started or not dist.is_initialized():
            return  # nothing to average, or no group left to average over (after destroy_process_group())
        self.drain()
        if self.steps == self.synced_at and not mid_step:
            return
        for fragment in self._fragments:  # each fragment's replicas averaged in turn
            self._begin(fragment, outer=False)
        self.synced_at = self.steps
        self.live_is_synced = True  # until the live parameters change again

    def synced(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(live tensor, its value in the synced model) for each parameter and floating-point buffer. The synced
        model is each fragment's anchors (its last regular sync, or the start) and the buffers averaged with the last
        of them: the same bits on every rank, known without communication."""
        if not self.started:
            return []  # the warm-up, or no step yet: the replicas are equal, and the live model is it
        pairs = [(p, a) for f in self._fragments for p, a in zip(f.params, f.anchors)]
        return pairs + list(zip(self._fragments[-1].buffers, self._synced_buffers))

    def synced_values(self) -> dict[int, torch.Tensor]:
        """What `synced()` holds, by the id of each tensor as given (a sharded parameter itself, not its shard)."""
        pairs = self.synced()
        values = {id(p): value for p, (_, value) in zip(self.params, pairs)}
        values.update((id(b), value) for b, value in pairs[len(self.params) :])
        return values

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The anchors, the outer optimizers and the schedule, as of the last applied syncs: with the synced
        parameters, where every replica resumes. A sync still in flight is left to run."""
        measured = self._measured.wait().tolist() if self._measured is not None else None
        fragments = self._fragments
        return {
            "format": FORMAT,
            "sync_every": self.sync_every,
            "sync_scope": self.scope,
            "outer_optimizer": self.outer_optimizer,
            "sync_fragments": len(fragments),
            "sync_overlap": self.overlap,
            "warmup": self.warmup,
            "steps": self.steps,
            "interval": self.interval,
            "next_sync": [f.next_sync for f in fragments],
            "synced_at": self.synced_at,
            "syncs": self.syncs,
            "anchors": [a for f in fragments for a in f.anchors] if self.started else None,
            "outer": [f.outer.state_dict() if f.outer is not None else None for f in fragments],
            "outer_compression": self._codec_setting(),
            # What a lossy codec has not sent yet, and fp16's dynamic scales: part of the trajectory.
            "residuals": self._saved_residuals(),
            "scales": dict(getattr(self._codec, "scales", None) or {}),
            "timing": [self._timing[1], self._timing[2], measured],  # auto's measurements so far
            # auto's rounds so far and whether it skips the next: a replica that joins (or resumes) chooses H from the
            # same figures as the others, or its syncs fall at other steps than theirs
            "auto": {
                "measuring": self._auto.measuring,
                "peak_lr": self._auto.peak_lr,
                "rounds": [list(r) for r in self._auto.rounds],
                "gauged": [list(r) for r in self._auto.gauged],
                "noise": self._auto.noise.tolist() if self._auto.noise is not None else None,
                "skip": self._auto.skip,
            }
            if self._auto is not None
            else None,
        }

    def _saved_residuals(self) -> dict[Any, torch.Tensor]:
        """The residuals that go with the saved anchors: for a fragment whose sync is in flight, those from before
        its encode (which the syncs' thread may have run already), whole or per piece."""
        if self._feedback is None:
            return {}
        saved = dict(self._feedback.residuals)
        for fragment in self._fragments:
            if fragment.pending is not None and fragment.pending[2] is not None:  # overlapped: see _begin
                _put_back(saved, fragment.key, fragment.residual_before or {})
        return saved

    def load_state_dict(self, state: dict[str, Any], local: bool = True) -> None:
        """Resume from `state_dict()` (before the next inner step); `local`: the state was saved by this rank, so its
        residuals (what a lossy outer codec has not sent yet, this rank's own) apply here."""
        state = _upgrade(state)
        mine = {"sync_every": self.sync_every, "outer_optimizer": self.outer_optimizer, "warmup": self.warmup}
        mine["sync_scope"] = self.scope
        mine.update(sync_fragments=len(self._fragments), sync_overlap=self.overlap)
        mine["outer_compression"] = self._codec_setting()
        picked = self._auto.free if self._auto is not None else frozenset()
        for name, value in mine.items():
            if state[name] != value and name not in picked:  # what auto picks is taken from the checkpoint
                name = "sync_warmup" if name == "warmup" else name
                raise ValueError(f"the checkpoint was taken with {name}={state[name]!r}, this run has {name}={value!r}")
        if state["anchors"] is not None and len(state["anchors"]) != len(self.params):
            raise ValueError(
                f"the checkpoint holds {len(state['anchors'])} anchors, this model has {len(self.params)} parameters"
            )
        for fragment in self._fragments:  # every rank started these exchanges: waited for, their results dropped
            if fragment.pending is not None:
                fragment.pending[1].wait()
                fragment.pending = fragment.residual_before = fragment.gauged = None
        if self._auto is not None:
            self._resume_auto(state)
        self.steps, self.synced_at, self.syncs = state["steps"], state["synced_at"], state["syncs"]
        self.interval = state["interval"]
        for fragment, next_sync in zip(self._fragments, state["next_sync"]):
            fragment.next_sync = next_sync
        recent, took, measured = state["timing"]
        self._timing = [None, list(recent), took]
        self._measured = None
        if measured is not None:
            self._measured = torch.futures.Future()
            if len(measured) < 6:  # a checkpoint from before the learning rate's drop or the noise was measured
                measured = [*measured[:2], *(measured[2:3] or [-1.0]), state["interval"], 0.0, 0.0]
            self._measured.set_result(torch.tensor(measured, dtype=torch.float64))
        if state["anchors"] is None:
            for fragment in self._fragments:
                fragment.anchors = fragment.outer = None
            return
        self._make_anchors()
        saved = iter(state["anchors"])
        with torch.no_grad():
            for fragment, outer in zip(self._fragments, state["outer"]):
                for anchor in fragment.anchors:
                    anchor.copy_(next(saved))
                if fragment.outer is not None and outer is not None:
                    fragment.outer.load_state_dict(outer)
        self._synced_buffers = [b.detach().float().clone() for b in self._fragments[-1].buffers]  # loaded with them
        self.live_is_synced = False
        if self._feedback is not None and local:
            device = self.params[0].device  # loaded with map_location="cpu", say: they join this rank's tensors
            self._feedback.residuals = {key: value.to(device, copy=True) for key, value in state["residuals"].items()}
        if getattr(self._codec, "scales", None) is not None:
            self._codec.scales = {key: list(value) for key, value in state["scales"].items()}


# What each worker sends across nodes per piece of a sync in two levels (the hierarchy shards each chunk over the
# node's workers: a chunk of this size times the node's workers). Per-step buckets keep the hierarchy's 4 MiB chunks,
# where latency matters more; a sync is bulk, and at 512 KiB pieces (8 workers a node) it pays a round trip each.
SYNC_PIECE_MB = 4.0


# A gathered outer codec (int8, fp4) holds every replica's payload while it decodes: a flat sync exchanges its change
# in pieces of this many elements (16 MiB of float32), so that it holds replicas x one piece's payload (two pieces in
# flight), not replicas x the fragment's. Summable codecs go whole; a fragment of one piece keeps its residual under
# its own key, pieces under (key, piece).
GATHER_PIECE_ELEMENTS = 4 * 2**20


def noise_figures(mine: torch.Tensor, stride: int, replicas: int, mean: torch.Tensor) -> torch.Tensor:
    """A sync's (V, |D|^2) from `mine`, one replica's change at every `stride`-th element, and `mean`, the mean change
    of `replicas` replicas (all of it): the variance of a replica's change about the mean and the mean's square, a
    float64 pair on `mine`'s device (zeros from one replica)."""
    if replicas < 2:
        return torch.zeros(2, dtype=torch.float64, device=mine.device)
    with torch.no_grad():
        theirs = mean[::stride].to(mine.device, torch.float32)
        both = torch.stack([mine.dot(mine), mine.dot(theirs)]).double()
        # E|mine|^2 = |D|^2 + V and E[mine . mean] = |D|^2 + V / n (the codec's error is not in mine): V and |D|^2.
        spread = (both[0] - both[1]) * (replicas / (replicas - 1))
        return torch.stack([spread, both[1] - spread / replicas])


def _flat_exchange(
    codec: Codec, feedback: ErrorFeedback | None, change: torch.Tensor, key: str, group: Any
) -> tuple[torch.Tensor, int]:
    """A sync's exchange of `change` over `group`, flat (on the syncs' thread): the sum, written into `change` where
    it comes in pieces, and the bytes received. check=True: a sync every few steps can afford the host read, and the
    exact retry's sum names only the parameters that were not finite (a block codec's would spread them)."""
    whole = codec.summable or change.numel() <= GATHER_PIECE_ELEMENTS
    pieces = [change] if whole else list(change.split(GATHER_PIECE_ELEMENTS))
    keys = [key] if whole else [(key, i) for i in range(len(pieces))]
    started: list[tuple[torch.Tensor, Any]] = []
    sent = 0

    def finish(part: torch.Tensor, pending: Any) -> torch.Tensor:
        nonlocal sent
        outcome = pending.finish()
        sent += outcome.sent
        if not whole and outcome.result.data_ptr() != part.data_ptr():
            part.copy_(outcome.result)
        return outcome.result

    for part, k in zip(pieces, keys):
        out = part if feedback is not None else None  # folded into the residual: the sum may be decoded into it
        started.append((part, start_exchange(codec, feedback, part, k, group, out=out, check=True)))
        if len(started) > 1:  # the next piece crosses while this one decodes
            finish(*started.pop(0))
    last = finish(*started.pop(0))
    return (last if whole else change), sent


def _of(residual_key: Any, key: str) -> bool:
    """Whether a residual's key is fragment `key`'s: its own (flat), or one of its pieces' or chunks' (key, i)."""
    return residual_key == key or (isinstance(residual_key, tuple) and residual_key[0] == key)


def _residuals_of(residuals: dict[Any, torch.Tensor], key: str) -> dict[Any, torch.Tensor]:
    """Copies of fragment `key`'s residuals, whole or per piece or chunk."""
    return {k: v.clone() for k, v in residuals.items() if _of(k, key)}


def _put_back(residuals: dict[Any, torch.Tensor], key: str, kept: dict[Any, torch.Tensor]) -> None:
    """Fragment `key`'s residuals in `residuals` become `kept` (those of no other fragment change)."""
    for k in [k for k in residuals if _of(k, key)]:
        del residuals[k]
    residuals.update(kept)


def _sync_hierarchy(topology: Topology, codec: Codec, feedback: ErrorFeedback | None) -> HierarchicalReduce:
    """The two-level reduction of a sync: sums read for finiteness (every sync), pieces of SYNC_PIECE_MB across."""
    chunk_mb = SYNC_PIECE_MB * topology.local_size
    return HierarchicalReduce(topology, codec, feedback, chunk_mb=chunk_mb, check=True)


def _average(
    hierarchy: HierarchicalReduce | None,
    codec: Codec,
    feedback: ErrorFeedback | None,
    group: Any,
    key: str,
    change: torch.Tensor,
    buffers: torch.Tensor | None,
    node: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A sync's exchange over the whole group (on the communication thread): the mean change, buffers, bytes."""
    if hierarchy is not None:
        before = hierarchy.bytes_sent
        mean = hierarchy.reduce(change, key, replicated=node)[0]
        sent = hierarchy.bytes_sent - before
    else:
        mean, sent = _flat_exchange(codec, feedback, change, key, group)
        mean = mean.float()
    if buffers is not None:
        dist.all_reduce(buffers, group=group)
        sent += buffers.numel() * buffers.element_size()
    return mean, buffers, sent


# A sync's outer step runs this many float32 elements of anchors (and their momentum) at a time, on the parameters'
# device, each chunk staged there from the anchors' home and back: 64 MiB each, or one tensor if larger.
STAGE_ELEMENTS = 16 * 2**20


def _chunks(anchors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `anchors` in runs of about STAGE_ELEMENTS (the outer step's temporaries are a chunk's too)."""
    runs: list[list[int]] = [[]]
    held = 0
    for i, anchor in enumerate(anchors):
        if runs[-1] and held + anchor.numel() > STAGE_ELEMENTS:
            runs.append([])
            held = 0
        runs[-1].append(i)
        held += anchor.numel()
    return runs


def _filled(params: list[torch.Tensor], anchors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """anchor - parameter for each tensor, into one float32 buffer on `device` (the same float32 operations as on the
    whole: the parameter is widened exactly); the anchors are copied straight into it from their home."""
    out = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    for part, param, anchor in zip(out.split(sizes(params)), params, anchors):
        part.copy_(anchor.reshape(-1), non_blocking=True).sub_(param.detach().reshape(-1))
    return out


def _snapshot(kept: torch.Tensor | None, tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` now, in float32 at the anchors' home (`kept` reused where it fits): on a GPU the copies are queued on
    the current stream, which every later read of the snapshot follows."""
    total = sum(t.numel() for t in tensors)
    if kept is None or kept.numel() != total:
        home = anchor_home(tensors[0].device)
        pinned = home is not None
        kept = torch.empty(total, dtype=torch.float32, device=home or tensors[0].device, pin_memory=pinned)
    for part, tensor in zip(kept.split(sizes(tensors)), tensors):
        part.copy_(tensor.detach().reshape(-1), non_blocking=True)
    return kept


def anchor_home(device: torch.device) -> torch.device | None:
    """Where the anchors of parameters on `device` live: the host for a GPU's (None: beside the parameters).

    DiLoCo keeps float32 anchors and outer momentum, 2 to 4 times a bf16 model's bytes, and uses them once per sync:
    a GPU's memory is the scarce one. torchft keeps its backups in pinned host memory too.
    """
    return torch.device("cpu") if device.type == "cuda" else None


def kept_copy(tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A float32 copy of `tensor` at its `anchor_home`: pinned host memory for a GPU's tensor, else beside it
    (`non_blocking`: the caller waits for the device before the host reads it)."""
    home = anchor_home(tensor.device)
    if home is None:
        return tensor.detach().float().clone()
    kept = torch.empty(tensor.shape, dtype=torch.float32, device=home, pin_memory=True)
    return kept.copy_(tensor.detach(), non_blocking=non_blocking)


@contextlib.contextmanager
def staged(anchors: list[torch.Tensor], outer: torch.optim.Optimizer | None, device: torch.device):
    """Inside, `anchors` (and `outer`'s momentum) are on `device`, where the outer step runs; after, back at home.

    Anchors already on `device` are left as they are. Else each is swapped for a device copy (`.data`, so `outer` keeps
    its parameters) and copied back, the host waiting for the device once for all of them (not once per tensor).
    """
    if not anchors or anchors[0].device == device:
        yield
        return
    state = outer.state if outer is not None else {}
    homes = [a.data for a in anchors]
    kept = {}  # id(anchor) -> its momentum's home copy
    for anchor, home in zip(anchors, homes):
        anchor.data = home.to(device, non_blocking=True)
        buffer = state.get(anchor, {}).get("momentum_buffer")
        if buffer is not None:
            kept[id(anchor)] = buffer
            state[anchor]["momentum_buffer"] = buffer.to(device, non_blocking=True)
    try:
        yield
    finally:
        for anchor, home in zip(anchors, homes):
            home.copy_(anchor.data, non_blocking=True)  # pinned: queued on the stream; waited for below
            anchor.data = home
            buffer = state.get(anchor, {}).get("momentum_buffer")
            if buffer is not None and buffer.device != home.device:
                home_buffer = kept.get(id(anchor))  # None: made by this, the first, outer step; it gets a home
                if home_buffer is None:
                    home_buffer = kept_copy(buffer, non_blocking=True)
                else:
                    home_buffer.copy_(buffer, non_blocking=True)
                state[anchor]["momentum_buffer"] = home_buffer
        if device.type == "cuda":  # the homes are read on the host (checkpoints, a joiner's state): written by now
            torch.cuda.current_stream(device).synchronize()


def split_fragments(params: list[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    """`params` in `count` contiguous runs of about equal elements, none empty."""
    total = sum(p.numel() for p in params)
    runs: list[list[torch.Tensor]] = [[] for _ in range(count)]
    run, seen = 0, 0
    for i, p in enumerate(params):
        left = len(params) - i  # tensors not placed yet, this one included
        past_share = seen + p.numel() / 2 > total * (run + 1) / count  # most of this tensor beyond the run's share
        if runs[run] and run < count - 1 and (past_share or left <= count - run - 1):
            run += 1
        runs[run].append(p)
        seen += p.numel()
    return runs


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A state of an older format in this format's terms, or a one-line error."""
    if state.get("format") == FORMAT:
        return state if "sync_scope" in state else {**state, "sync_scope": "rank"}  # saved before sync_scope
    if state.get("format") != 1:
        raise ValueError(f"DiLoCo state of format {state.get('format')!r}; this version reads formats 1 and {FORMAT}")
    old = dict(state)  # format 1: one fragment, no overlap, auto's measurements not kept
    old.update(format=FORMAT, sync_fragments=1, sync_overlap=0, next_sync=[state["next_sync"]], outer=[state["outer"]])
    old["warmup"], old["sync_scope"] = state.get("warmup", 0), "rank"
    old["residuals"] = {("diloco/0" if k == "diloco" else k): v for k, v in state["residuals"].items()}
    old["timing"] = [[], 0.0, None]
    return old


def resolve(config: Config | None, given: dict[str, Any]) -> Config:
    """`given` options over `config`, or over init()'s configuration, or over the defaults."""
    base = config or current_config()
    if base is None:
        return Config.resolve(**given)
    return Config.resolve(env={}, **{**dataclasses.asdict(base), **given}) if given else base


def local_part(parameter: torch.Tensor) -> torch.Tensor:
    """What a sync averages of a parameter: itself, or a sharded one's own shard (a view of it; the replicas in
    the group hold the same shard of the same parameter)."""
    return parameter.detach().to_local() if hasattr(parameter, "to_local") else parameter


def sizes(tensors: list[torch.Tensor]) -> list[int]:
    return [t.numel() for t in tensors]
