"""What the GPU tests share: a small model, its data, a training loop."""

import torch


class Net(torch.nn.Sequential):
    """A small regression MLP (a BatchNorm for buffers); DDP puts its ~300k parameters in two buckets."""

    def __init__(self) -> None:
        super().__init__(
            torch.nn.Linear(64, 512),
            torch.nn.BatchNorm1d(512),
            torch.nn.Tanh(),
            torch.nn.Linear(512, 512),
            torch.nn.Tanh(),
            torch.nn.Linear(512, 16),
        )


def batches(device: torch.device, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A teacher network's regression task: `steps` batches of 32, on `device`."""
    teacher = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(64, 512, generator=teacher) / 8, torch.randn(512, 16, generator=teacher) / 512**0.5
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, 32, 64, generator=data)
    y = torch.tanh(x @ w1) @ w2
    return list(zip(x.to(device), y.to(device)))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list) -> list[float]:
    """One step per batch; the training losses."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist()
