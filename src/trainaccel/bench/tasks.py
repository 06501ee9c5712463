"""Real tasks for `trainaccel bench quality`: real data that ships with a package, a model, the user's optimizer.

- `text`: a byte-level causal transformer on the Python Language Reference (CPython's own
  `pydoc_data.topics`, about 465 kB of English prose and code), trained with AdamW.
- `digits`: a convolutional network on the UCI handwritten digits (1,797 8x8 images, shipped
  with scikit-learn as `load_digits`), trained with SGD with Nesterov momentum.

Each task splits its data into a training and a held-out validation part, the same on every run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Split:
    """One part of a task's data: `take(index)` gives the inputs and targets of those examples."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class TextWindows(Split):
    """Every window of `context` bytes of a text, with the bytes that follow each; made when taken."""

    def __init__(self, data: torch.Tensor, context: int, stride: int = 1):
        self.data, self.context = data, context
        self.starts = torch.arange(0, len(data) - context - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunks = self.data[self.starts[index][:, None] + torch.arange(self.context + 1)].long()
        return chunks[:, :-1], chunks[:, 1:]


class ByteTransformer(nn.Module):
    """A GPT-style decoder over bytes: pre-norm blocks, learned positions, tied input and output embedding."""

    def __init__(self, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(x) @ self.embed.weight.t()  # (batch, n, 256) logits of the next byte


class DigitsNet(nn.Module):
    """A small convolutional classifier for 8x8 images: two 3x3 convolutions, then two linear layers."""

    def __init__(self, channels: int = 64, hidden: int = 512):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * channels * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


@dataclasses.dataclass(frozen=True)
class Task:
    """What a quality benchmark trains: its data, model, optimizer and default run length."""

    name: str
    description: str
    load: Callable[[], tuple[Split, Split]]  # (train, validation)
    build: Callable[[], nn.Module]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int  # examples per worker per step
    steps: int
    metric: str  # what `accuracy` counts: "next-byte accuracy" or "accuracy"

    def batches(self, train: Split, batch_size: int, seed: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """Draws batches of the training split at random, from a generator of its own: `batch_size` examples, or
        as many as the call asks."""
        g = torch.Generator().manual_seed(seed)

        def draw(size: int = batch_size) -> tuple[torch.Tensor, torch.Tensor]:
            return train.take(torch.randint(0, len(train), (size,), generator=g))

        return draw

    @torch.no_grad()
    def evaluate(self, model: nn.Module, validation: Split, batch_size: int = 256) -> tuple[float, float]:
        """Mean loss and accuracy of `model` over the whole validation split."""
        was_training = model.training
        model.eval()
        loss = correct = count = 0.0
        for start in range(0, len(validation), batch_size):
            x, y = validation.take(torch.arange(start, min(start + batch_size, len(validation))))
            logits = model(x)
            loss += float(self.loss(logits, y)) * y.numel()
            correct += float((logits.argmax(-1) == y).sum())
            count += y.numel()
        model.train(was_training)
        return loss / count, correct / count


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


TEXT_CONTEXT = 64


def load_text(context: int = TEXT_CONTEXT, held_out: float = 0.1) -> tuple[Split, Split]:
    """Windows of `context` bytes and their next bytes; the last tenth of the text is held out."""
    from pydoc_data.topics import topics  # part of CPython: no download, the same on every machine

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * (1 - held_out))
    # Every offset is a training window; validation takes 256 windows spread over the held-out text.
    held = TextWindows(data[cut:], context, stride=context)
    return TextWindows(data[:cut], context), Split(*held.take(torch.linspace(0, len(held) - 1, 256).long()))


def load_digits(held_out: float = 0.2) -> tuple[Split, Split]:
    """The 8x8 digits scaled to [0, 1], shuffled once with a fixed seed; the last fifth held out."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise RuntimeError(
            "the digits task needs scikit-learn, which ships the data: pip install 'trainaccel[bench]'"
        ) from None
    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], labels[order]
    cut = int(len(labels) * (1 - held_out))
    return Split(images[:cut], labels[:cut]), Split(images[cut:], labels[cut:])


def _adamw(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _sgd_momentum(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over the first 5% of steps, then cosine decay to a tenth: the usual recipe."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "text",
            "byte-level transformer (4 layers, width 192) on the Python Language Reference, AdamW",
            load_text,
            lambda: ByteTransformer(width=192, layers=4, heads=4, context=TEXT_CONTEXT),
            _adamw,
            _cross_entropy,
            batch_size=8,
            steps=300,
            metric="next-byte accuracy",
        ),
        Task(
            "digits",
            "convolutional network on the UCI 8x8 handwritten digits, SGD with Nesterov momentum",
            load_digits,
            DigitsNet,
            _sgd_momentum,
            _cross_entropy,
            batch_size=32,
            steps=300,
            metric="accuracy",
        ),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"invalid task {name!r}; accepted: {', '.join(TASKS)}")
    return TASKS[name]


def task_flags(args: Any, seed: int, out: Any) -> list[str]:
    """A quality worker's flags for the task of `bench quality`'s `args` (read by `add_task_arguments`)."""
    return [
        f"--task={args.task}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--eval-every={args.eval_every}",
        f"--seed={seed}",
        f"--out={out}",
    ]


def add_task_arguments(parser: Any) -> None:
    """A quality worker's task flags (`task_flags`): what it trains, for how long, from which seed, and where its
    result goes."""
    parser.add_argument("--task", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
