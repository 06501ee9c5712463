"""A few training steps of a small model under each of a list of trainaccel options, in one job.

Used by `tools/gpu-check` (stages options, replicas and amp); run under torchrun, one or more ranks:

    python -m torch.distributed.run --standalone --nproc-per-node 1 tools/gpu_check_steps.py OUT_DIR \
        --options defaults,fp16 --backend nccl --steps 8 --warmup 4 --record-syncs 4

For each option the script calls `trainaccel.init(**options)`, builds a DDP model of a small MLP (with a BatchNorm,
so that there are buffers) on this rank's device, trains it with SGD and `trainaccel.amp.scaled()` (a no-op but
under amp fp16), then `trainaccel.shutdown()`. Each rank appends JSON lines to OUT_DIR/rank{r}.jsonl: one
`{"option", "event": "began"}`, then one `{"option", "event": "done", "ok", ...}` with

- `error`, `error_type`, `where`: the first line of an error and the innermost trainaccel frame it came from;
- `syncs`: with `--record-syncs S` on CUDA, the host-device synchronizations seen during the S steps after the
  warm-up (`torch.cuda.set_sync_debug_mode("warn")`, each warning's Python stack kept): thread, innermost
  trainaccel frame, innermost frame, count. Syncs in C++ threads (the autograd engine's, a backend's) have no
  Python stack: torch prints those on stderr, between this script's `gpu-check option ... begin/end` lines;
- `first_loss`, `final_loss` (evaluation loss on a fixed batch, before and after), `losses` (training losses),
  `replicas_equal` and `max_replica_diff` with `--check-replicas` (the module's state_dict() compared across ranks:
  under sync_every it holds the synced model, which every rank must agree on), `compute_dtype` (the
  first layer's output dtype), `compiled`, `comm_hook`, `hierarchical`, `sync_scope`, `loss_scale`, `messages`
  (trainaccel's warnings and errors, as logged).

After each option the ranks agree on whether every rank succeeded; when one did not and there are several ranks,
every rank exits with status 3 (their collectives may no longer pair up) and the caller starts a new job for the
options left. The data live on the device before the loop, so that the loop itself adds no host-device copy.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainaccel
from trainaccel.amp import scaled
from trainaccel.comm import comm_state
from trainaccel.observer import observer_of

IN, HIDDEN, OUT, BATCH = 64, 512, 16, 32

# label (no commas: --options is a comma-separated list) -> trainaccel.init() keywords; `{out}` in a value is
# replaced by the output folder.
OPTIONS: dict[str, dict] = {
    "defaults": {},
    "none+nan_check": {"compression": "none", "nan_check": "warn"},  # `none` through trainaccel's Python hook
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "topk": {"compression": "topk", "compression_ratio": 0.1, "compression_warmup": 1},
    "randomk": {"compression": "randomk", "compression_ratio": 0.1, "compression_warmup": 1},
    "powersgd": {"compression": "powersgd", "compression_warmup": 1},
    "fp16+hierarchical": {"compression": "fp16", "hierarchical": "on"},
    "fp16+dynamic": {"compression": "fp16", "fp16_scale": "dynamic"},  # "fp16" is auto's: peak on a GPU
    "sync_every=2": {"sync_every": 2},
    "sync_every=2+nesterov": {"sync_every": 2, "outer_optimizer": "nesterov"},
    "sync_every=4+fragments=2+overlap=1": {"sync_every": 4, "sync_fragments": 2, "sync_overlap": 1},
    "sync_every=2+outer=int8": {"sync_every": 2, "outer_compression": "int8"},
    "sync_every=2+outer=fp4": {"sync_every": 2, "outer_compression": "fp4"},
    "amp=bf16": {"amp": "bf16"},
    "amp=fp16": {"amp": "fp16"},
    "amp=on": {"amp": "on"},
    "shard=full": {"shard": "full"},
    "shard=full+amp=bf16": {"shard": "full", "amp": "bf16"},
    "compile": {"compile": "on"},
    "compile+amp=bf16": {"compile": "on", "amp": "bf16"},
    "nan_check=raise": {"compression": "fp16", "nan_check": "raise"},
    "metrics_every=2": {"metrics_every": 2},
    "straggler_every=2": {"straggler_every": 2},
    "timeline": {"timeline": "{out}/timeline-{rank}.json"},
    "autotune": {"autotune": "on", "compression": "fp16"},
    "bucket_mb=0.25": {"bucket_mb": 0.25},
    # Multi-rank cells (stage replicas): the codecs flat and hierarchical, sync_every's scopes.
    **{
        f"{codec}/hier={h}": {
            "compression": codec,
            "hierarchical": h,
            "nan_check": "warn",  # `none` flat would otherwise be DDP's own allreduce
            "compression_ratio": 0.1,
            "compression_warmup": 1,
        }
        for codec in ("none", "fp16", "bf16", "topk", "randomk", "powersgd")
        for h in ("off", "on")
    },
    **{
        f"fp16+dynamic/hier={h}": {
            "compression": "fp16",
            "fp16_scale": "dynamic",
            "hierarchical": h,
            "nan_check": "warn",
        }
        for h in ("off", "on")
    },
    "sync_every=2+scope=rank": {"sync_every": 2, "sync_scope": "rank"},
}

SYNC_MESSAGE = "called a synchronizing CUDA operation"
PACKAGE = os.path.dirname(os.path.abspath(trainaccel.__file__))
HERE = os.path.abspath(__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def describe(filename: str, lineno: int | None, name: str) -> str:
    """`trainaccel/comm/exchange.py:97 (finish)` for a frame in the package, else the path as it is."""
    path = os.path.abspath(filename)
    if path.startswith(PACKAGE + os.sep):
        path = "trainaccel/" + os.path.relpath(path, PACKAGE)
    return f"{path}:{lineno} ({name})"


def in_package(filename: str) -> bool:
    return os.path.abspath(filename).startswith(PACKAGE + os.sep)


def error_where(error: BaseException) -> str | None:
    """The innermost trainaccel frame an error came from. An error raised on another thread and re-raised here
    (a DDP hook's future) carries that thread's traceback in its message: its frames come first."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    from_text = [m for m in _FRAME.finditer(str(error)) if in_package(m.group(1))]
    if from_text:
        m = from_text[-1]
        return describe(m.group(1), int(m.group(2)), m.group(3))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if in_package(f.filename)]
    if frames:
        return describe(frames[-1].filename, frames[-1].lineno, frames[-1].name)
    found = [m for m in _FRAME.finditer(text) if in_package(m.group(1))]
    return describe(found[-1].group(1), int(found[-1].group(2)), found[-1].group(3)) if found else None


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


class SyncRecorder:
    """Host-device synchronizations while active: torch's sync debug mode set to warn, each warning's stack kept.

    The warnings come from any Python thread (the training loop, trainaccel's communication thread, the
    autograd engine's threads running Python hooks); `warnings.showwarning` sees them on the thread that synced.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, list[traceback.FrameSummary]]] = []
        self._saved = None  # warnings.showwarning while active

    def __enter__(self) -> SyncRecorder:
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
            if SYNC_MESSAGE in str(message):
                stack = [f for f in traceback.extract_stack()[:-1] if os.path.abspath(f.filename) != HERE]
                self.events.append((threading.current_thread().name, stack))
            else:
                original(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*" + SYNC_MESSAGE)  # every one (left in place: harmless after)
        warnings.showwarning = show
        self._saved = original
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, self._saved = self._saved, None

    def summary(self) -> list[dict]:
        """One entry per (thread kind, innermost trainaccel frame, innermost frame), with its count."""
        counts: dict[tuple, int] = {}
        for thread, stack in self.events:
            ours = [f for f in stack if in_package(f.filename)]
            where = describe(ours[-1].filename, ours[-1].lineno, ours[-1].name) if ours else None
            inner = describe(stack[-1].filename, stack[-1].lineno, stack[-1].name) if stack else None
            kind = "main" if thread == "MainThread" else thread
            key = (re.sub(r"-\d+$", "", kind), where, inner)
            counts[key] = counts.get(key, 0) + 1
        return [
            {"thread": thread, "trainaccel_frame": where, "innermost_frame": inner, "count": n}
            for (thread, where, inner), n in sorted(counts.items(), key=lambda kv: -kv[1])
        ]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(IN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.inner = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.hidden(x)))
        return self.out(torch.tanh(self.inner(h)))


def replicas(model: nn.Module, group_device: torch.device) -> tuple[bool, float]:
    """Whether the model's state_dict() is bitwise equal on every rank, and the largest difference. Under
    sync_every the state dict holds the synced model (the live replicas differ between syncs, by design)."""
    tensors = [t.detach() for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    flat = torch.cat([t.to(group_device, torch.float64).reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    diff = max(float((g - flat).abs().max()) for g in gathered)
    return all(torch.equal(g, flat) for g in gathered), diff


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()  # a look: sync_every replicas are averaged
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x).float(), y)
    return float(loss)


def run_option(name: str, options: dict, args: argparse.Namespace, device: torch.device) -> dict:
    rank = dist.get_rank()
    group_device = device if args.backend == "nccl" else torch.device("cpu")
    result: dict = {"option": name, "event": "done", "rank": rank, "ok": False}
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage()[:240])  # type: ignore[method-assign]
    logging.getLogger("trainaccel").addHandler(handler)
    recorder = SyncRecorder() if args.record_syncs and device.type == "cuda" else None
    began = time.perf_counter()
    print(f"gpu-check option {name} begin", file=sys.stderr, flush=True)
    model = ddp = optimizer = None
    try:
        kwargs = {k: v.replace("{out}", str(args.out_dir)) if isinstance(v, str) else v for k, v in options.items()}
        kwargs.setdefault("collective_timeout", args.group_timeout)
        trainaccel.init(**kwargs)
        torch.manual_seed(0)
        teacher = torch.Generator().manual_seed(1234)
        w1 = (torch.randn(IN, HIDDEN, generator=teacher) / IN**0.5).to(device)
        w2 = (torch.randn(HIDDEN, OUT, generator=teacher) / HIDDEN**0.5).to(device)
        data = torch.Generator().manual_seed(100 + rank)
        xs = torch.randn(args.steps, BATCH, IN, generator=data).to(device)
        ys = torch.tanh(xs @ w1) @ w2
        x_eval = torch.randn(512, IN, generator=torch.Generator().manual_seed(99)).to(device)
        y_eval = torch.tanh(x_eval @ w1) @ w2
        model = Net().to(device)
        dtypes: list[torch.dtype] = []
        model.hidden.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype) if not dtypes else None)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = scaled(torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
        result["first_loss"] = evaluate(ddp, x_eval, y_eval)
        ddp.train()
        losses = []
        for step in range(args.steps):
            if recorder is not None and step == args.warmup:
                torch.cuda.synchronize()
                recorder.__enter__()
            loss = nn.functional.mse_loss(ddp(xs[step]).float(), ys[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            if recorder is not None and step == args.warmup + args.record_syncs - 1:
                recorder.__exit__()
        if recorder is not None:
            recorder.__exit__()
        result["losses"] = [round(v, 6) for v in torch.stack(losses).float().tolist()]
        result["final_loss"] = evaluate(ddp, x_eval, y_eval)
        if args.check_replicas:
            result["replicas_equal"], result["max_replica_diff"] = replicas(ddp.module, group_device)
        ddp.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["compute_dtype"] = str(dtypes[0]).removeprefix("torch.") if dtypes else None
        # What amp=on must pick here: bfloat16 where the device computes it natively, float16 on older GPUs.
        native = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
        result["native_bf16"] = native
        from trainaccel.compiler import is_compiled

        result["compiled"] = is_compiled(ddp)
        observer = observer_of(ddp)
        state = comm_state(ddp)
        result["hierarchical"] = getattr(state, "hierarchical", None)
        diloco = observer.diloco if observer is not None else None
        result["sync_scope"] = diloco.scope if diloco is not None else None
        logging_data = getattr(ddp, "_get_ddp_logging_data", None)
        result["comm_hook"] = (logging_data().get("comm_hook") or None) if logging_data else type(ddp).__name__
        scaler = getattr(optimizer, "trainaccel_scaler", None)
        result["loss_scale"] = float(scaler.get_scale()) if scaler is not None else None
        result["ok"] = True
    except Exception as e:  # reported, and the next option runs
        result.update(error=first_line(e), error_type=type(e).__name__, where=error_where(e))
        traceback.print_exc()
    finally:
        if recorder is not None:
            recorder.__exit__()
            result["syncs"] = recorder.summary()
        model = ddp = optimizer = None  # noqa: F841 (dropped before shutdown, as a script's end would)
        try:
            trainaccel.shutdown()
        except Exception as e:
            result.setdefault("error", f"shutdown: {first_line(e)}")
            result["ok"] = False
        logging.getLogger("trainaccel").removeHandler(handler)
        gc.collect()
    if options.get("compile") == "on":
        import torch._dynamo as dynamo

        dynamo.reset()  # a fresh cache for the next compiled model
    result["messages"] = messages[:4]
    result["seconds"] = round(time.perf_counter() - began, 2)
    print(f"gpu-check option {name} end", file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--options", required=True, help=f"comma-separated labels of: {', '.join(OPTIONS)}")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4, help="steps before the recorded ones")
    parser.add_argument("--record-syncs", type=int, default=0, help="steps recorded for host-device syncs (CUDA)")
    parser.add_argument("--check-replicas", action="store_true")
    parser.add_argument("--group-timeout", type=float, default=60.0, help="seconds a collective may wait")
    args = parser.parse_args()
    names = [n for n in args.options.split(",") if n]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        parser.error(f"unknown options {unknown}")
    if args.device == "cuda":
        # All ranks on one GPU (Gloo), or one rank per GPU (NCCL).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.group_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"rank{rank}.jsonl"
    agree_device = device if args.backend == "nccl" else torch.device("cpu")
    code = 0
    for name in names:
        with path.open("a") as f:
            f.write(json.dumps({"option": name, "event": "began", "rank": rank}) + "\n")
        result = run_option(name, OPTIONS[name], args, device)
        with path.open("a") as f:
            f.write(json.dumps(result) + "\n")
        if world > 1:
            failed = torch.tensor([0.0 if result["ok"] else 1.0], device=agree_device)
            dist.all_reduce(failed)
            if float(failed) > 0:
                code = 3  # a rank failed: its peers' collectives may be out of step; the caller starts anew
                break
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # without destroying a group whose collectives may be out of step (it could hang)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
