"""Checks for worker scripts: collect failed checks and error messages, then write OUT_DIR/rank{r}.json."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.info: dict = {}

    def check(self, label: str, ok: bool) -> None:
        if not ok:
            self.failures.append(label)

    def raises(self, label: str, fn, error: type, contains: str) -> None:
        """`fn()` must raise `error` with `contains` in its message; the message is kept under `label`."""
        try:
            fn()
        except error as e:
            self.check(f"{label}: message {e}", contains in str(e))
            self.info.setdefault("errors", {})[label] = str(e)
        else:
            self.failures.append(f"{label}: no error")

    def write(self, out_dir: str, rank: int) -> None:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"failures": self.failures, **self.info}))


@contextlib.contextmanager
def broadcasts_counted() -> Iterator[list[int]]:
    """The elements of each `torch.distributed.broadcast` call made inside (trainaccel's first inner step calls it;
    DDP's own broadcast at the wrap goes another way, so it is not counted)."""
    import torch.distributed as dist

    carried: list[int] = []
    broadcast = dist.broadcast

    def counted(tensor, *args, **kwargs):
        carried.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counted
    try:
        yield carried
    finally:
        dist.broadcast = broadcast
