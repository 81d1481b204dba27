"""Model definitions. Plain PyTorch modules: no MPI, nothing about distribution."""
from __future__ import annotations

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) for 1x28x28 inputs (padded first convolution), with
    ReLU and max pooling: 61,706 parameters for 10 classes."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        pad = 2 if image_size == 28 else 0
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = ((image_size + 2 * pad - 4) // 2 - 4) // 2
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * side * side, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Two hidden layers of 256 and 128 units: 235,146 parameters for 1x28x28, 10 classes."""

    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden=(256, 128)):
        super().__init__()
        layers, width = [nn.Flatten()], in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def build_model(name: str, sample_shape, num_classes: int) -> nn.Module:
    """The model `name` for inputs of sample_shape (C, H, W)."""
    c, h, w = sample_shape
    if name == "lenet5":
        if h != w:
            raise ValueError(f"lenet5 needs square inputs, got {h}x{w}")
        return LeNet5(c, num_classes, h)
    if name == "mlp":
        return MLP(c * h * w, num_classes)
    raise ValueError(f"unknown model {name!r}")


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
