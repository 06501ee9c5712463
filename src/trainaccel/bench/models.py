"""Benchmark models: ResNet-18/50 and ResNeXt-50 (32x4d) with torchvision's architecture, and a wide MLP.

torchvision is not a dependency; these match its parameter counts exactly (tests check).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn


def _conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, groups: int, base_width: int):
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(cin, planes, stride), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, groups: int, base_width: int):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1, self.bn1 = _conv1x1(cin, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride, groups), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv1x1(width, planes * self.expansion), nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """The ImageNet ResNet/ResNeXt family (He et al. 2016; Xie et al. 2017), v1.5 strides."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        groups: int = 1,
        width_per_group: int = 64,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], 64
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stage = []
            for j in range(blocks):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(block(cin, planes, stride, groups, width_per_group))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class WideMLP(nn.Sequential):
    """A bandwidth-heavy model: ~19M parameters and little compute per parameter."""

    def __init__(self, in_features: int = 1024, num_classes: int = 1000):
        super().__init__(
            nn.Linear(in_features, 4096),
            nn.ReLU(),
            nn.Linear(4096, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, num_classes),
        )


class DeepMLP(nn.Sequential):
    """A model of many equal blocks, as a transformer is (~105M parameters): what sharding is measured on."""

    def __init__(self, in_features: int = 1024, width: int = 2048, depth: int = 24, num_classes: int = 1000):
        layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers, nn.Linear(width, num_classes))


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """A model for `trainaccel bench` and the shape of one synthetic example for it."""

    name: str
    build: Callable[[], nn.Module]
    image: bool  # takes (3, size, size) images; otherwise a flat vector of 1024 features
    num_classes: int = 1000

    def example_shape(self, image_size: int) -> tuple[int, ...]:
        return (3, image_size, image_size) if self.image else (1024,)


MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel("resnet18", lambda: ResNet(BasicBlock, [2, 2, 2, 2]), image=True),
        BenchModel("resnet50", lambda: ResNet(Bottleneck, [3, 4, 6, 3]), image=True),
        BenchModel(
            "resnext50_32x4d", lambda: ResNet(Bottleneck, [3, 4, 6, 3], groups=32, width_per_group=4), image=True
        ),
        BenchModel("mlp", WideMLP, image=False),
        BenchModel("deep-mlp", DeepMLP, image=False),
    )
}


def get_model(name: str) -> BenchModel:
    if name not in MODELS:
        raise ValueError(f"invalid model {name!r}; accepted: {', '.join(MODELS)}")
    return MODELS[name]
