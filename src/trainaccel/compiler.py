"""`trainaccel.compile`: `torch.compile` with named presets, in place, falling back to eager when it cannot compile.

With DDP, compile the DDP model (wrap first, then compile): TorchDynamo then splits the graph
at DDP's bucket boundaries, so each bucket's allreduce starts while the rest of the backward
runs. A compiled module wrapped in DDP afterwards has one backward graph whose gradients all
appear at its end, and communication cannot overlap it. `trainaccel run --compile` does the
former for every DDP model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import Any, Callable

import torch
from torch import nn

log = logging.getLogger("trainaccel")

PRESETS = {"default": None, "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}


def compile(
    model: nn.Module,
    preset: str = "default",
    *,
    backend: str | Callable = "inductor",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    fallback: bool = True,
) -> nn.Module:
    """Compile `model` in place (same object, same state_dict keys) and return it.

    `preset`: default, reduce-overhead (CUDA graphs) or max-autotune. With `fallback`, a missing
    toolchain or a compiler failure logs why and leaves the model eager; otherwise it raises.
    """
    if preset not in PRESETS:
        raise ValueError(f"invalid preset={preset!r}; accepted: {', '.join(PRESETS)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"trainaccel.compile takes an nn.Module, got {type(model).__name__}")
    missing = missing_toolchain(backend, _device_type(model)) or _unsupported_ddp_buckets(model)
    if missing:
        if not fallback:
            raise RuntimeError(f"cannot compile: {missing}")
        log.warning("not compiling %s (%s): it runs eager", type(model).__name__, missing)
        return model
    call_impl = model._call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        # A frame of ours to start tracing from: TorchDynamo skips frames that begin inside torch
        # (so `nn.Sequential.compile()` compiles nothing) but inlines torch code called from here.
        return call_impl(*args, **kwargs)

    compiled = torch.compile(call, backend=backend, mode=PRESETS[preset], fullgraph=fullgraph, dynamic=dynamic)
    # What `nn.Module.compile()` sets: `model(...)` runs it, the module and its state_dict stay as they are.
    model._compiled_call_impl = _eager_on_failure(model, compiled) if fallback else compiled
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` runs compiled (compiled in place and not fallen back to eager)."""
    return getattr(model, "_compiled_call_impl", None) is not None


def missing_toolchain(backend: str | Callable, device_type: str) -> str:
    """What the backend needs on this device and cannot find, in a few words; '' when all is there."""
    if backend != "inductor":
        return ""
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor needs Triton for CUDA code (pip install triton)"
    if device_type == "cpu":
        candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in candidates):
            return "inductor needs a C++ compiler for CPU code: none of $CXX, g++, c++, clang++ is on PATH"
    return ""


def _unsupported_ddp_buckets(model: nn.Module) -> str:
    """Why TorchDynamo's DDP graph splitting cannot take this DDP model's buckets; '' when it can."""
    from torch.nn.parallel import DistributedDataParallel

    first = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    if isinstance(model, DistributedDataParallel) and model.bucket_bytes_cap < first:
        return (
            f"DDP buckets of {model.bucket_bytes_cap / 2**20:g} MiB are smaller than the first bucket "
            f"({first / 2**20:g} MiB) that TorchDynamo's DDP graph splitting needs"
        )
    return ""


def _device_type(model: nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")


def _eager_on_failure(model: nn.Module, compiled: Callable) -> Callable:
    """`compiled`, but a compiler failure turns the model eager for good (after one warning)."""
    from torch._dynamo.exc import BackendCompilerFailed

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            # Compilation happens at a frame's first call, before its graph runs; only what ran
            # before a graph break (eagerly or compiled) runs twice, once, at the switch.
            cause = getattr(e, "inner_exception", None) or e.__cause__ or e
            why = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
            log.warning("torch.compile failed (%s): %s runs eager from now on", why, type(model).__name__)
            model._compiled_call_impl = None
            return model._call_impl(*args, **kwargs)

    return call
