"""Data on the device (training/device_data.py): which datasets are in memory, the
decision and its refusals, and the command line's runs through the same code path on
the CPU (the GPU's runs are in test_cuda.py): a plug-in's TensorDataset on the device
trains step for step as it does through torch's DataLoader, and the outcome is recorded.
"""
import json
import os
import sys
import time

import numpy as np
import pytest
import torch

from conftest import read_released, run_cli
from dbs_mpi.options import UserError
from dbs_mpi.training import device_data
from dbs_mpi.training.batches import Dataset, InMemoryLoader, augment, host_to

PLUGIN = '''
import torch

def blobs(split):
    """A TensorDataset of 4 classes of 1x8x8 images (the train and test splits differ)."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    n = 480 if split == "train" else 96
    y = torch.randint(4, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g)
    x[torch.arange(n), 0, 2 * y, 2 * y] += 3.0
    return torch.utils.data.TensorDataset(x, y)

def flat(split):
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(2, (64,), generator=g))

def items(split):
    return [(torch.zeros(1, 8, 8), i % 2) for i in range(64)]
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    path = tmp_path / "deviceplug.py"
    path.write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sys.modules.pop("deviceplug", None)
    return path


def tensors(n=40, classes=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(classes, (n,), generator=g)


def test_in_memory_views_a_tensor_dataset_and_nothing_read_by_item():
    x, y = tensors()
    view = device_data.in_memory(torch.utils.data.TensorDataset(x, y), name="mine")
    assert isinstance(view, Dataset) and view.x is x and view.y is y and view.num_classes == int(y.max()) + 1
    assert device_data.in_memory(torch.utils.data.TensorDataset(x, y), num_classes=7).num_classes == 7
    built_in = Dataset(x, y, 3, "built-in")
    assert device_data.in_memory(built_in) is built_in
    assert device_data.in_memory(torch.utils.data.TensorDataset(x, y.float())) is None      # labels not int64
    assert device_data.in_memory(torch.utils.data.TensorDataset(x)) is None                 # no labels
    assert device_data.in_memory([(x[0], 1)]) is None                                      # read item by item

    class Shifted(torch.utils.data.TensorDataset):       # a subclass's items are its own, not the tensors' rows
        def __getitem__(self, i):
            return self.tensors[0][i] + 1, self.tensors[1][i]
    assert device_data.in_memory(Shifted(x, y)) is None


def test_the_decision_and_its_refusals():
    x, y = tensors()
    view = Dataset(x, y, 3, "d")
    need = device_data.data_bytes(view)
    assert need == x.numel() * 4 + y.numel() * 8
    assert device_data.decide("off", "cuda:0", [view], 1, 10 * need) is False
    assert device_data.decide("auto", "cpu", [view]) is False           # a CPU rank's data is in its memory
    assert device_data.decide("on", "cpu", [view]) is True              # ... and stays there
    assert device_data.decide("auto", "cuda:0", [view], 1, 10 * need) is True
    # two ranks sharing the GPU need two copies within MEMORY_SHARE of the free memory
    free = int(2 * need / device_data.MEMORY_SHARE["on"])
    assert device_data.decide("on", "cuda:0", [view], 2, free) is True
    assert device_data.decide("auto", "cuda:0", [view], 2, free) is False     # auto takes a quarter at most
    assert device_data.decide("auto", "cuda:0", [view], 1, free) is True
    with pytest.raises(UserError, match=r"^data_on_device: the data takes .* for the 3 rank\(s\) on cuda:0, more "
                                        r"than 50% of its .* free; use auto or off, or less data$"):
        device_data.decide("on", "cuda:0", [view], 3, free)
    assert device_data.decide("auto", "cuda:0", [view, None], 1, 10 * need) is False
    with pytest.raises(UserError, match="^data_on_device: on needs the data in memory"):
        device_data.decide("on", "cuda:0", [view, None], 1, 10 * need)
    with pytest.raises(UserError, match="^data_on_device: must be one of auto, on, off"):
        device_data.decide("yes", "cpu", [view])


class Batches:
    """What InMemoryLoader reads of a HeteroSampler: the epoch and its index arrays."""
    epoch = 0

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays)

    def iter_arrays(self):
        yield from self.arrays


def test_the_api_puts_a_tensor_dataset_on_the_device_and_its_loader_indexes_it_there():
    x, y = tensors()
    placed = device_data.data_on_device(torch.utils.data.TensorDataset(x, y), "cpu")
    assert placed.x is x                                 # on its device already: no copy
    assert device_data.to_device(placed, "cpu") is placed
    arrays = [np.array([3, 0, 9]), np.array([39]), np.array([5, 6])]
    for (bx, by), indices in zip(InMemoryLoader(placed, Batches(arrays)), arrays):
        assert torch.equal(bx, x[indices]) and torch.equal(by, y[indices])
    images = Dataset(torch.randn(40, 3, 8, 8), y, 3, "images")
    for (bx, _), indices in zip(InMemoryLoader(images, Batches(arrays), augment=True, seed=4), arrays):
        assert torch.equal(bx, augment(images.x[indices], indices, 0, 4))


def test_host_to_is_a_view_on_the_cpu_and_augmentation_runs_where_the_batch_is():
    indices = np.array([4, 1, 7])
    where = host_to(indices, "cpu")
    assert where.dtype == torch.int64 and np.shares_memory(where.numpy(), indices)
    x = torch.randn(3, 3, 8, 8)
    out = augment(x, indices, epoch=2, seed=5)
    assert out.device == x.device and out.shape == x.shape


def train(plugin_or_dataset, out, *extra, ranks=1):
    return run_cli(["train", "--dataset", plugin_or_dataset, "--num-classes", "4", "--model", "mlp", "--epochs", "2",
                    "--global-batch", "64",
                    "--strategy", "ssgd", "--out", str(out), "--progress", "false", *extra], ranks=ranks, timeout=180)


def test_a_tensor_dataset_on_the_device_trains_as_through_a_dataloader(plugin, tmp_path):
    """`--data-on-device on` takes a plug-in's TensorDataset to the in-memory fast path
    (here the CPU, the same code as a GPU's); `off` leaves it to torch's DataLoader: the
    same samples in the same batches, so the same losses, bit for bit."""
    runs = {}
    for mode in ("on", "off"):
        out = tmp_path / f"{mode}.h5"
        proc = train("deviceplug:blobs", out, "--data-on-device", mode)
        assert proc.returncode == 0, proc.stderr
        runs[mode] = read_released(out, time.time() + 30)
    on, off = runs["on"], runs["off"]
    assert list(on["attrs"]["rank_data_on_device"]) == [True] and list(off["attrs"]["rank_data_on_device"]) == [False]
    assert json.loads(on["attrs"]["config"])["data_on_device"] == "on"
    np.testing.assert_array_equal(on["data"]["step/loss"], off["data"]["step/loss"])
    np.testing.assert_array_equal(on["data"]["epoch/test_accuracy"], off["data"]["epoch/test_accuracy"])


def test_auto_leaves_a_cpu_ranks_data_where_it_is(tmp_path):
    out = tmp_path / "auto.h5"
    proc = train("synthetic", out, ranks=2)
    assert proc.returncode == 0, proc.stderr
    run = read_released(out, time.time() + 30)
    assert list(run["attrs"]["rank_data_on_device"]) == [False, False]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "deviceplug:items", "--data-on-device", "on", "--num-classes", "2", "--model", "mlp"],
     "data_on_device: on needs the data in memory"),
    (["--dataset", "deviceplug:blobs", "--num-classes", "4", "--augment", "true", "--model", "mlp"],
     "augment: the built-in augmentation is the built-in datasets'"),
    (["--dataset", "synthetic", "--data-on-device", "on", "--loader", "dataloader"],
     "data_on_device: on indexes the data where it is"),
    (["--dataset", "synthetic", "--data-on-device", "maybe"], "data_on_device: must be one of auto, on, off"),
    (["--dataset", "deviceplug:blobs", "--num-classes", "4", "--channels-last", "true", "--model", "mlp",
      "--strategy", "asgd"],
     "channels_last: runs with the synchronous strategies"),
])
def test_bad_choices_give_one_line_and_exit_2_on_every_rank(plugin, tmp_path, args, message):
    out = tmp_path / "bad.h5"
    proc = run_cli(["train", *args, "--epochs", "1", "--out", str(out), "--progress", "false"], ranks=2, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()


def test_channels_last_needs_images(plugin, tmp_path):
    out = tmp_path / "flat.h5"
    proc = run_cli(["train", "--dataset", "deviceplug:flat", "--num-classes", "2", "--model", "mlp", "--channels-last", "true",
                    "--epochs", "1", "--out", str(out), "--progress", "false"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "channels_last: orders images (channels, height, width); deviceplug:flat's samples have shape (16,)" \
        in proc.stderr
    assert not out.exists()


def test_channels_last_trains_as_the_default_order_up_to_rounding(tmp_path):
    """LeNet-5's weights and batches in channels-last order on the CPU: the same steps
    as in the default order, up to the convolutions' rounding."""
    runs = []
    for flag in ("false", "true"):
        out = tmp_path / f"cl-{flag}.h5"
        proc = run_cli(["train", "--dataset", "synthetic", "--model", "lenet5", "--epochs", "1", "--global-batch", "64",
                        "--synthetic-samples", "512", "--strategy", "ssgd", "--channels-last", flag, "--out", str(out),
                        "--progress", "false"], timeout=180)
        assert proc.returncode == 0, proc.stderr
        runs.append(read_released(out, time.time() + 30))
    np.testing.assert_allclose(runs[1]["data"]["step/loss"], runs[0]["data"]["step/loss"], rtol=1e-4)
    assert json.loads(runs[1]["attrs"]["config"])["channels_last"] is True
