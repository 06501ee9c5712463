"""`shard()`: a model sharded with FSDP2 (`fully_shard`) block by block, over every rank or within each node.

`full` shards every parameter over all ranks. `hybrid` shards within a node and replicates across
nodes (HSDP: a 2-D mesh, replicas across nodes, shards within one), so only gradient reductions
of whole replicas cross the slow link. Blocks are the submodules holding at least `min_params`
parameters not already in a smaller block, found bottom-up; the root takes the rest.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainaccel import context
from trainaccel.config import Config
from trainaccel.context import current_config, info_once
from trainaccel.devices import broadcast_from_first
from trainaccel.observer import observe, process_step, watch_optimizer_steps
from trainaccel.resilience import failfast

MODES = ("full", "hybrid")
_SPARSE = ("Embedding", "EmbeddingBag")


class ShardError(ValueError):
    """The model cannot be sharded as asked; the message names the module or parameter and why."""


def _check_shardable(model: Any) -> None:
    """Refuse what FSDP2 cannot keep: sparse gradients, and parameters that are not leaves of one module."""
    for name, module in model.named_modules():
        if type(module).__name__ in _SPARSE and getattr(module, "sparse", False):
            raise ShardError(
                f"cannot shard {name or type(model).__name__}: {type(module).__name__}(sparse=True) makes sparse "
                "gradients, which sharded parameters do not take; use sparse=False, or keep this model under DDP "
                "(trainaccel's sharded embeddings: trainaccel.embedding)"
            )


def _cast_output(module: Any, inputs: Any, output: Any, dtype: torch.dtype) -> Any:
    """A float32 batch norm's output, cast back to the mixed-precision dtype the layers after it compute in."""
    return output.to(dtype) if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def blocks(model: Any, min_params: int) -> list[tuple[str, Any]]:
    """The submodules to shard on their own, bottom-up: each holds >= `min_params` parameters no smaller block took.

    A parameter shared by two blocks cannot be sharded twice: the message names it and both owners.
    """
    owners: dict[int, str] = {}  # parameter id -> the block that took it
    chosen: list[tuple[str, Any]] = []

    def visit(name: str, module: Any) -> int:
        free = 0
        for child_name, child in module.named_children():
            free += visit(f"{name}.{child_name}" if name else child_name, child)
        own = [p for p in module.parameters(recurse=False)]
        free += sum(p.numel() for p in own if id(p) not in owners)
        if name and free >= min_params:
            taken = [p for p in module.parameters() if id(p) not in owners]
            for parameter in taken:
                owners[id(parameter)] = name
            chosen.append((name, module))
            return 0
        return free

    visit("", model)
    # Tied parameters: reachable from a block and from outside it (another block, or the root's own modules).
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = owners.get(id(parameter))
        if owner is not None and not (name == owner or name.startswith(f"{owner}.")):
            raise ShardError(
                f"cannot shard {owner!r} on its own: its parameter is also {name!r} (tied); raise min_params so "
                "that one block holds both, or untie them"
            )
    return chosen


def device_mesh(mode: str, process_group_backend: str | None = None) -> Any:
    """The mesh for `mode`: 1-D over every rank (`full`), or (nodes, ranks per node) named replicate, shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if mode not in MODES:
        raise ValueError(f"invalid mode={mode!r}; accepted: {', '.join(MODES)}")
    if not dist.is_initialized():
        raise RuntimeError("shard() needs the default process group: call dist.init_process_group() or init() first")
    backend = process_group_backend or dist.get_backend()
    device = "cuda" if "nccl" in str(backend) else "cpu"
    world = dist.get_world_size()
    if mode == "full":
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ShardError(
            f"hybrid sharding needs nodes of equal size: world {world}, {per_node} ranks on this node "
            "(LOCAL_WORLD_SIZE); use mode='full'"
        )
    return init_device_mesh(device, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def shard(
    model: Any,
    mode: str = "full",
    *,
    mesh: Any = None,
    min_params: int = 1_000_000,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    compression: str = "none",
    sync_every: int = 0,
) -> Any:
    """Shard `model` in place with `fully_shard`, block by block then the root; returns it (now an FSDP module).

    `mesh` overrides the one `mode` makes; `mp_policy` is FSDP2's MixedPrecisionPolicy. `compression` (hybrid
    only: fp16, bf16) sums the gradient shards across nodes through trainaccel's codec (`comm.register_fsdp`);
    `sync_every` (hybrid only) instead averages the replicas across nodes every N optimizer steps (DiLoCo).
    """
    from torch.distributed.fsdp import fully_shard

    if mode not in MODES:
        raise ValueError(f"invalid mode={mode!r}; accepted: {', '.join(MODES)}")
    require_torch(mode)
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"invalid min_params={min_params!r}; accepted: an integer >= 1 (parameters per block)")
    if compression != "none" and mode != "hybrid":
        raise ValueError(
            f"invalid compression={compression!r} with mode={mode!r}; accepted: none (a codec applies to the "
            "cross-node sum of mode='hybrid')"
        )
    if sync_every and (mode != "hybrid" or compression != "none"):
        raise ValueError(
            f"invalid sync_every={sync_every!r} with mode={mode!r}, compression={compression!r}; accepted: 0, or "
            "sync_every with mode='hybrid' and no compression (it replaces the per-step cross-node sum)"
        )
    _check_shardable(model)
    chosen = blocks(model, min_params)
    if mesh is None:
        mesh = device_mesh(mode)
    replicas = None
    if compression != "none" or sync_every:
        if mesh.ndim != 2:
            raise ValueError(f"compression and sync_every need a 2-D mesh (replicate, shard); got {mesh.ndim}-D")
        # FSDP2 reduces within the node only; across nodes, trainaccel's codec or DiLoCo's syncs.
        mesh, replicas = mesh["shard"], mesh["replicate"].get_group()
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32):
        # Batch norms compute in float32, as FSDP1 kept them out of mixed precision: cast to bf16 with their running
        # statistics left in float32 they fail ("expected scalar type BFloat16 but found Float"). Each is a unit of
        # its own whose policy keeps float32 and casts its input to it.
        from torch.distributed.fsdp import MixedPrecisionPolicy

        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
        norms = [
            m
            for m in model.modules()
            if isinstance(m, BATCH_NORMS) and m is not model and next(m.parameters(), None) is not None
        ]
        for norm in norms:
            fully_shard(norm, **{**options, "mp_policy": full})
            # Its float32 output goes on into layers computing in the policy's dtype; only a unit's own inputs are
            # cast, so a layer sharing the enclosing unit failed on it ("mat1 and mat2 must have the same dtype").
            norm.register_forward_hook(functools.partial(_cast_output, dtype=mp_policy.param_dtype))
        chosen = [(name, module) for name, module in chosen if all(module is not norm for norm in norms)]
    for _, module in chosen:
        fully_shard(module, **options)
    sharded = fully_shard(model, **options)
    if replicas is not None and sync_every:
        from trainaccel.comm.diloco import DiLoCo

        DiLoCo(sharded, sync_every=sync_every, process_group=replicas)  # kept by the module's hooks
    elif replicas is not None:
        from trainaccel.comm.fsdp import register_fsdp

        register_fsdp(sharded, replicas, compression=compression)
    return sharded


OLDEST_TORCH = (2, 9)  # sharding's own floor, above the package's (2.7)


def require_torch(mode: str) -> None:
    """Sharding only on a torch whose FSDP2 was seen to train as DDP here; a one-line refusal elsewhere."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < OLDEST_TORCH:
        raise ShardError(
            f"shard={mode} needs torch {'.'.join(map(str, OLDEST_TORCH))} or later, and this is torch "
            f"{torch.__version__}: on 2.7 FSDP2's hybrid sharding fails on Gloo (ReduceOp.AVG) and full sharding "
            "ended off plain DDP's losses in our tests; upgrade torch, or use shard=off"
        )


BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


# -- zero-code: `trainaccel run --shard full|hybrid` -------------------------------------------------------------


class ShardedDataParallel(DistributedDataParallel):
    """What `DistributedDataParallel(model, ...)` builds under `shard=full|hybrid`: `model` sharded with FSDP2.

    It keeps DDP's face: `.module`, forward, `no_sync()`, and `state_dict()`/`load_state_dict()` with DDP's keys
    (a full state dict, on rank 0; loading takes rank 0's and broadcasts it).
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        config = current_config()
        bound = _DDP_SIGNATURE.bind(self, module, *args, **kwargs).arguments
        bound.pop("self")
        _refuse_ddp_arguments(bound, config.shard)
        torch.nn.Module.__init__(self)
        _broadcast_from_rank0(module)  # DDP starts every replica from rank 0's values; FSDP2 does not
        before = dict(module.named_parameters())
        self.module = shard(
            module,
            config.shard,
            mp_policy=_mp_policy(config),
            compression=config.compression,
            min_params=config.shard_min_params,
            sync_every=config.sync_every,
        )
        _remember_replaced(before, dict(module.named_parameters()))
        _full_state_dicts(self.module)
        self.broadcast_buffers = bound.get("broadcast_buffers", True)
        self.find_unused_parameters = bound.get("find_unused_parameters", False)
        if self.find_unused_parameters:
            if not hasattr(self.module, "set_reduce_scatter_unused_params"):
                raise ShardError(
                    f"DistributedDataParallel(find_unused_parameters=True) under shard={config.shard} needs torch "
                    f"2.13 or later (FSDP2's set_reduce_scatter_unused_params), and this is torch {torch.__version__}: "
                    "upgrade torch, or use shard=off"
                )
            # As DDP: a parameter this rank's forward did not use is reduced with a zero gradient from it.
            self.module.set_reduce_scatter_unused_params(True)
        self.device_ids = bound.get("device_ids")
        self.dim = bound.get("dim", 0)
        self.static_graph = bound.get("static_graph", False)  # read by frameworks (Lightning's teardown)
        self.shard_mode = config.shard
        self.mixed_precision = config.amp != "off"  # FSDP2's MixedPrecisionPolicy: see no_sync()
        # Heartbeats and the step counter, as for a DDP model: a stalled peer is named, not only timed out.
        observe(self)
        failfast.start_heartbeat()
        _live.append(weakref.ref(module))
        global _wraps
        _wraps += 1

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.training and torch.is_grad_enabled():
            broadcast_from_first(list(self.module.buffers()))  # as DDP: every replica's buffers (BatchNorm's) rank 0's
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Gradients accumulate unreduced (unsharded, in full) until the first backward outside the block."""
        if self.mixed_precision:
            # FSDP2's accumulation without reduction fails under its MixedPrecisionPolicy when a pass leaves a
            # parameter unused (pytorch/pytorch#196996): reduced at every pass instead, the sharded gradients
            # add up to the same sum.
            info_once(
                f"no_sync() under shard={self.shard_mode} with amp=bf16 reduces at every pass (the same "
                "accumulated gradients, more communication): FSDP2 cannot accumulate unreduced gradients under "
                "mixed precision when a pass leaves a parameter unused"
            )
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise ShardError(
            f"register_comm_hook: under shard={self.shard_mode} FSDP2 reduces the gradients, not DDP; use "
            "compression (hybrid) for trainaccel's codecs, or shard=off for a DDP hook"
        )

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """DDP's own summary, as frameworks read it (Lightning at its teardown): no DDP reducer or hook here."""
        return {"comm_hook": "", "can_set_static_graph": False, "trainaccel_shard": self.shard_mode}

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise ShardError(f"join(): uneven inputs are not supported under shard={self.shard_mode}; use shard=off")

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        inner = {key.removeprefix("module."): value for key, value in state_dict.items()}
        return self.module.load_state_dict(inner, strict=strict, assign=assign)


_DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__)
# DDP arguments FSDP2 has no counterpart for: each refused with why, rather than ignored.
_UNSUPPORTED = {
    "process_group": "a group other than the default one (sharding spans the default group)",
    "device_mesh": "a DDP device mesh (sharding builds its own)",
    "mixed_precision": "DDP's own mixed precision (use amp=bf16: FSDP2's MixedPrecisionPolicy)",
    "delay_all_reduce_named_params": "delayed all-reduces",
    "param_to_hook_all_reduce": "delayed all-reduces",
}
# The sharded modules, made whole at the end: in the order they were built, the same on every rank.
_live: list[weakref.ref] = []
# id(a parameter fully_shard replaced) -> weak references to it and to its sharded replacement
_replaced: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_wraps = 0  # models sharded by the wrap so far in this process: optimizers are checked again after each
# optimizer -> (_wraps, its param groups) when it was last checked
_rebound: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()


def _refuse_ddp_arguments(bound: dict[str, Any], mode: str) -> None:
    for name, why in _UNSUPPORTED.items():
        value = bound.get(name)
        if value is not None and not (name == "process_group" and value is dist.group.WORLD):
            raise ShardError(f"DistributedDataParallel({name}=...) under shard={mode}: not supported: {why}")


def _mp_policy(config: Config) -> Any:
    if config.amp == "off":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # Computation and the gathers in bf16; gradients reduced and kept in float32, as autocast keeps them.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _broadcast_from_rank0(module: torch.nn.Module) -> None:
    broadcast_from_first([*module.parameters(), *module.buffers()])  # meta ones: the same seed on every rank


def _remember_replaced(before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter]) -> None:
    for name, old in before.items():
        if after[name] is not old:
            key = id(old)
            # Weak both ways: the entry goes with the old parameter, and holds no model alive.
            _replaced[key] = (weakref.ref(old, lambda _, key=key: _replaced.pop(key, None)), weakref.ref(after[name]))


def _rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer built on the parameters before sharding steps the sharded ones instead (before its first step)."""
    checked = (_wraps, len(optimizer.param_groups))
    if _rebound.get(optimizer) == checked:
        return  # checked, and no model sharded nor group added since: nothing per step
    for group in optimizer.param_groups:
        params = group["params"]
        for i, parameter in enumerate(params):
            entry = _replaced.get(id(parameter))
            sharded = entry[1]() if entry is not None and entry[0]() is parameter else None
            if sharded is None:
                continue
            if optimizer.state.get(parameter):
                raise ShardError(
                    f"{type(optimizer).__name__} holds state for a parameter that sharding replaced (it stepped, or "
                    "loaded its state, before DistributedDataParallel(model) was built): build the optimizer, or "
                    "load its state, after the model is wrapped"
                )
            params[i] = sharded
    _rebound[optimizer] = checked


def _full_state_dicts(module: torch.nn.Module) -> None:
    """`module.state_dict()` / `load_state_dict()`: the full state dict on rank 0 (torch's DCP helpers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    cls = type(module)
    inside = [False]  # torch's helpers call module.state_dict() themselves: that call is the class's own

    def state_dict(*args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if inside[0] or _native:
            return cls.state_dict(module, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        _all_ranks("state_dict()")
        inside[0] = True
        try:
            full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        finally:
            inside[0] = False
        destination = collections.OrderedDict() if destination is None else destination
        for key, value in _tied_as_one(module, full).items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if inside[0] or _native:
            return cls.load_state_dict(module, state_dict, strict=strict, assign=assign)
        _all_ranks("load_state_dict()")
        inside[0] = True
        try:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
            # A copy: torch's helper puts the loaded shards into the dict it is given.
            result = set_model_state_dict(module, dict(state_dict), options=options)
            # The keys as a module's own load reports them: torch's helper fills a name left out with the module's
            # value, so a tied name the file holds once (safetensors) would not show as missing, and load_model
            # would call it unexpected. Only rank 0's dict is loaded (and its state_dict() is the full one).
            own, given = cls.state_dict(module).keys(), set(state_dict) if dist.get_rank() == 0 else set()
            missing = [k for k in own if k not in given] if given else []
            unexpected = [k for k in given if k not in own]
            return result._replace(missing_keys=missing, unexpected_keys=unexpected)
        finally:
            inside[0] = False

    module.state_dict = state_dict
    module.load_state_dict = load_state_dict


def _tied_as_one(module: torch.nn.Module, full: dict[str, Any]) -> dict[str, Any]:
    """`full` with the names of one shared Parameter (a head tied to the embedding) holding one tensor, as a module's
    own state_dict() holds them: torch's helper copies each name's to the host apart, which safetensors then refuses."""
    names: dict[int, list[str]] = {}
    for name, param in type(module).named_parameters(module, remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for tied in names.values():
        present = [name for name in tied if name in full]
        for name in present[1:]:
            full[name] = full[present[0]]
    return full


_native: list[bool] = []  # non-empty within native_state_dicts()


@contextlib.contextmanager
def native_state_dicts() -> Any:
    """Within the block, a zero-code sharded module's state_dict()/load_state_dict() are FSDP2's own (DTensor
    shards), e.g. for `torch.distributed.checkpoint` through `get_model_state_dict(model.module)`."""
    _native.append(True)
    try:
        yield
    finally:
        _native.pop()


def _all_ranks(what: str) -> None:
    """Gathering or scattering a sharded model needs every rank: one that calls alone fails here, loudly.

    Each rank marks its call in the store. A peer whose heartbeat shows a later step than this rank's has
    trained on without calling (it waits in this rank's next gather): the call fails at once, naming it. Else
    it fails after 0.9 x collective_timeout, before the peers' own timeout, so that the cause is named first.
    """
    timeout = 0.9 * failfast.collective_timeout_s()
    world, rank = dist.get_world_size(), dist.get_rank()
    _calls[what] = _calls.get(what, 0) + 1
    if world == 1:
        return
    key = f"trainaccel/shard/{what}/{_calls[what]}/"
    mine = process_step()  # this rank's own step: live, not its beat

    def moved_on(beat: dict) -> bool:
        return beat.get("step", -1) > mine

    peers = {other: other for other in range(world) if other != rank}
    ahead, pending = failfast.await_peers(key, rank, peers, moved_on, timeout)
    if ahead or pending:
        why = (
            f"rank(s) {ahead} trained on past step {mine} without calling it"
            if ahead
            else f"rank(s) {pending} did not call it within {timeout:.0f} s"
        )
        raise ShardError(
            f"{what} of a sharded model gathers from every rank, and not every rank called it: {why} (call it "
            "on every rank; save on rank 0 only)"
        )


_calls: dict[str, int] = {}  # calls of each every-rank operation so far: the store key of the next one


def full_parameters(module: torch.nn.Module) -> None:
    """Replace every sharded parameter of `module` by a plain one holding the whole value (collective)."""
    with torch.no_grad():
        for name, parameter in list(module.named_parameters()):
            if isinstance(parameter, DTensor):
                owner_name, _, leaf = name.rpartition(".")
                whole = torch.nn.Parameter(parameter.full_tensor(), requires_grad=parameter.requires_grad)
                setattr(module.get_submodule(owner_name), leaf, whole)


def install() -> None:
    """Every `DistributedDataParallel(model)` built from now on under `shard` is a ShardedDataParallel (undone by
    shutdown; the config is read at each construction)."""
    require_torch(current_config().shard if current_config() is not None else "full")
    if not context.first_time("DDP sharding"):
        return

    original = DistributedDataParallel.__init__  # torch's, or the DDP patch's (which adds trainaccel's hook)

    @functools.wraps(original)
    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        config = current_config()
        if type(self) is DistributedDataParallel and config is not None and config.shard != "off":
            object.__setattr__(self, "__class__", ShardedDataParallel)  # a subclass: isinstance(model, DDP) holds
            ShardedDataParallel.__init__(self, *args, **kwargs)
        else:
            original(self, *args, **kwargs)

    context.patch(DistributedDataParallel, "__init__", __init__)
    watch_optimizer_steps(before=_rebind_optimizer)
    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            # The script may read its model after this: every parameter whole again while a group remains.
            modules = [module for module in (ref() for ref in _live) if module is not None]
            if modules:
                _all_ranks("destroy_process_group()")
            for module in modules:
                full_parameters(module)
            _live.clear()
        return destroy(group)

    context.patch(distributed_c10d, "destroy_process_group", destroy_process_group)
    context.patch(dist, "destroy_process_group", destroy_process_group)
    context.on_undo("sharding", _forget)


def _forget() -> None:
    _replaced.clear()
    _rebound.clear()
    _calls.clear()
    _live.clear()
