"""Local gradient accumulation: reduce gradients and step the optimizer once every N backward passes."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainaccel.config import Config
from trainaccel.context import current_config
from trainaccel.observer import observe


class LocalSteps:
    """Wrap each forward+backward in `with steps:`; every `every`-th pass reduces and steps the optimizer(s).

    The other passes run under DDP's `no_sync()`, so their gradients add up locally and cross
    the network once: traffic drops to 1/`every`, like a batch `every` times larger. With
    `average`, the summed gradients are divided by `every` before the optimizer step.

        steps = trainaccel.comm.LocalSteps(model, optimizer, every=4)
        for x, y in loader:
            with steps:
                loss_fn(model(x), y).backward()
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        every: int | None = None,
        average: bool = True,
    ):
        if every is None:
            every = _configured_local_steps()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"invalid every={every!r}; accepted: an integer >= 1")
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"LocalSteps needs a DistributedDataParallel model, got {type(model).__name__}")
        # Several optimizers (AdamW and SparseAdam for a sparse embedding): each steps at every `every`-th pass.
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.model, self.every, self.average = model, every, average
        self.passes = 0
        self._in_pass = False
        self._no_sync: contextlib.AbstractContextManager | None = None
        observe(model).local_steps = self  # zero-code mode sees that the script holds reductions back

    @property
    def syncing(self) -> bool:
        """Whether the pass about to run (or running) reduces gradients and steps the optimizer."""
        return (self.passes + (0 if self._in_pass else 1)) % self.every == 0

    def __enter__(self) -> LocalSteps:
        self.passes += 1
        self._in_pass = True
        if self.passes % self.every:
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._in_pass = False
        if self._no_sync is not None:
            self._no_sync, no_sync = None, self._no_sync
            no_sync.__exit__(exc_type, exc, tb)
            return
        if exc_type is not None:
            return
        if self.average and self.every > 1:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(self.every))
        for optimizer in self.optimizers:
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "every": self.every}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume counting where a checkpoint left off (call between passes)."""
        if state["every"] != self.every:
            raise ValueError(
                f"checkpoint was taken with every={state['every']}, this LocalSteps has every={self.every}"
            )
        self.passes = int(state["passes"])


def _configured_local_steps() -> int:
    config = current_config() or Config.resolve()
    return config.local_steps
