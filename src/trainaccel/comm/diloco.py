"""Low-communication training (DiLoCo) applied to a model and the script's own loop: which steps are inner steps,
what a look sees, DDP's gradient exchange switched off. The algorithm itself (anchors, outer steps, fragments,
codecs, overlap) is `OuterSync` (comm/outer_sync.py).

Zero-code with `sync_every` (`trainaccel run --sync-every H`): every DDP model built after `init()` stops
exchanging gradients, and the script's own optimizers become the inner one: an inner step ends once every optimizer
holding the model's parameters has stepped (an AdamW and a SparseAdam for an embedding: both), or at the model's next
training forward. Explicitly:

    diloco = trainaccel.comm.DiLoCo(model, optimizer, sync_every=50)   # a DDP model, a module or parameters;
                                                                        # one optimizer or a list of them

Replicas differ between syncs; the synced model is the same on every rank: each fragment's anchors (its last regular
sync, or the start) and the buffers averaged with the last of them. A look sees the synced model and needs no other
rank, so looks may come on some ranks only (rank 0 saving, evaluating alone), in any number, at any step:
`state_dict()` of the model or of any module wrapping it holds the synced model; a forward with gradients off in eval
mode runs on it (the live replica is put back after); `.eval()` itself changes nothing. A forward with gradients off
in training mode (a GAN's samples, a rollout) runs on the live replica. A copy of the module (an EMA's deepcopy,
pickle) carries no hook that acts. `sync_replicas(model)`, on every rank, averages the live replicas now.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel

from trainaccel import context
from trainaccel.comm.auto_setting import Broadcast
from trainaccel.comm.outer_sync import OuterSync, resolve
from trainaccel.comm.scheduler import (
    COMM,
    SYNC,
    before_ddp_unused_map,
    comm_thread,
    engine_group,
    finish_queued_jobs,
    sync_thread,
)
from trainaccel.comm.topology import discover
from trainaccel.config import Config
from trainaccel.context import info_once, warn_once
from trainaccel.observer import OwnHook, observer_of, watch_optimizer_steps, wrapper_chain
from trainaccel.resilience import failfast, membership

# What the one-time warning says each scope was measured to cost: `sync_every=auto` on the text task (300 steps,
# AdamW), medians of 10 seeds at 500 and 100 Mbit/s, % above plain DDP's validation loss, by examples per worker
# (docs/results.md#syncing-every-few-steps-at-500-and-100-mbits; a test holds these to that table). The cost grows
# with a replica's batch, which the engine cannot see, so the warning quotes every batch measured.
AUTO_COST = {
    "node": {4: (1.3, 1.4), 16: (5.6, 5.8)},  # 2 nodes x 2 workers, a replica per node
    "rank": {4: (0.0, 0.2), 8: (1.0, 1.1), 16: (3.0, 3.5)},  # 2 single-worker nodes
}


def _cost(scope: str) -> str:
    """AUTO_COST[scope] in words: "0.0-0.2% ... at 4 examples per worker, 1.0-1.1% at 8 and ..."."""
    said = [f"{lo:.1f}%" if lo == hi else f"{lo:.1f}-{hi:.1f}%" for lo, hi in AUTO_COST[scope].values()]
    batches = list(AUTO_COST[scope])
    parts = [f"{said[0]} above plain DDP's validation loss at {batches[0]} examples per worker"]
    parts += [f"{cost} at {batch}" for cost, batch in zip(said[1:], batches[1:])]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


MEASURED = {
    "node": "each node's replica steps on its own workers' gradients between syncs. Measured on a small language "
    f"model (300 steps, AdamW, 2 nodes x 2 workers, median of 10 seeds: docs/results.md), sync_every=auto ended "
    f"{_cost('node')}: the larger a replica's batch, the more syncing every few steps costs",
    "rank": "each worker steps on its own gradients between syncs. Measured on a small language model (300 steps, "
    f"AdamW, 2 single-worker nodes, median of 10 seeds: docs/results.md), sync_every=auto ended {_cost('rank')}; "
    "on nodes of several workers a replica per worker costs more than one per node (2 nodes x 2 workers, every 2 "
    "steps: 1.8% against 0.2-0.4%, median of 3 seeds)",
}
# index -> instance, in creation order (the same on every rank); each lives as long as its module (its hooks hold it)
_live: weakref.WeakValueDictionary[int, DiLoCo] = weakref.WeakValueDictionary()
_made = 0  # DiLoCo objects made in this process since init: the next one's index
_real_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# Optimizers built since init(sync_every=...) (zero-code): a model's first inner step waits for each that holds it.
_built: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class DiLoCo:
    """Inner optimizer steps on each worker; every `sync_every` of them, the outer step on the averaged change."""

    __slots__ = {
        "index": "creation order in this process: names this model in the store on every rank",
        "outer": "the OuterSync doing the algorithm: anchors, outer optimizers, fragments, schedule, step count",
        "group": "the process group replicas are averaged over",
        "_module": "the module whose parameters are trained (a DDP model's module); None when given parameters",
        "_given": "whether the optimizers were given (their steps alone count) rather than found holding the model",
        "_holders": "the optimizers whose steps make one inner step: the given ones, or those seen stepping the model",
        "_known": "whether `_holders` is complete: given, or learned when the first inner step ended",
        "_stepped": "ids of the optimizers that stepped the model since the last inner step ended",
        "_backward_seen": "gradients reached the model's parameters since the last inner step ended",
        "_holding": "optimizer -> (parameter groups seen, whether it holds a parameter of the model), a cache",
        "_undo": "what detach() undoes: hooks, the module's train override, DDP's switched-off exchange",
        "_ddp": "the DDP model whose exchange is switched off once the warm-up is over (None: not DDP, or done)",
        "_innermost": "the module whose mode is the model's (Lightning switches its LightningModule, inside DDP's)",
        "_in_node": "under node scope, the state of the DDP hook that averages gradients (None under rank scope)",
        "__weakref__": "held weakly by process-wide tables",
    }

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.Tensor],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        sync_every: int | str | None = None,
        sync_scope: str | None = None,
        outer_optimizer: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        sync_warmup: int | None = None,
        sync_fragments: int | None = None,
        sync_overlap: int | None = None,
        on_lost_replica: str | None = None,
        process_group: Any = None,
        config: Config | None = None,
    ):
        global _made
        given = {"sync_every": sync_every, "sync_scope": sync_scope, "outer_optimizer": outer_optimizer}
        given["outer_lr"] = outer_lr
        given["outer_momentum"], given["sync_warmup"] = outer_momentum, sync_warmup
        given["sync_fragments"], given["sync_overlap"] = sync_fragments, sync_overlap
        given["on_lost_replica"] = on_lost_replica
        config = resolve(config, {k: v for k, v in given.items() if v is not None})  # OuterSync checks sync_every
        if config.sync_warmup and not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"sync_warmup={config.sync_warmup} needs a DDP model: its gradient exchange runs the warm-up steps"
            )
        if isinstance(model, DistributedDataParallel):
            process_group = process_group or model.process_group
        self.group = process_group or dist.group.WORLD
        scope = self._scope(config.sync_scope, model)
        if isinstance(model, DistributedDataParallel):
            _refuse_ddp_settings(model, scope)
        if config.on_lost_replica == "continue" and isinstance(model, torch.nn.Module):
            refuse_what_reaches_other_replicas(model, scope)
        names: dict[int, str] = {}
        if isinstance(model, torch.nn.Module):
            self._module = model.module if isinstance(model, DistributedDataParallel) else model
            names = {id(p): name for name, p in self._module.named_parameters()}
            params = list(self._module.parameters())
            buffers = [b for b in self._module.buffers() if b.is_floating_point()]
            self._innermost = wrapper_chain(self._module)[-1]
        else:  # parameters (the Horovod API's optimizer): no module to watch for looks, no buffers
            self._module, self._innermost, params, buffers = None, None, list(model), []
        self.outer = OuterSync(params, buffers, group=self.group, scope=scope, names=names, config=config)
        self.outer.inner_state = self._inner_state  # what a replica rejoining takes of this one's optimizers
        self.outer.learning_rate = self._learning_rate  # sync_every=auto lengthens H as a schedule lowers it
        self.index, _made = _made, _made + 1
        given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
        self._given, self._holders, self._known = bool(given), weakref.WeakSet(given), bool(given)
        self._stepped: set[int] = set()
        self._backward_seen = False
        self._holding: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]] = weakref.WeakKeyDictionary()
        self._undo: list[Any] = []
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._in_node = None
        if scope == "node":
            # Every worker during the warm-up, as plain DDP, over the engine's copy of DDP's group: DDP's own
            # collectives on its group come from the training thread (see _InNode).
            self._in_node = _InNode(engine_group(self.group, SYNC), model)
            self.outer.node_group()  # built now, on every rank (collective): the warm-up's end switches to it
            self._average_in_node(model, config.hierarchical)
        if self._ddp is not None and not self.outer.warmup:
            self._switch_off_exchange()
        if self._module is not None:
            self._watch_looks()
        self._watch_backward()
        _install()
        _live[self.index] = self
        warn_once(
            f"sync_every={self.sync_every} changes what is trained, not only how fast: {MEASURED[scope]}; "
            "measure it on your task (trainaccel bench quality) before relying on it"
        )
        streaming = ""
        fragments, overlap = len(self.outer.fragments), self.outer.overlap
        if fragments > 1 or overlap:
            streaming = f" in {fragments} staggered fragment(s), applied {overlap} step(s) later"
        info_once(
            f"sync_every={self.sync_every}: gradients stay on each "
            f"{'node (averaged over its workers every step)' if scope == 'node' else 'worker'}; every "
            f"{'few (chosen from measured times)' if self.sync_every == 'auto' else self.sync_every} optimizer steps "
            f"the replicas' change is averaged ({self.outer.outer_optimizer} outer step){streaming}"
        )

    def _scope(self, wanted: str, model: Any) -> str:
        """sync_scope resolved: node where a DDP model spans several nodes of equal size (>1 worker), else rank."""
        if wanted == "rank":
            return "rank"
        if isinstance(model, torch.nn.Module) and any(hasattr(p, "to_local") for p in model.parameters()):
            # shard=hybrid: FSDP2 already makes each node one replica; each rank's shard syncs with its counterparts.
            return "rank"
        if not isinstance(model, DistributedDataParallel):
            why = "not a DDP model, whose per-step gradient exchange would stay within each node"
        elif self.group is not dist.group.WORLD:
            why = "a process group other than the default"
        else:
            why = discover().why_flat()
        if why is None:
            return "node"
        if wanted == "node":
            warn_once(f"sync_scope=node: every worker is a replica of its own for this model ({why})")
        return "rank"

    def _average_in_node(self, model: DistributedDataParallel, hierarchical: str) -> None:
        """Node scope: DDP's buckets go through a hook of ours, registered at the first forward (so a script may
        register its own hook first: then this model falls back to rank scope, with a warning)."""
        handle = None

        def first_forward(module: torch.nn.Module, args: tuple) -> None:
            handle.remove()
            existing = model._get_ddp_logging_data().get("comm_hook")
            if not existing:
                model.register_comm_hook(self._in_node, _average_in_group)
                return
            if model.static_graph:
                raise ValueError(
                    f"sync_scope=node averages gradients within each node through a communication hook of its own, "
                    f"and the script registered {existing} on a static_graph=True model, which sync_scope=rank "
                    "cannot train (its first iteration needs the exchange): drop the script's hook or static_graph"
                )
            warn_once(
                f"sync_scope=node averages gradients within each node through a communication hook of its own, "
                f"and the script registered {existing}: every worker is a replica of its own (sync_scope=rank), "
                f"so the figures quoted when it started do not hold; {MEASURED['rank']}"
            )
            self._in_node = None
            self.outer.use_scope("rank", hierarchical)
            if self._ddp is None:  # past the warm-up: what rank scope switches off
                _keep_exchange_off(model, self._undo)

        handle = model.register_forward_pre_hook(first_forward)
        self._undo.append(handle.remove)

    # -- the algorithm's figures -------------------------------------------------------------------------------

    @property
    def sync_every(self) -> int | str:
        """Inner steps between syncs as configured: an integer, or auto."""
        return self.outer.sync_every

    @property
    def scope(self) -> str:
        """node (a node's workers average gradients every step: one replica per node) or rank (one each)."""
        return self.outer.scope

    @property
    def steps(self) -> int:
        """Inner steps so far (skipped steps count: every rank counts alike)."""
        return self.outer.steps

    @property
    def syncs(self) -> int:
        """Regular syncs (outer steps of a fragment) so far."""
        return self.outer.syncs

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put into syncs' allreduces."""
        return self.outer.bytes_sent

    @property
    def interval(self) -> int | str:
        """Inner steps between a fragment's syncs now (auto: chosen from the measured sync and step times)."""
        return self.outer.interval

    @property
    def next_sync(self) -> int:
        """`steps` at which the next regular sync (of any fragment) starts."""
        return self.outer.next_sync

    @property
    def members(self) -> list[int]:
        """The global ranks taking part in the syncs (fewer than the group's once on_lost_replica=continue left
        some out)."""
        return self.outer.members

    @property
    def fragments(self) -> list[list[torch.Tensor]]:
        """The parameters of each fragment, in sync order."""
        return self.outer.fragments

    # -- what the training loop drives -------------------------------------------------------------------------

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer`'s steps are part of this model's inner steps: a given one, or one holding a parameter."""
        if self._given:
            return optimizer in self._holders
        return self._touches(optimizer)

    def _touches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` holds a parameter of the model."""
        groups, holds = self._holding.get(optimizer, (-1, False))
        if groups != len(optimizer.param_groups):  # new, or add_param_group() since
            ids = {id(p) for p in self.outer.params}
            holds = any(id(p) in ids for group in optimizer.param_groups for p in group["params"])
            self._holding[optimizer] = (len(optimizer.param_groups), holds)
        return holds

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._holds(optimizer):
            return
        if _is_zero_redundancy(optimizer):
            # Each rank would step its shard on its own gradients alone and broadcast it: every parameter trained
            # on one worker's data, the replicas always equal and the syncs averaging nothing.
            raise RuntimeError(
                f"sync_every={self.sync_every} cannot train with ZeroRedundancyOptimizer: it steps each parameter on "
                "one rank, which would see only that rank's gradients between syncs; use its optimizer_class "
                "directly (each replica keeps its own optimizer state under sync_every)"
            )
        if self.outer.joined_inner:
            self._take_inner_state(optimizer)
        self.outer.prepare()

    def _inner_state(self) -> dict[int, dict]:
        """Each parameter's state in this replica's inner optimizers, by its index in the synced parameters (what a
        replica rejoining takes: `_take_inner_state`). A sharded parameter's state stays its own."""
        return optimizer_state_by_index(list(self._holders), self.outer.params)

    def _learning_rate(self) -> float | None:
        """The highest learning rate of the inner optimizers' parameter groups now (None: none known, or one not a
        number, as Adafactor's relative step)."""
        rates = [group.get("lr") for optimizer in list(self._holders) for group in optimizer.param_groups]
        rates = [float(r) for r in rates if isinstance(r, (int, float)) or (torch.is_tensor(r) and r.numel() == 1)]
        return max(rates) if rates else None

    def _take_inner_state(self, optimizer: torch.optim.Optimizer) -> None:
        """This replica rejoined: before its first step, `optimizer` takes the state a live member's optimizers had
        for the same parameters (`take_optimizer_state`)."""
        take_optimizer_state(optimizer, self.outer.params, self.outer.joined_inner)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._holds(optimizer):
            if self._given and self._touches(optimizer):
                warn_once(
                    f"DiLoCo: a {type(optimizer).__name__} that was not given also steps the model's parameters, "
                    "after or between the syncs: pass every optimizer of the model, DiLoCo(model, [opt1, opt2])"
                )
            return
        if optimizer not in self._holders:
            self._holders.add(optimizer)
            if self._known and not self._stepped:
                # It stepped after this iteration's inner step ended (built before init(), or stepping later on):
                # from the next iteration on the inner step waits for it too; this step counts in the ended one.
                info_once(
                    f"sync_every: another optimizer ({type(optimizer).__name__}) steps the model's parameters; "
                    "from the next step on, an inner step ends once it has stepped too"
                )
                return
        self._stepped.add(id(optimizer))
        self.outer.live_is_synced = False
        if self._known or self._module is None:
            expected = list(self._holders)
        else:  # the first inner step: every optimizer built holding the model, and any seen stepping it
            expected = [o for o in _built if self._holds(o)] + list(self._holders)
        if all(id(o) in self._stepped for o in expected):
            self._end_step()

    def _end_pending(self) -> None:
        """At the model's next training forward: the inner step in progress is over, whoever stepped in it."""
        if self._stepped:
            self._end_step()

    def _end_step(self) -> None:
        """An inner step ended (every optimizer holding the model stepped): the algorithm counts it and starts the
        syncs now due; at the warm-up's end, DDP's exchange is switched off."""
        self._stepped.clear()
        self._known, self._backward_seen = True, False
        self.outer.step()
        if self.outer.steps == self.outer.warmup and self._ddp is not None:
            self._switch_off_exchange()  # the warm-up's steps were DDP's: from the next step on, local steps

    def _cleared(self) -> None:
        """Gradients cleared (zero_grad) after a backward and before any optimizer stepped the model: the script
        skipped this step (`if not torch.isfinite(norm): continue`). Counted, as a GradScaler's skipped step is:
        gradients are each replica's own, so replicas skip different steps, and every rank must count alike."""
        if self._backward_seen and not self._stepped:
            info_once(
                "sync_every: gradients were cleared without an optimizer step (a skipped step); counted as an inner "
                "step, so that every rank syncs at the same iteration"
            )
            self._end_step()

    # -- looks -------------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Average the replicas now, into every rank's live parameters (a collective: call it on every rank)."""
        self.outer.sync(mid_step=bool(self._stepped))

    def synced(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(live tensor, its value in the synced model) for each parameter and floating-point buffer: what a look
        sees, the same bits on every rank, known without communication."""
        return self.outer.synced()

    def _shows_live(self) -> bool:
        """Whether the live replica is the synced model now (right after a sync of the whole model)."""
        return not self.outer.started or self.outer.live_is_synced

    def _show_synced(self) -> list[torch.Tensor] | None:
        """Before an evaluation forward: the synced model into the live tensors; returns what to put back."""
        if self._shows_live():
            return None
        pairs = self.synced()
        with torch.no_grad():
            kept = [tensor.detach().clone() for tensor, _ in pairs]
            for tensor, value in pairs:
                tensor.copy_(value.view_as(tensor))
        return kept

    def _put_back(self, kept: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for (tensor, _), value in zip(self.synced(), kept):
                tensor.copy_(value)

    def _in_eval_mode(self) -> bool:
        return not self._innermost.training

    def _watch_looks(self) -> None:
        """Hooks on the module (inert on copies of it; they keep this object alive as long as the module): a training
        forward ends the inner step in progress; an evaluation forward (gradients off, eval mode) runs on the synced
        model; state_dict() holds the synced model."""
        module, diloco = self._module, self
        shown: list[list[torch.Tensor] | None] = []  # what each evaluation forward in progress put aside (nested)

        def before_forward(module: torch.nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                diloco._end_pending()  # an optimizer that stepped since the last inner step did so in the one now over
                diloco.outer.live_is_synced = False  # this forward may change buffers (BatchNorm's statistics)
            elif diloco._in_eval_mode():
                shown.append(diloco._show_synced())
            else:
                shown.append(None)  # gradients off in training mode (a GAN's samples, a rollout): the live replica

        def after_forward(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not torch.is_grad_enabled() and shown:
                kept = shown.pop()
                if kept is not None:
                    diloco._put_back(kept)

        def after_state_dict(module: torch.nn.Module, destination: dict, prefix: str, metadata: dict) -> None:
            diloco._synced_state_dict(module, destination, prefix)

        innermost = self._innermost
        self._undo += [
            module.register_forward_pre_hook(OwnHook(module, before_forward)).remove,
            module.register_forward_hook(OwnHook(module, after_forward), always_call=True).remove,
            innermost.register_state_dict_post_hook(OwnHook(innermost, after_state_dict)).remove,
        ]

    def _watch_backward(self) -> None:
        seen = _BackwardSeen(self)
        params = [p for p in self.outer.params if not _is_dtensor(p)]
        self._undo += [p.register_post_accumulate_grad_hook(seen).remove for p in params]

    def _synced_state_dict(self, module: torch.nn.Module, destination: dict, prefix: str) -> None:
        """state_dict() holds the synced model, on any rank and at any step (no rank waits for another)."""
        if self._shows_live():
            return
        values = self.outer.synced_values()
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        saved: dict[int, torch.Tensor] = {}  # one entry per tensor: tied names (a head sharing the embedding) share it
        for name, tensor in named:
            key, value = prefix + name, values.get(id(tensor))
            if value is None or key not in destination:
                continue
            if isinstance(destination[key], torch.nn.Parameter):
                warn_once(
                    "state_dict(keep_vars=True) under sync_every returns the live parameters, each rank's own replica; "
                    "state_dict() returns the synced model, the same on every rank"
                )
                return
            if id(tensor) not in saved:
                saved[id(tensor)] = _as_saved(tensor, value)
            destination[key] = saved[id(tensor)]

    # -- DDP's own exchange --------------------------------------------------------------------------------------

    def _switch_off_exchange(self) -> None:
        """No gradient allreduce in backward (node scope: within the node only) and no buffer broadcast in forward:
        the syncs carry the rest."""
        model, self._ddp = self._ddp, None
        before = model.require_backward_grad_sync, model.broadcast_buffers
        in_node = self._in_node

        def restore() -> None:
            model.require_backward_grad_sync, model.broadcast_buffers = before
            if in_node is not None:  # the hook cannot be removed: every worker again, as in the warm-up
                in_node.group, in_node.queue = engine_group(self.group, SYNC), SYNC

        if in_node is not None:  # the node's workers, on the per-step thread: the syncs' thread may be busy
            in_node.group, in_node.queue = self.outer.node_group(), COMM
        else:
            _keep_exchange_off(model, self._undo)
        model.broadcast_buffers = False
        self._undo.append(restore)

    def _rewrap(self, model: DistributedDataParallel, hierarchical: str) -> None:
        """A new DDP model around this module: its exchange is switched off as the old one's was."""
        _refuse_ddp_settings(model, self.scope)
        in_warmup = self._ddp is not None
        self._ddp = model
        if not self._given:  # a new optimizer usually comes with the new wrapper: the holders are learned again
            self._holders, self._known = weakref.WeakSet(), False
        if self._in_node is not None:
            self._average_in_node(model, hierarchical)
        if not in_warmup:
            self._switch_off_exchange()
        info_once("sync_every: a module wrapped in DDP again keeps its replica, anchors and schedule")

    def detach(self) -> None:
        """Stop: hooks removed, DDP's exchange back as it was (`shutdown()`); the state stays readable."""
        if dist.is_initialized():
            self.outer.drain()  # every rank started these exchanges: their results are not dropped
        while self._undo:
            self._undo.pop()()
        _live.pop(self.index, None)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state (`OuterSync.state_dict()`): with the model's synced state (what its state_dict()
        holds), where every replica resumes."""
        return self.outer.state_dict()

    def load_state_dict(self, state: dict[str, Any], local: bool = True) -> None:
        """Resume from `state_dict()` (before the next inner step); `local`: the state was saved by this rank, so its
        residuals (what a lossy outer codec has not sent yet, this rank's own) apply here."""
        self.outer.load_state_dict(state, local)
        if self.outer.steps >= self.outer.warmup and self._ddp is not None:
            self._switch_off_exchange()  # resumed after the warm-up


def _of(model: torch.nn.Module) -> DiLoCo | None:
    """The DiLoCo `model` (or the module it wraps) trains under, if any."""
    for diloco in list(_live.values()):
        if diloco._module is not None and diloco._module in (model, getattr(model, "module", model)):
            return diloco
    return None


def note_broadcast(tensors: Iterable[torch.Tensor], group: Any = None) -> None:
    """`tensors` were just broadcast over `group` (default: the job's; `hvd.broadcast_parameters`): a model under
    sync_every whose parameters are all among them, at none of its inner steps yet, does not send them again."""
    group = group or dist.group.WORLD
    # By storage: a state_dict()'s values are other tensor objects over the parameters' memory.
    held = {(t.data_ptr(), t.numel(), t.dtype) for t in tensors if torch.is_tensor(t)}
    for diloco in list(_live.values()):
        outer = diloco.outer
        if (
            diloco.group is group
            and not outer.started
            and all((p.data_ptr(), p.numel(), p.dtype) in held and not hasattr(p, "to_local") for p in outer.params)
        ):
            outer.note_equal(outer.params)


def sync_replicas(model: torch.nn.Module) -> None:
    """Average a model's replicas now, on every rank, if it trains under sync_every (else nothing)."""
    diloco = _of(model)
    if diloco is not None:
        diloco.sync()


def rejoined_at(model: torch.nn.Module) -> int:
    """The step at which this replica rejoined a running job (on_lost_replica=continue, its rank started again; the
    inner step under sync_every): a script that can rejoin starts its loop after it, as one resuming from a checkpoint
    would. 0 otherwise."""
    diloco = _of(model)
    if diloco is not None:
        return diloco.outer.rejoined_at
    observer = observer_of(model)
    if observer is not None and observer.survivors is not None:  # per-step DDP under on_lost_replica=continue
        return observer.survivors.rejoined_at
    return 0


def members(model: torch.nn.Module) -> list[int]:
    """The global ranks training `model` now: under sync_every those in its syncs (fewer once on_lost_replica=continue
    left some out, more again after a rejoin), else every rank of the job. A script keeps its global batch with it."""
    diloco = _of(model)
    if diloco is not None:
        return diloco.members
    observer = observer_of(model)
    if observer is not None and observer.survivors is not None:  # per-step DDP under on_lost_replica=continue
        return observer.survivors.membership.members
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def attach(model: DistributedDataParallel, config: Config, broadcast: Broadcast | None = None) -> DiLoCo:
    """The zero-code form: `model` (just built under `init(sync_every=...)`) trains under DiLoCo; a module wrapped
    again (a new DDP model to unfreeze layers) keeps its DiLoCo, which takes over the new wrapper. `broadcast`: DDP
    has just broadcast rank 0's parameters over its group (its `init_sync`), so the first inner step need not."""
    diloco = next((d for d in _live.values() if d._module is model.module), None)
    trainable = [p for p in dict.fromkeys(model.module.parameters()) if p.requires_grad]
    if diloco is not None and [id(p) for p in trainable] != [id(p) for p in diloco.outer.params]:
        # Layers frozen or unfrozen since: the replicas averaged (every rank builds the new DDP model), then syncs
        # anew over the parameters trainable now, from that common model.
        info_once(
            "sync_every: the module was wrapped in DDP again with other trainable parameters; the replicas are "
            "averaged and the syncs start anew over the trainable ones (the outer optimizer's state starts empty)"
        )
        diloco.sync()
        diloco.detach()
        diloco = None
    if diloco is not None:
        diloco._rewrap(model, config.hierarchical)
    else:
        diloco = DiLoCo(model, config=config)
    if broadcast is not None and not diloco.outer.started and getattr(model, "process_group", None) is diloco.group:
        # DDP's broadcast (over the syncs' group) skips the parameters it ignores; a shard is not what it broadcast.
        skipped = getattr(model, "parameters_to_ignore", ())
        ignored = {id(p) for name, p in model.module.named_parameters() if name in skipped}
        ignored |= {id(p) for p in diloco.outer.params if hasattr(p, "to_local")}
        diloco.outer.note_equal((p for p in diloco.outer.params if id(p) not in ignored), broadcast)
    observer = observer_of(model)
    if observer is not None:
        observer.diloco = diloco
    return diloco


def _refuse_ddp_settings(model: DistributedDataParallel, scope: str) -> None:
    """The DDP settings whose gradient exchange sync_every cannot switch off, each refused in one line."""
    if scope == "rank" and model.static_graph:
        raise ValueError(
            "DDP's static_graph=True cannot train under sync_every with sync_scope=rank: its first iteration "
            "needs the gradient exchange that sync_every switches off (torch has no no_sync() there); build the "
            "model without static_graph, which has nothing to optimise without the exchange"
        )
    if getattr(model, "_delay_all_reduce_params", None):
        # DDP all-reduces these from a hook of its own, outside the reducer that no_sync() and the hooks govern.
        raise ValueError(
            "DDP's delay_all_reduce_named_params cannot train under sync_every: DDP all-reduces those parameters' "
            "gradients at every step from a hook of its own, which sync_every cannot switch off; build the model "
            "without it"
        )


def refuse_what_reaches_other_replicas(model: torch.nn.Module, scope: str, per_step: bool = False) -> None:
    """on_lost_replica=continue: collectives at every step over workers of other replicas would wait forever for a
    lost one (on NCCL until the watchdog ends every survivor); each refused in one line. `per_step`: DDP's own
    exchange runs at every step (no sync_every), so its map of used parameters spans every replica."""
    if isinstance(model, DistributedDataParallel) and (scope == "node" or per_step):
        if model.find_unused_parameters and not model.static_graph:
            where, lost, other = (
                ("", "replica", "") if per_step else (" with sync_scope=node", "node", " or use sync_scope=rank")
            )
            raise ValueError(
                f"on_lost_replica=continue{where} cannot train a DDP model built with find_unused_parameters=True: "
                "DDP all-reduces its map of used parameters over every worker at every step, which would wait for a "
                f"lost {lost} forever; build it with static_graph=True (the map is found once){other}"
            )
    if scope == "node":
        topology = discover()
        replica = set(topology.nodes[topology.node_index])
    else:
        replica = {dist.get_rank()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.SyncBatchNorm):
            group = module.process_group
            if dist.get_backend(group) == "fake":
                # Built over a stand-in default group (a rank started again, or a job that grows): it reduces nothing,
                # and the layer would normalise over this worker's batch alone where the others normalise over more.
                raise ValueError(
                    f"on_lost_replica=continue cannot train SyncBatchNorm {name!r} on a worker whose default group is "
                    "a stand-in (a rank started again to rejoin, or a job that grows): its group would reduce "
                    "nothing and it would normalise over this worker alone; keep plain BatchNorm"
                )
            ranks = set(dist.get_process_group_ranks(group)) if group is not None else set(range(dist.get_world_size()))
            if not ranks <= replica:
                within = (
                    "convert with trainaccel.batchnorm.convert_sync_batchnorm(scope='node')"
                    if scope == "node"
                    else "keep plain BatchNorm (each replica its own statistics)"
                )
                raise ValueError(
                    f"on_lost_replica=continue cannot train SyncBatchNorm {name!r} over ranks {sorted(ranks)}: it "
                    f"all-reduces its statistics at every step over workers of other replicas, which would wait for "
                    f"a lost one forever; {within}"
                )


def _keep_exchange_off(model: DistributedDataParallel, undo: list[Any]) -> None:
    """No gradient allreduce in DDP's backward, for good: what no_sync() sets, kept off at every forward, where a
    script may set it back (nanoGPT's `require_backward_grad_sync = last_micro_step`) and run plain DDP unseen."""

    def keep_off(model: DistributedDataParallel, args: tuple) -> None:
        if model.require_backward_grad_sync:
            model.require_backward_grad_sync = False
            info_once(
                "sync_every: the script turned DDP's gradient exchange on (require_backward_grad_sync=True); it stays "
                "off, since the replicas are averaged at syncs (gradient accumulation works as before)"
            )

    model.require_backward_grad_sync = False
    undo.append(model.register_forward_pre_hook(OwnHook(model, keep_off)).remove)


class _InNode:
    """State of the DDP hook that averages gradients under node scope."""

    __slots__ = {
        "group": "the engine's group buckets are averaged over: every worker (the warm-up), then the node's workers",
        "ddp_group": "DDP's own group, on which its reducer all-reduces the unused-parameter map (or None)",
        "queue": "the engine's thread the buckets' jobs run on: the syncs' in the warm-up (their group is the syncs' "
        "flat one, and no sync runs meanwhile), then the per-step thread (a sync may take seconds)",
    }

    def __init__(self, group: Any, model: DistributedDataParallel):
        self.group, self.queue = group, SYNC
        # DDP all-reduces its map of used parameters on its own group from the training thread, right after the last
        # bucket's hook (find_unused_parameters): that hook waits for its job first, so that every rank issues the
        # two in one order (NCCL may deadlock otherwise; Gloo aborts where they share a group).
        unused_map = model.find_unused_parameters and not getattr(model, "static_graph", False)
        self.ddp_group = (model.process_group or dist.group.WORLD) if unused_map else None


def _average_in_group(state, bucket):  # noqa: ANN001, ANN202 (DDP checks the annotations, which are strings here)
    """Average one DDP bucket over `state.group`, on the engine's thread `state.queue`: the group's collectives go out
    from that one thread, in one order on every rank."""
    group, tensor = state.group, bucket.buffer()

    def average() -> torch.Tensor:
        dist.all_reduce(tensor.div_(dist.get_world_size(group)), group=group)
        return tensor

    fut = (sync_thread() if state.queue == SYNC else comm_thread()).submit(average, tensor.device, (group,))
    if bucket.is_last() and state.ddp_group is not None:
        before_ddp_unused_map(fut, state.ddp_group, state.queue)
    return fut


class _BackwardSeen:
    """A parameter's post-accumulate-grad hook: notes that a backward reached the model (inert in copies)."""

    __slots__ = ("diloco",)

    def __init__(self, diloco: DiLoCo):
        self.diloco = weakref.ref(diloco)

    def __call__(self, parameter: torch.Tensor) -> None:
        diloco = self.diloco()
        if diloco is not None:
            diloco._backward_seen = True

    def __deepcopy__(self, memo: dict) -> Any:
        return _unseen()  # a copy's parameters belong to no DiLoCo

    def __reduce__(self) -> tuple:
        return (_unseen, ())


def _unseen() -> Any:
    hook = _BackwardSeen.__new__(_BackwardSeen)
    hook.diloco = lambda: None
    return hook


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local")


def _is_zero_redundancy(optimizer: torch.optim.Optimizer) -> bool:
    # Looked up, not imported: importing torch.distributed.optim warns of torch.jit's deprecation.
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _as_saved(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a float32 copy of `tensor`, or of a sharded one's own shard) as `tensor`'s state-dict entry."""
    if hasattr(tensor, "to_local"):  # a DTensor (shard=...): the same placement, this shard's synced values
        from torch.distributed.tensor import DTensor

        local = tensor.to_local()
        local = value.to(local.device, local.dtype).view_as(local)
        return DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride(), run_check=False
        )
    return value.to(tensor.device, tensor.dtype, copy=True).view_as(tensor)  # anchors may be in host memory


def _restore_attribute(owner: Any, name: str, value: Any) -> None:
    if value is None:
        owner.__dict__.pop(name, None)
    else:
        owner.__dict__[name] = value


# -- process-wide: optimizer steps, GradScaler's skipped steps, destroy_process_group, heartbeats ----------------


def optimizer_state_by_index(optimizers: list[torch.optim.Optimizer], params: list[torch.Tensor]) -> dict[int, dict]:
    """The optimizers' state of each of `params`, by its index there (what a replica rejoining takes). A sharded
    parameter's state stays its own."""
    index = {id(p): i for i, p in enumerate(params)}
    found = {}
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            i = index.get(id(param))
            if i is not None and state and not any(_is_dtensor(v) for v in state.values()):
                found[i] = dict(state)
    return found


def take_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], joined: dict[int, dict]) -> None:
    """A rejoined replica, before `optimizer`'s first step: it takes a live member's state (`joined`, by index in
    `params`: momentum, Adam's moments and step count) where its own is empty, through load_state_dict (which puts
    each value where the optimizer keeps it); what it took leaves `joined`."""
    index = {id(p): i for i, p in enumerate(params)}
    saved, taken, position = optimizer.state_dict(), 0, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            i = index.get(id(param))
            if i is not None and i in joined and not optimizer.state.get(param):
                saved["state"][position] = joined.pop(i)
                taken += 1
            position += 1
    if taken:
        optimizer.load_state_dict(saved)
        info_once(
            f"rejoined: the {type(optimizer).__name__}'s state of {taken} parameter(s) starts from a live "
            "replica's (its momentum and moments), not from nothing"
        )


def record_optimizers() -> None:
    """Note every optimizer built from now on (until `shutdown()`): a model's first inner step waits for each of its
    own, so the first sync already follows all of them."""
    if not context.first_time("optimizers built"):
        return
    original = torch.optim.Optimizer.__init__

    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _built.add(self)
        self.register_state_dict_post_hook(_stamp_saver)
        self.register_load_state_dict_pre_hook(_check_saver)

    context.patch(torch.optim.Optimizer, "__init__", __init__)
    context.on_undo("optimizers built", _built.clear)


# In an optimizer's state dict under sync_every (zero-code), the rank that saved it: {"rank", "world_size"}.
SAVED_BY_KEY = "trainaccel_saved_by"


def _stamp_saver(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Between syncs each rank's optimizer state is its own: its state dict names the rank it came from."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        state[SAVED_BY_KEY] = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}


def _check_saver(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Say once in the job when a rank loads an optimizer state another rank saved (Accelerate and the Trainer save
    rank 0's alone): said by the lowest rank that is not the saver, so one line stands for every such rank."""
    saved = state.pop(SAVED_BY_KEY, None)  # a copy torch made for its load: the script's dict keeps the stamp
    if not saved or not dist.is_initialized():
        return
    rank, saver = dist.get_rank(), saved.get("rank")
    if saver is None or saver == rank or rank != (1 if saver == 0 else 0):
        return
    warn_once(
        f"sync_every: rank {rank} loaded an optimizer state saved by rank {saver}, and so does every rank that loads "
        f"the same file: between syncs each rank's optimizer state (AdamW's moments, say) is its own, so these ranks "
        f"resume from rank {saver}'s and grow apart again from there; save and load each rank's own for an exact "
        "resume",
        every_rank=True,
    )


def _install() -> None:
    if not context.first_time("diloco"):
        return
    record_optimizers()
    watch_optimizer_steps(before=_before_any_step, after=_after_any_step)
    from torch.amp.grad_scaler import GradScaler

    context.patch(GradScaler, "step", _counting_skips(GradScaler.step))
    context.patch(torch.optim.Optimizer, "zero_grad", _noting_clears(torch.optim.Optimizer.zero_grad, _by_optimizer))
    context.patch(torch.nn.Module, "zero_grad", _noting_clears(torch.nn.Module.zero_grad, _by_module))
    destroy = distributed_c10d.destroy_process_group
    draining_destroy = _draining_first(destroy)
    context.patch(distributed_c10d, "destroy_process_group", draining_destroy)
    context.patch(dist, "destroy_process_group", draining_destroy)
    failfast.start_heartbeat()
    context.on_undo("diloco", _detach_all)


def _detach_all() -> None:
    global _made
    for diloco in list(_live.values()):
        diloco.detach()
    _real_steps.clear()
    _made = 0


def _before_any_step(optimizer: torch.optim.Optimizer) -> None:
    for diloco in list(_live.values()):
        diloco._before_step(optimizer)


def _after_any_step(optimizer: torch.optim.Optimizer) -> None:
    _real_steps[optimizer] = _real_steps.get(optimizer, 0) + 1
    for diloco in list(_live.values()):
        diloco._after_step(optimizer)


def _counting_skips(original: Any) -> Any:
    """GradScaler.step that counts a step it skipped (inf/NaN in this rank's gradients) as an inner step."""

    @functools.wraps(original)
    def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        before = _real_steps.get(optimizer, 0)
        result = original(self, optimizer, *args, **kwargs)
        if _real_steps.get(optimizer, 0) == before:
            # Gradients are this rank's own, so ranks skip different steps: counting attempts keeps syncs aligned.
            for diloco in list(_live.values()):
                diloco._before_step(optimizer)
                diloco._after_step(optimizer)
        return result

    return step


def _noting_clears(original: Any, trains: Any) -> Any:
    """`zero_grad` (an optimizer's or a module's) that tells each DiLoCo it concerns: a skipped step is counted."""

    @functools.wraps(original)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for diloco in list(_live.values()):
            if trains(diloco, self):
                diloco._cleared()
        return result

    return zero_grad


def _by_optimizer(diloco: DiLoCo, optimizer: torch.optim.Optimizer) -> bool:
    return diloco._holds(optimizer)


def _by_module(diloco: DiLoCo, module: torch.nn.Module) -> bool:
    return diloco._module is not None and diloco._module in (module, getattr(module, "module", None))


def _draining_first(destroy: Any) -> Any:
    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            for _, diloco in sorted(_live.items()):
                diloco.outer.drain()  # syncs in flight, which every rank started: applied before their group goes
            finish_queued_jobs()  # those of a model already dropped, and auto's figures, while their group lives
            if membership.abort_groups_holding_lost() and not dist.is_initialized():
                return None  # every group aborted: a lost peer's communicators would make a shutdown wait on it
        return destroy(group)

    return destroy_process_group
