"""Let communication threads release Python callbacks before the interpreter finalizes."""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

# Callbacks handed to c10d futures that a communication thread has not released yet.
# Gloo's thread drops them after running them, and that takes the GIL: if it happens
# once the interpreter is finalizing, the thread is killed and the process aborts
# ("terminate called without an active exception"). At exit we wait until they are gone.
_unreleased_callbacks: set[weakref.ref] = set()
_EXIT_GRACE_S = 0.02
_guard_exit = False


def guard_exit() -> None:
    """Make this process wait at exit for communication threads to release Python callbacks."""
    global _guard_exit
    _guard_exit = True


def track(callback: F) -> F:
    """Register a callback handed to a c10d future; returns it."""
    guard_exit()
    _unreleased_callbacks.add(weakref.ref(callback, _unreleased_callbacks.discard))
    return callback


@atexit.register
def _wait_for_callback_release(timeout_s: float = 5.0) -> None:
    if not _guard_exit:
        return
    deadline = time.monotonic() + timeout_s
    while _unreleased_callbacks and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL, which is what the communication thread waits for
    # Callbacks of hooks we did not build (a script's own Python hook) are not tracked:
    # a short yield of the GIL lets a thread already waiting for it finish its release.
    time.sleep(_EXIT_GRACE_S)
