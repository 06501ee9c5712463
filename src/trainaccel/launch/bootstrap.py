"""Worker entry used by `trainaccel run`: `trainaccel.init()`, then the user's script, unchanged.

python -m trainaccel.launch.bootstrap [--module] SCRIPT_OR_MODULE [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    # record() writes the worker's traceback where torchrun's failure report picks it up.
    record(_run)(list(sys.argv[1:] if argv is None else argv))


def _run(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m trainaccel.launch.bootstrap [--module] SCRIPT [ARGS...]")
    target, *rest = argv

    import trainaccel

    # The script starts its own process group, as it does under plain torchrun.
    trainaccel.init(start_process_group=False)
    sys.argv = [target, *rest]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As `python script.py` would: the script's folder first on the import path.
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except BaseException as error:
        from trainaccel.resilience.failfast import failed

        # The missing peers, shown with the traceback and in torchrun's failure report; and every other
        # rank's heartbeat ends its worker, naming this one, instead of leaving it to wait for a timeout.
        failed(error)
        raise


if __name__ == "__main__":
    main()
