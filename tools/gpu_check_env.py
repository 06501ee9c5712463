"""The environment `tools/gpu-check` runs in, as JSON: `python tools/gpu_check_env.py OUT.json`.

Python, the CPU count, which dependencies import (and their versions, or the error), torch's build (CUDA, cuDNN,
NCCL, Gloo) and the GPU, and whether trainaccel's zero-code path imports. Run in a process of its own, so that a
torch import or CUDA initialisation that hangs is ended by the caller's timeout.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import sys

DEPENDENCIES = {  # module -> its distribution's name
    "torch": "torch",
    "numpy": "numpy",
    "rich": "rich",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "triton": "triton",
}


def main(out: str) -> None:
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count()}
    deps = {}
    for name, distribution in DEPENDENCIES.items():
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is what we report
            deps[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        deps[name] = {"version": str(version), "path": getattr(module, "__file__", None)}
    info["dependencies"] = deps
    if "version" in deps["torch"]:
        import torch
        import torch.distributed as dist

        t: dict = {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "distributed": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": None,
        }
        if dist.is_available() and dist.is_nccl_available():
            try:
                version = torch.cuda.nccl.version()
                t["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            except Exception as e:  # noqa: BLE001
                t["nccl"] = f"available, version unknown ({type(e).__name__})"
        if t["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            t["device"] = props.name
            t["capability"] = f"sm_{props.major}{props.minor}"
            t["memory_gib"] = round(props.total_memory / 2**30, 1)
            t["bf16_supported"] = torch.cuda.is_bf16_supported()
            torch.ones(1, device="cuda").add_(1).item()  # the device works, not only enumerates
        info["torch"] = t
        try:
            import trainaccel
            import trainaccel.zero_code  # noqa: F401 - what init() imports: the engine, amp, monitors

            info["trainaccel"] = {"version": trainaccel.__version__, "path": os.path.dirname(trainaccel.__file__)}
        except Exception as e:  # noqa: BLE001
            info["trainaccel_error"] = f"{type(e).__name__}: {e}"[:300]
    with open(out, "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
