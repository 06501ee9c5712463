"""Row-wise sparse optimizers: each step touches only the rows looked up since the last one.

Per-row state (Adagrad's sum, Adam's moments) lives in the table beside the rows, so it is created,
evicted and exported with them. The update formulas are torch.optim's, applied to the touched rows.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from trainaccel.embedding.dynamic import DynamicEmbedding


def _tables(tables: nn.Module | Iterable[nn.Module]) -> tuple[list[DynamicEmbedding], list[nn.Module]]:
    """The DynamicEmbedding tables (local shards included) under `tables`, and the sharded collections."""
    items = [tables] if isinstance(tables, nn.Module) else list(tables)
    found: dict[int, nn.Module] = {}
    for item in items:
        if not isinstance(item, nn.Module):
            raise TypeError(f"invalid table {type(item).__name__}; accepted: modules holding embedding tables")
        found.update((id(m), m) for m in item.modules())
    local = [m for m in found.values() if isinstance(m, DynamicEmbedding)]
    sharded = [m for m in found.values() if hasattr(m, "exchange_gradients")]
    if not local and not sharded:
        raise ValueError(
            "no embedding tables found; accepted: DynamicEmbedding or sharded tables, or modules holding them"
        )
    return local, sharded


def _check(name: str, value: float, low: float = 0.0, high: float | None = None) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or value < low
        or (high is not None and value >= high)
    ):
        accepted = f"a number >= {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"invalid {name} {value!r}; accepted: {accepted}")
    return float(value)


class SparseOptimizer:
    """Base: `step()` updates the touched rows of every table; `zero_grad()` is there for loop symmetry."""

    def __init__(self, tables: nn.Module | Iterable[nn.Module], **defaults: Any):
        self.tables, self._sharded = _tables(tables)
        self.defaults = defaults
        for table in self.tables:
            for name, (width, init) in self.state_spec(table.dim).items():
                table.add_row_state(name, width, init)

    def state_spec(self, dim: int) -> dict[str, tuple[int, float]]:
        """Per-row state: name -> (width, initial value)."""
        return {}

    def update(self, table: Any, rows: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        for collection in self._sharded:  # gradients travel back to the ranks that own the rows
            collection.exchange_gradients()
        with torch.no_grad():
            for table in self.tables:
                rows, grad = table.take_gradients()
                if rows.numel():
                    self.update(table, rows, grad.to(table.weight.dtype))
                table.end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each step consumes the gradients of the lookups made since the last one."""

    @property
    def lr(self) -> float:
        return self.defaults["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.defaults["lr"] = _check("lr", value)

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters only: per-row state and counters are saved with the tables."""
        return {"defaults": dict(self.defaults)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.defaults.update(state["defaults"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.defaults.items())
        return f"{type(self).__name__}({len(self.tables)} tables, {args})"


class SparseSGD(SparseOptimizer):
    """w -= lr * g on the touched rows (torch.optim.SGD without momentum)."""

    def __init__(self, tables: nn.Module | Iterable[nn.Module], lr: float = 0.01):
        super().__init__(tables, lr=_check("lr", lr))

    def update(self, table: Any, rows: torch.Tensor, grad: torch.Tensor) -> None:
        table.weight.index_copy_(0, rows, table.weight.index_select(0, rows).sub_(grad, alpha=self.lr))


class SparseAdagrad(SparseOptimizer):
    """torch.optim.Adagrad on the touched rows: s += g^2; w -= lr * g / (sqrt(s) + eps)."""

    def __init__(
        self,
        tables: nn.Module | Iterable[nn.Module],
        lr: float = 0.01,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
    ):
        super().__init__(
            tables,
            lr=_check("lr", lr),
            eps=_check("eps", eps),
            initial_accumulator_value=_check("initial_accumulator_value", initial_accumulator_value),
        )

    def state_spec(self, dim: int) -> dict[str, tuple[int, float]]:
        return {"sum": (dim, self.defaults["initial_accumulator_value"])}

    def update(self, table: Any, rows: torch.Tensor, grad: torch.Tensor) -> None:
        total = table.row_state["sum"].index_select(0, rows).addcmul_(grad, grad)
        table.row_state["sum"].index_copy_(0, rows, total)
        step = table.weight.index_select(0, rows).addcdiv_(
            grad, total.sqrt_().add_(self.defaults["eps"]), value=-self.lr
        )
        table.weight.index_copy_(0, rows, step)


class RowWiseAdagrad(SparseOptimizer):
    """Adagrad with one accumulator per row (the mean of g^2 over the row): dim times less state."""

    def __init__(
        self,
        tables: nn.Module | Iterable[nn.Module],
        lr: float = 0.01,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
    ):
        super().__init__(
            tables,
            lr=_check("lr", lr),
            eps=_check("eps", eps),
            initial_accumulator_value=_check("initial_accumulator_value", initial_accumulator_value),
        )

    def state_spec(self, dim: int) -> dict[str, tuple[int, float]]:
        return {"row_sum": (1, self.defaults["initial_accumulator_value"])}

    def update(self, table: Any, rows: torch.Tensor, grad: torch.Tensor) -> None:
        total = table.row_state["row_sum"].index_select(0, rows) + grad.pow(2).mean(dim=1, keepdim=True)
        table.row_state["row_sum"].index_copy_(0, rows, total)
        step = self.lr * grad / (total.sqrt() + self.defaults["eps"])
        table.weight.index_copy_(0, rows, table.weight.index_select(0, rows).sub_(step))


class SparseAdam(SparseOptimizer):
    """torch.optim.Adam's update on the touched rows only ("lazy" Adam); the step count is per table."""

    def __init__(
        self,
        tables: nn.Module | Iterable[nn.Module],
        lr: float = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        b1, b2 = (_check(f"betas[{i}]", b, 0.0, 1.0) for i, b in enumerate(betas))
        super().__init__(tables, lr=_check("lr", lr), betas=(b1, b2), eps=_check("eps", eps))

    def state_spec(self, dim: int) -> dict[str, tuple[int, float]]:
        return {"exp_avg": (dim, 0.0), "exp_avg_sq": (dim, 0.0)}

    def update(self, table: Any, rows: torch.Tensor, grad: torch.Tensor) -> None:
        b1, b2 = self.defaults["betas"]
        step = table.scalars["adam_step"] = table.scalars.get("adam_step", 0.0) + 1
        m = table.row_state["exp_avg"].index_select(0, rows).lerp_(grad, 1 - b1)
        v = table.row_state["exp_avg_sq"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        table.row_state["exp_avg"].index_copy_(0, rows, m)
        table.row_state["exp_avg_sq"].index_copy_(0, rows, v)
        bias1, bias2 = 1 - b1**step, 1 - b2**step
        denom = (v.sqrt() / math.sqrt(bias2)).add_(self.defaults["eps"])
        table.weight.index_copy_(0, rows, table.weight.index_select(0, rows).addcdiv_(m, denom, value=-self.lr / bias1))


OPTIMIZERS = {"sgd": SparseSGD, "adagrad": SparseAdagrad, "rowwise_adagrad": RowWiseAdagrad, "adam": SparseAdam}
