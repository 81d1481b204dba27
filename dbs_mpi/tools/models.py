"""Model definitions. Plain PyTorch modules: no MPI, nothing about distribution.

Parameter counts (10 classes), checked exactly by tests/test_models.py:

    lenet5     1x28x28     61,706
    mlp        1x28x28    235,146
    resnet20   3x32x32    269,722   (either norm; any input size: global average pooling)
    cifar-cnn  3x32x32    145,578
"""
from __future__ import annotations

import numbers

import torch.nn.functional as F
from torch import nn

NORMS = ("group", "batch")
RESNET_GROUPS = 8   # GroupNorm groups in resnet20: 2, 4 and 8 channels per group at widths 16, 32, 64


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


# --- ResNet-20 -----------------------------------------------------------------

def norm_layer(norm: str, channels: int) -> nn.Module:
    """BatchNorm2d, or GroupNorm with RESNET_GROUPS groups. GroupNorm normalises each
    sample on its own, so a rank's statistics do not depend on its local batch size
    (the DBS authors replaced BatchNorm by GroupNorm for that reason)."""
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(RESNET_GROUPS, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (He et al. 2016, option A: identity, or when
    the block halves the size and widens, the input subsampled by 2 with the new
    channels zero: no parameters)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm_layer(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = norm_layer(norm, out_channels)
        self.stride, self.extra_channels = stride, out_channels - in_channels

    def shortcut(self, x):
        if self.stride > 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR-10 (He et al. 2016, section 4.2): a 3x3 convolution of 16
    channels, three stages of three basic blocks at 16, 32 and 64 channels (the last two
    stages start with stride 2), global average pooling and one linear layer; option A
    shortcuts; Kaiming-normal initialisation. 269,722 parameters for 3 input channels
    and 10 classes, with either norm ("group" or "batch": same parameter count)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, norm: str = "group"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), norm_layer(norm, 16), nn.ReLU())
        blocks, width = [], 16
        for out_channels, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(width, out_channels, stride if i == 0 else 1, norm))
                width = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


# --- the small CIFAR-10 CNN -------------------------------------------------------

def caffe_pooled_size(size: int, kernel: int = 3, stride: int = 2) -> int:
    """Output side of an unpadded pooling with Caffe's (and ceil_mode's) rounding up."""
    return -(-(size - kernel) // stride) + 1


class CifarQuickCNN(nn.Module):
    """Caffe's "cifar10_quick" network, the CIFAR-10 model of the staleness-aware ASGD
    experiments: three 5x5 convolutions (32, 32, 64 channels, padding 2), each followed
    by 3x3 stride-2 pooling (max, then average, average; rounding up as Caffe does),
    then fully connected layers of 64 and num_classes units with no nonlinearity between
    them (as in Caffe's definition). 145,578 parameters for 3x32x32 inputs and 10
    classes; PyTorch's default initialisation. Needs inputs of at least 12x12."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, height: int = 32, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(),
            nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
        )
        h, w = height, width
        for _ in range(3):
            h, w = caffe_pooled_size(h), caffe_pooled_size(w)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * h * w, 64), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def _check_shape(name: str, sample_shape) -> tuple[int, int, int]:
    shape = tuple(sample_shape)
    if len(shape) != 3 or not all(isinstance(s, numbers.Integral) and s > 0 for s in shape):
        raise ValueError(f"{name} needs samples of shape (C, H, W) with positive sizes, got {list(shape)}")
    return tuple(int(s) for s in shape)


def build_model(name: str, sample_shape, num_classes: int, *, norm: str = "group") -> nn.Module:
    """The model `name` for inputs of sample_shape (C, H, W) and num_classes outputs.
    `norm` ("group" or "batch") is resnet20's normalisation; the other models have none.
    Raises ValueError for an unknown name or norm, or a shape the model cannot take."""
    c, h, w = _check_shape(name, sample_shape)
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r} (choose from {', '.join(NORMS)})")
    if name == "lenet5":
        if h != w or h < 16:
            raise ValueError(f"lenet5 needs square inputs of at least 16x16, got {h}x{w}")
        return LeNet5(c, num_classes, h)
    if name == "mlp":
        return MLP(c * h * w, num_classes)
    if name == "resnet20":
        return ResNet20(c, num_classes, norm)
    if name == "cifar-cnn":
        if min(h, w) < 12:
            raise ValueError(f"cifar-cnn needs inputs of at least 12x12, got {h}x{w}")
        return CifarQuickCNN(c, num_classes, h, w)
    raise ValueError(f"unknown model {name!r}")


def num_parameters(model: nn.Module) -> int:
    """Number of trainable values (weights and biases) in the model."""
    return sum(p.numel() for p in model.parameters())
