"""Checks for worker scripts: collect failed checks and error messages, then write OUT_DIR/rank{r}.json."""

import json
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
