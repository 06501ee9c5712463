"""A module whose weight's gradient is its input, for worker scripts that check reduced gradients against means."""

import torch
from torch import nn


class Weights(nn.Module):
    """d(forward(x))/d(weight) == x, so the reduced gradient is the mean of the inputs."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return (self.weight * x).sum()
