"""Stand-in for a user's own project: a model and a dataset that dbs-mpi knows nothing
about. examples/train_api.py trains them with the library API, examples/train_cli.sh
with `dbs-mpi train` and its plug-in options.

Shapes: 16 classes of 1x32x32 images. Each class is a faint square at its own place (up
to 2 pixels off) on a noisy background: about 66% test accuracy after 3 epochs of the
examples. Samples are drawn lazily, one per index (as a file-backed dataset reads one
file per index), and the same index always gives the same sample.
"""
import torch
from torch import nn
from torch.utils.data import Dataset


class Squares(Dataset):
    """A map-style dataset of (image, label): split "train" (8192 samples) or "test" (2048)."""
    classes = [f"square-{i}" for i in range(16)]

    def __init__(self, split: str = "train", size: int | None = None):
        if split not in ("train", "test"):
            raise ValueError(f"split must be train or test, got {split!r}")
        self.offset = 0 if split == "train" else 10 ** 6
        self.size = size or (8192 if split == "train" else 2048)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + int(index))
        label = int(torch.randint(len(self.classes), (1,), generator=g))
        image = torch.randn(1, 32, 32, generator=g)
        row, col = divmod(label, 4)
        dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        top, left = 2 + 7 * row + dy, 2 + 7 * col + dx
        image[:, max(top, 0):top + 6, max(left, 0):left + 6] += 0.5
        return image, label


class SmallNet(nn.Module):
    """Two convolutions and a linear head; any input of 1 channel, 32x32."""

    def __init__(self, num_classes: int = 16):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(16 * 8 * 8, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
