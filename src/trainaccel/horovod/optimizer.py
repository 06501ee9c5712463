"""Horovod's `DistributedOptimizer`, `broadcast_parameters` and `broadcast_optimizer_state`.

Gradients are reduced in buckets of parameters. As soon as all of a bucket's gradients are ready
and every earlier bucket has been queued, the backward hook queues the bucket on the background
thread (`background`), which negotiates and starts the collectives in queue order: every rank
issues the same collectives in the same order, and backward never waits for the other ranks.
`step()` (or `synchronize()`) queues the buckets still waiting (parameters unused on this rank
count as zero), waits for them all and raises any error of theirs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm.exchange import say_fallback, start_exchange
from trainaccel.context import current_config, info_once, note_taken
from trainaccel.horovod import background, negotiation, ops
from trainaccel.horovod.basics import check_initialized
from trainaccel.horovod.compression import CodecCompression, Compression, Compressor
from trainaccel.horovod.ops import Adasum, Average, ReduceOp, Sum, broadcast_, broadcast_object
from trainaccel.horovod.process_sets import ProcessSet, resolve

BUCKET_BYTES = 25 * 2**20


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet | None = None) -> None:
    """Overwrite parameters (a `state_dict()` or `named_parameters()`) with the root's, in place."""
    check_initialized()
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
        if any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
            raise ValueError("broadcast_parameters needs a state_dict or a list of (name, tensor) pairs")
    else:
        raise ValueError(
            f"invalid params of type {type(params).__name__}; accepted: a dict or a list of (name, tensor)"
        )
    with torch.no_grad():
        for name, tensor in items:
            if torch.is_tensor(tensor):
                broadcast_(
                    tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank, str(name), process_set
                )
    from trainaccel.comm.diloco import note_broadcast  # (where DistributedOptimizer takes DiLoCo from)

    # A DistributedOptimizer's sync_every over these parameters need not broadcast them again at its first step.
    note_broadcast((tensor for _, tensor in items), process_set.group if process_set is not None else None)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None, process_set: ProcessSet | None = None
) -> None:
    """Give every rank the root's optimizer state and hyperparameters (any torch.optim optimizer).

    `model` tells which parameters are sparse embeddings, for a fresh optimizer's zero gradients.
    """
    check_initialized()
    if not optimizer.state:
        # Horovod leaves zero gradients on a fresh optimizer (from the zero-gradient step it takes
        # to create the state); scripts may read them. No step here: a step would apply weight
        # decay and start momentum and step counts, which a fresh torch optimizer has not done.
        _zero_missing_grads(optimizer, model)
    state = broadcast_object(optimizer.state_dict(), root_rank, process_set=process_set)
    if dist.get_rank() != root_rank:
        optimizer.load_state_dict(state)


def _zero_missing_grads(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's side effect on a fresh optimizer: a zero `.grad` on each trainable parameter without one."""
    sparse_params = set()
    if model is not None:
        sparse_params = {
            id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()
        }
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                grad = torch.zeros_like(p, memory_format=torch.preserve_format)
                # A dense zero would make the first sparse gradient accumulate into a dense one.
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_params
                ):
                    grad = grad.to_sparse()
                p.grad = grad


class _Bucket:
    """One launched bucket: its gradients' copy, then, once the background thread has started it, its handles."""

    def __init__(self, index: int, dense: list, sparse: list, flat: torch.Tensor | None):
        self.index, self.dense, self.sparse, self.flat = index, dense, sparse, flat
        self.handle: Any = None  # ops.Handle, or a codec's Pending
        self.ctx: Any = None
        self.outcome: Any = None  # a codec's finished exchange


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's own class, so `isinstance` checks still hold."""

    def _setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        num_groups: int,
        groups: list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        process_set: ProcessSet | None,
        sync_every: int | None = None,
    ) -> None:
        check_initialized()
        self._process_set = resolve(process_set) if process_set is None or process_set.included() else None
        if op == Adasum:
            raise ValueError("op=Adasum is not supported; accepted: Average, Sum")
        if op not in (Average, Sum):
            raise ValueError(f"invalid op={op!r}; accepted: Average, Sum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                f"invalid backward_passes_per_step={backward_passes_per_step!r}; accepted: an integer >= 1"
            )
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        names = self._names(named_parameters, params)
        self._compression, self._op, self._predivide = compression, op, gradient_predivide_factor
        self._passes_per_step, self._sparse_as_dense = backward_passes_per_step, sparse_as_dense
        self._buckets = self._make_buckets(params, num_groups, groups)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._parameter_names = {p: names[id(p)] for p in params}  # Horovod's attribute, read by some scripts
        self._passes: dict[int, int] = {}
        self._ready: list[set[int]] = [set() for _ in self._buckets]
        self._handles: list[Any] = [None] * len(self._buckets)  # each launched bucket's _Bucket
        self._next_bucket = 0
        self._jobs: list[torch.futures.Future] = []  # the background jobs of this step's buckets
        self._error: Exception | None = None  # the first error of a background job, raised by synchronize
        self._synchronized = False
        self._skip_synchronize = False
        self._diloco = None
        if sync_every is not None and self._process_set is not None:
            if compression is not Compression.none or backward_passes_per_step != 1:
                raise ValueError(
                    "sync_every replaces the per-step gradient exchange that compression and backward_passes_per_step "
                    "act on: leave them at their defaults (outer_compression compresses the syncs)"
                )
            from trainaccel.comm.diloco import DiLoCo

            # Low-communication training: no gradient exchange; this optimizer's steps are DiLoCo's inner steps.
            self._diloco = DiLoCo(params, self, sync_every=sync_every, process_group=self._process_set.group)
        # A worker outside the optimizer's process set trains on its own gradients, as does one under sync_every.
        exchanging = self._process_set is not None and self._diloco is None
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params] if exchanging else []

    @staticmethod
    def _names(
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None, params: list[torch.Tensor]
    ) -> dict[int, str]:
        if named_parameters is None:
            return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), usually model.named_parameters()"
            )
        seen: set[str] = set()
        duplicates = sorted({name for name, _ in pairs if name in seen or seen.add(name)})  # type: ignore[func-returns-value]
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {', '.join(duplicates)}")
        by_id = {id(p): name for name, p in pairs}
        missing = [p for p in params if id(p) not in by_id]
        if missing:
            shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
            raise ValueError(
                f"named_parameters was given, but {len(missing)} optimizer parameter(s) are not in it (shapes {shapes})"
            )
        return by_id

    @staticmethod
    def _make_buckets(
        params: list[torch.Tensor], num_groups: int, groups: list[list[torch.Tensor]] | None
    ) -> list[list[torch.Tensor]]:
        if groups is not None:
            if num_groups:
                raise ValueError("pass either groups or num_groups, not both")
            listed = [p for g in groups for p in g]
            extra = [p for p in params if all(p is not q for q in listed)]
            return [list(g) for g in groups if g] + [[p] for p in extra]
        ordered = list(reversed(params))  # backward produces gradients roughly from the last layer
        if num_groups:
            size = -(-len(ordered) // num_groups)
            return [ordered[i : i + size] for i in range(0, len(ordered), size)]
        buckets, current, current_bytes = [], [], 0
        for p in ordered:
            if current and current_bytes + p.numel() * p.element_size() > BUCKET_BYTES:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.numel() * p.element_size()
        return buckets + ([current] if current else [])

    def _grad_ready(self, p: torch.Tensor) -> None:
        count = self._passes.get(id(p), 0) + 1
        self._passes[id(p)] = count
        if count < self._passes_per_step:
            return
        bucket = self._bucket_of[id(p)]
        self._ready[bucket].add(id(p))
        self._synchronized = False
        while self._next_bucket < len(self._buckets) and len(self._ready[self._next_bucket]) == len(
            self._buckets[self._next_bucket]
        ):
            self._launch(self._next_bucket)

    def _launch(self, index: int) -> None:
        """Take a copy of the bucket's gradients and queue its negotiation and collective on the background thread."""
        grads, dense, sparse = [], [], []
        for p in self._buckets[index]:
            grad = p.grad
            if grad is None:  # unused on this rank: it still takes part, as zeros
                grad = torch.zeros_like(p)
            elif grad.is_sparse:
                if not self._sparse_as_dense:
                    sparse.append((p, grad))
                    continue
                grad = grad.to_dense()
            dense.append(p)
            grads.append(grad.reshape(-1))
        bucket = _Bucket(index, dense, sparse, torch.cat(grads) if grads else None)
        self._handles[index] = bucket
        self._next_bucket = index + 1
        device = self._buckets[index][0].device
        self._jobs.append(background.submit(lambda: self._start(bucket), device))

    def _start(self, bucket: _Bucket) -> None:
        """On the background thread: negotiate and start the bucket's collectives (its error kept for synchronize)."""
        if self._error is not None:  # every rank failed an earlier bucket alike: none starts the later ones
            return
        try:
            bucket.sparse = [
                (p, ops.sparse_allreduce_async(grad, None, self._op, self._process_set)) for p, grad in bucket.sparse
            ]
            flat = bucket.flat
            if flat is None:
                return
            if isinstance(self._compression, CodecCompression):
                bucket.handle = self._exchange(bucket.index, flat)
                return
            if self._predivide != 1.0:
                flat.div_(self._predivide)
            payload, bucket.ctx = self._compression.compress(flat)
            # Negotiated like any allreduce, so a worker that has called hvd.join() takes part.
            bucket.handle = ops.allreduce_async_(payload, op=Sum, process_set=self._process_set)
        except Exception as e:
            self._error = e

    def _exchange(self, index: int, flat: torch.Tensor) -> Any:
        """A sparsifying codec: values and indices are gathered, not summed, so join cannot take part."""
        ps = self._process_set
        negotiation.negotiate("allgather", f"bucket {index}", flat, among=ps)
        codec, feedback = self._compression.codec, self._compression.feedback
        return start_exchange(codec, feedback, flat, index, ps.group or dist.group.WORLD, 1.0 / self._predivide)

    def _finish_exchanges(self, buckets: list[_Bucket]) -> None:
        """On the background thread, in bucket order on every rank: a sum that is not finite is redone exactly."""
        if self._error is not None:
            return
        try:
            for bucket in buckets:
                if bucket.handle is not None:
                    bucket.outcome = bucket.handle.finish()
        except Exception as e:
            self._error = e

    def synchronize(self) -> None:
        """Finish reducing every gradient (starting buckets still waiting) and write them to `.grad`."""
        if self._synchronized or self._process_set is None or self._diloco is not None:
            return
        while self._next_bucket < len(self._buckets):
            self._launch(self._next_bucket)
        buckets: list[_Bucket] = self._handles
        if buckets and isinstance(self._compression, CodecCompression):
            device = self._buckets[0][0].device
            self._jobs.append(background.submit(lambda: self._finish_exchanges(buckets), device))
        for job in self._jobs:
            job.wait()  # on a GPU, this stream also waits for the thread's work on the results
        error = self._error
        if error is not None:
            self._reset()
            raise error
        world = self._process_set.size()
        for bucket in buckets:
            for p, wait in bucket.sparse:
                p.grad = wait()
            if bucket.handle is None:
                continue
            if bucket.outcome is not None:  # a codec's exchange
                if bucket.outcome.fallback is not None:
                    say_fallback(self._compression.name, f"bucket {bucket.index}", bucket.outcome.fallback)
                flat = bucket.outcome.result
            else:
                flat = self._compression.decompress(ops.synchronize(bucket.handle), bucket.ctx)
            if self._op == Average:
                flat = flat.div(world / self._predivide)
            offset = 0
            for p in bucket.dense:
                n = p.numel()
                reduced = flat[offset : offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = reduced.clone()
                elif p.grad.is_sparse:  # sparse_as_dense: the optimizer expects a sparse gradient back
                    p.grad = reduced.to_sparse()
                else:
                    p.grad.copy_(reduced)
                offset += n
        self._reset()
        self._synchronized = True

    def _reset(self) -> None:
        self._passes.clear()
        self._ready = [set() for _ in self._buckets]
        self._handles = [None] * len(self._buckets)
        self._next_bucket = 0
        self._jobs = []
        self._error = None

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, `step()` does not synchronize: for a `synchronize()` called by hand before it."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    @property
    def diloco(self) -> Any:
        """The `DiLoCo` of `sync_every`, or None."""
        return self._diloco

    def step(self, closure: Any = None) -> Any:
        if not self._skip_synchronize:
            if self._synchronized and self._process_set is not None:
                warnings.warn(
                    # Horovod's wording: scripts and Horovod's own tests match on it.
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(); "
                    "wrap step() in `with optimizer.skip_synchronize():` to say it is intended",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._next_bucket:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() "
                "but before optimizer.step() or optimizer.synchronize()"
            )
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] | CodecCompression = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = None,
    sync_every: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that `step()` applies gradients averaged over all workers (Horovod's API).

    With `sync_every=H` (trainaccel's): no gradient exchange; every H steps the parameters' change is averaged and
    applied by the outer optimizer (`trainaccel.comm.DiLoCo`, as `optimizer.diloco`; call `optimizer.diloco.sync()`
    on every rank to average before evaluating or saving).
    """
    compression, sync_every = _launch_options(compression, sync_every)
    methods = {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hyperparameters
    wrapped._setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        ReduceOp(op),
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
        process_set,
        sync_every,
    )
    return wrapped


# trainaccel run's (or init()'s) options, as the Horovod optimizer takes them when the script leaves its own default.
_CODECS = {
    "fp16": lambda config: Compression.fp16,
    "bf16": lambda config: Compression.bf16,
    "topk": lambda config: Compression.topk(config.compression_ratio),
    "randomk": lambda config: Compression.randomk(config.compression_ratio),
}


def _launch_options(
    compression: type[Compressor] | CodecCompression, sync_every: int | None
) -> tuple[type[Compressor] | CodecCompression, int | None]:
    """The launch's compression and sync_every where the script passed none; options that act on DDP models, which
    a Horovod script does not build, refused in one line each."""
    config = current_config()
    if config is None:
        return compression, sync_every
    refused = {
        "amp": (config.amp != "off", "autocasts a DDP model's forward"),
        "shard": (config.shard != "off", "shards a DDP model with FSDP2"),
        "compression": (config.compression == "powersgd", "is torch's DDP hook"),
        # Horovod's Compression.fp16 is its own: a cast, unscaled.
        "fp16_scale": (
            config.compression == "fp16" and config.fp16_scale != "auto",
            "scales the fp16 of trainaccel's DDP hook (Horovod's Compression.fp16 is an unscaled cast)",
        ),
        "sync_scope": (
            config.sync_every and config.sync_scope == "node",
            "under sync_every averages gradients within each node through a DDP hook (one replica per node)",
        ),
    }
    for name, (applies, why) in refused.items():
        if applies:
            value = getattr(config, name)
            raise ValueError(
                f"{name}={value} {why}, and a Horovod script trains through hvd.DistributedOptimizer, which it does "
                f"not reach: drop {name} from the launch (amp: torch.autocast in the script; sync_scope: rank, one "
                "replica per worker)"
            )
    note_taken("hvd.DistributedOptimizer")
    if compression is Compression.none and config.compression in _CODECS:
        compression = _CODECS[config.compression](config)
        info_once(f"hvd.DistributedOptimizer: compression={config.compression}, from the launch's options")
    if sync_every is None and config.sync_every:
        if config.sync_every == "auto":
            raise ValueError(
                "sync_every=auto is not taken by hvd.DistributedOptimizer: give an integer, or sync_every=H to it"
            )
        sync_every = config.sync_every
        info_once(f"hvd.DistributedOptimizer: sync_every={sync_every}, from the launch's options")
    return compression, sync_every
