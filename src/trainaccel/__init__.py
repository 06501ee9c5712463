"""trainaccel: an open, PyTorch-native accelerator for distributed data-parallel training.

Zero-code: `trainaccel run --nproc-per-node 8 train.py`. One line: `trainaccel.init()`, undone by
`trainaccel.shutdown()`. Importing this package is cheap and changes nothing; torch is loaded by `init()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NoReturn

from trainaccel.config import Config, ConfigError

if TYPE_CHECKING:
    import os

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "__version__", "compile", "convert_sync_batchnorm", "init", "shard", "shutdown"]


# --- init(): written by tools/init_signature.py from Config's fields; edit those, then run it. ---
def init(
    *,
    start_process_group: bool = True,
    compression: Literal["none", "fp16", "bf16", "topk", "randomk", "powersgd"] | None = None,
    intra_compression: Literal["none", "fp16", "bf16"] | None = None,
    hierarchical: Literal["auto", "on", "off"] | bool | None = None,
    compression_ratio: float | None = None,
    compression_ratio_max: float | None = None,
    compression_momentum: Literal["auto"] | float | None = None,
    compression_warmup: int | None = None,
    fp16_scale: Literal["auto", "dynamic", "peak"] | float | None = None,
    powersgd_rank: int | None = None,
    local_steps: int | None = None,
    sync_every: Literal["auto"] | int | None = None,
    sync_scope: Literal["auto", "node", "rank"] | None = None,
    sync_warmup: int | None = None,
    sync_fragments: int | None = None,
    sync_overlap: int | None = None,
    on_lost_replica: Literal["stop", "continue"] | None = None,
    store: Literal["agent"] | str | None = None,
    outer_optimizer: Literal["average", "nesterov", "sgd"] | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    outer_compression: Literal["none", "bf16", "fp16", "int8", "fp4"] | None = None,
    shard: Literal["off", "full", "hybrid"] | None = None,
    shard_min_params: int | None = None,
    autotune: Literal["off", "on"] | bool | None = None,
    bucket_mb: float | None = None,
    amp: Literal["off", "bf16", "fp16", "on", "O0", "O1"] | bool | None = None,
    amp_policy: str | None = None,
    compile: Literal["off", "on"] | bool | None = None,
    compile_preset: Literal["default", "reduce-overhead", "max-autotune"] | None = None,
    nan_check: Literal["off", "warn", "raise"] | bool | None = None,
    metrics_every: int | None = None,
    straggler_every: int | None = None,
    straggler_threshold: float | None = None,
    timeline: str | os.PathLike[str] | None = None,
    collective_timeout: float | None = None,
    hang_timeout: Literal["auto"] | float | None = None,
    log_level: Literal["debug", "info", "warning", "error"] | None = None,
    **misspelt: NoReturn,
) -> Config:
    """Set trainaccel up in this worker: every DDP model built afterwards is accelerated. Returns the resolved config.

    An option left at None comes from its `trainaccel run` flag, else its `TRAINACCEL_<OPTION>` variable, else its
    default. A bad value or a misspelt keyword raises one line that names it. Idempotent; `shutdown()` undoes it.

    Args:
        start_process_group: start the default process group (env://) when the environment describes a distributed
            job and the script has not started one yet.
        compression: gradient compression across nodes (over all workers when the reduction is flat). Accepted: none,
            fp16, bf16, topk, randomk, powersgd; default: none.
        intra_compression: compression within a node when the reduction is hierarchical. Accepted: none, fp16, bf16;
            default: none.
        hierarchical: two-level allreduce: reduce-scatter in the node, allreduce across nodes, all-gather in the node;
            auto: on with Gloo, >1 node, >1 worker per node and a dense codec (none, fp16, bf16). Accepted: auto, on,
            off; default: auto.
        compression_ratio: fraction of gradient elements that topk and randomk send each step. Accepted: a number in (0,
            1]; default: 0.01.
        compression_ratio_max: with a value above compression_ratio, topk's and randomk's ratio adapts between the two:
            raised while error feedback holds back many steps of gradient, lowered when it holds back few (empty: fixed
            ratio). Accepted: a number in (0, 1], or empty (off); default: empty.
        compression_momentum: momentum correction for topk and randomk; auto: an SGD optimizer's momentum and weight
            decay are taken over by error feedback (the optimizer runs without them); a number: DGC's momentum with
            factor masking, for a momentum-free optimizer (e.g. 0.9). Accepted: auto, or a number in [0, 1]; default:
            auto.
        compression_warmup: first steps reduced exactly before topk, randomk or powersgd start (at least 1, and 2 for
            powersgd). Accepted: an integer >= 0; default: 20.
        fp16_scale: gradients are multiplied by this before the fp16 cast and divided after; dynamic: halved after an
            overflow, doubled after 2000 steps without one, per bucket; peak: from the largest magnitude over the
            workers, per sum, with no host read; auto: peak on GPUs, dynamic on the CPU. Accepted: auto, dynamic, peak,
            or a number > 0 (a fixed scale); default: auto.
        powersgd_rank: rank of PowerSGD's low-rank gradient approximation. Accepted: an integer >= 1; default: 2.
        local_steps: backward passes accumulated locally between gradient exchanges (trainaccel.comm.LocalSteps).
            Accepted: an integer >= 1; default: 1.
        sync_every: low-communication training (DiLoCo): the per-step gradient exchange is off, each worker's optimizer
            steps alone, and every N optimizer steps the parameter changes are averaged and applied by an outer
            optimizer (0: off, gradients are exchanged every step; auto: N, at most 4 at the peak learning rate and 4 x
            the square root of its drop from the peak as a schedule lowers it, and sync_fragments, sync_overlap and
            outer_compression where left at their defaults, chosen from the measured step and link). Accepted: an
            integer >= 0, or auto; default: 0.
        sync_scope: what one replica is under sync_every: node (the workers of a node still average gradients every
            step, as DDP does, and the nodes' replicas sync every sync_every steps, as DiLoCo's islands), rank (every
            worker steps alone); auto: node for a DDP model over more than one node with the same number (>1) of workers
            each, else rank. Accepted: auto, node, rank; default: auto.
        sync_warmup: first inner steps under sync_every that still exchange gradients every step (as plain DDP); the
            local steps and syncs begin after them. Accepted: an integer >= 0; default: 0.
        sync_fragments: under sync_every, the parameters in this many fragments of about equal size, each synced every
            sync_every steps at its own staggered step (Streaming DiLoCo): the same bytes, in smaller and more frequent
            syncs. Accepted: an integer >= 1; default: 1.
        sync_overlap: under sync_every, optimizer steps a sync's exchange runs behind training before its result is
            applied (the steps taken meanwhile are kept on top of it); 0: each sync waits for its exchange. Accepted: an
            integer >= 0; default: 0.
        on_lost_replica: what the other replicas do when one dies, hangs or is cut off: stop (every node's job ends, as
            under plain DDP) or continue (they leave it out and train on: under sync_every from the next sync, else from
            the step whose gradient exchange it missed, which they do again among themselves). Accepted: stop, continue;
            default: stop.
        store: where the job's store lives (rendezvous, heartbeats, the roll call): agent (torchrun's, in the first
            node's agent: losing that node ends the job) or etcd://HOST:PORT,... (an etcd cluster of 3 or 5 members: the
            job outlives any node while a majority of them answers, and with --nnodes MIN:MAX nodes join it; needs
            --rdzv-id). Accepted: agent, or etcd://HOST:PORT[,HOST:PORT...] (the etcd members' client addresses);
            default: agent.
        outer_optimizer: the update applied at each sync of sync_every: average (the replicas' mean; outer_lr and
            outer_momentum unused), nesterov (SGD with Nesterov momentum on the averaged change, as DiLoCo's long runs),
            sgd (heavy-ball momentum). Accepted: average, nesterov, sgd; default: average.
        outer_lr: learning rate of sync_every's nesterov and sgd outer steps (1 with outer_momentum 0: plain averaging).
            Accepted: a number > 0; default: 0.7.
        outer_momentum: momentum of sync_every's nesterov and sgd outer steps. Accepted: a number in [0, 1); default:
            0.9.
        outer_compression: codec of the parameter change that sync_every's syncs average, with error feedback where
            lossy (int8 and fp4: per block of 256 values, one float32 scale). Accepted: none, bf16, fp16, int8, fp4;
            default: none.
        shard: shard every DDP model with FSDP2 instead (parameters, gradients and optimizer state split across ranks):
            full over every rank; hybrid within each node, whole replicas reduced across nodes (where compression fp16
            or bf16 applies). Accepted: off, full, hybrid; default: off.
        shard_min_params: under shard, each submodule holding at least this many parameters (not in a smaller one) is
            gathered and freed on its own; the rest with the root. Accepted: an integer >= 1; default: 1000000.
        autotune: time candidate fusion sizes, codecs and hierarchy over the first steps and keep the fastest. Accepted:
            off, on; default: off.
        bucket_mb: DDP bucket size in MiB, used unless the script passes bucket_cap_mb (default: DDP's own). Accepted: a
            number > 0 (MiB); default: empty.
        amp: run every DDP model's forward under autocast: bf16, fp16 (needs trainaccel.amp.scaled(optimizer)), on (bf16
            where the hardware computes it: CPUs, A100/H100 and later GPUs; fp16 on older GPUs, which needs scaled()
            too); O0/O1 are aliases of off/on. Accepted: off, bf16, fp16, on, O0, O1; default: off.
        amp_policy: when to autocast: always, or a per-step PrecisionPolicy such as auto or time:start=1000,end=50000.
            Accepted: always, auto[:setting=value,...] or time[:setting=value,...]; default: always.
        compile: compile every DDP model with torch.compile after its first step (eager if the toolchain is missing).
            Accepted: off, on; default: off.
        compile_preset: torch.compile mode used with compile=on. Accepted: default, reduce-overhead, max-autotune;
            default: default.
        nan_check: check reduced gradients (under sync_every: each sync's averaged parameter change) for NaN/Inf: off,
            warn (log the parameters) or raise. Accepted: off, warn, raise; default: off.
        metrics_every: log throughput, step time (data wait vs compute) and peak memory every N training steps on rank 0
            (0: off). Accepted: an integer >= 0; default: 0.
        straggler_every: every N training steps, compare the workers' own step times and name those slower than the
            median (0: off). Accepted: an integer >= 0; default: 0.
        straggler_threshold: how much slower than the median a worker's own step time must be to be named (0.2: 20
            percent). Accepted: a number > 0; default: 0.2.
        timeline: write a Chrome-trace timeline of training steps and bucket communication to this file on rank 0.
            Accepted: a file path (empty: off); default: empty.
        collective_timeout: seconds a collective may wait for its peers before the job fails naming the cause (torch's
            defaults: 600 for NCCL, whose watchdog then ends the process, 1800 for Gloo; hangs are named sooner by
            hang_timeout); applies to process groups started without an explicit timeout. Accepted: a number > 0;
            default: 600.0.
        hang_timeout: seconds after which a rank that stopped training while its peers wait is named and the job ended
            on every node; auto: max(60, 10 x the median step time), from the third step on. Accepted: auto, or a number
            >= 0 (seconds; 0: off); default: auto.
        log_level: level of trainaccel's own log lines. Accepted: debug, info, warning, error; default: info.
    """
    given = {name: value for name, value in locals().items() if value is not None and name != "misspelt"}
    from trainaccel.runtime import init as _init

    return _init(**given, **misspelt)


# --- end of the written part ---


def shutdown() -> None:
    """Undo `init()`: torch as it was, the process group it started destroyed (see `trainaccel.runtime.shutdown`)."""
    from trainaccel.runtime import shutdown as _shutdown

    _shutdown()


def compile(model: Any, preset: str = "default", **options: Any) -> Any:  # noqa: A001 - mirrors torch.compile
    """`torch.compile` in place with a named preset and an eager fallback (see `trainaccel.compiler.compile`)."""
    from trainaccel.compiler import compile as _compile

    return _compile(model, preset, **options)


def convert_sync_batchnorm(module: Any, scope: str = "global", process_group: Any = None) -> Any:
    """BatchNorm layers -> SyncBatchNorm over every worker or this node's (see `trainaccel.batchnorm`)."""
    from trainaccel.batchnorm import convert_sync_batchnorm as _convert

    return _convert(module, scope, process_group)


def shard(model: Any, mode: str = "full", **options: Any) -> Any:
    """Shard a model with FSDP2 block by block, over all ranks or within each node (see `trainaccel.sharding.shard`)."""
    from trainaccel.sharding import shard as _shard

    return _shard(model, mode, **options)
