"""Models: exact parameter counts, shapes forward and backward, what each norm means
for uneven local batches, and build_model's errors. No MPI."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from dbs_mpi.tools.models import (RESNET_GROUPS, CifarQuickCNN, ResNet20, build_model, caffe_pooled_size,
                                  num_parameters)


@pytest.mark.parametrize("name, shape, count", [
    ("lenet5", (1, 28, 28), 61_706),
    ("mlp", (1, 28, 28), 235_146),
    ("resnet20", (3, 32, 32), 269_722),
    ("cifar-cnn", (3, 32, 32), 145_578),
    ("cifar-cnn", (1, 28, 28), 115_306),   # 64 * 3 * 3 features before the first linear layer
])
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_parameter_counts(name, shape, count, norm):
    assert num_parameters(build_model(name, shape, 10, norm=norm)) == count


def test_cifar_cnn_count_layer_by_layer():
    conv = 3 * 32 * 25 + 32 + 32 * 32 * 25 + 32 + 32 * 64 * 25 + 64
    linear = 64 * 4 * 4 * 64 + 64 + 64 * 10 + 10
    assert num_parameters(CifarQuickCNN()) == conv + linear == 145_578


def test_resnet20_has_20_weighted_layers_and_parameter_free_shortcuts():
    model = ResNet20()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 20
    assert all(c.kernel_size == (3, 3) for c in convs)                       # no 1x1 projection (option A)
    assert sorted({c.out_channels for c in convs}) == [16, 32, 64]


@pytest.mark.parametrize("norm, kind", [("group", nn.GroupNorm), ("batch", nn.BatchNorm2d)])
def test_resnet20_forward_backward(norm, kind):
    model = build_model("resnet20", (3, 32, 32), 10, norm=norm)
    norms = [m for m in model.modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    assert len(norms) == 19 and all(isinstance(m, kind) for m in norms)
    if norm == "group":
        assert {m.num_groups for m in norms} == {RESNET_GROUPS}
    x = torch.randn(5, 3, 32, 32)
    out = model(x)
    assert out.shape == (5, 10)
    nn.functional.cross_entropy(out, torch.randint(0, 10, (5,))).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert model.head[2].weight.grad.abs().sum() > 0 and model.stem[0].weight.grad.abs().sum() > 0


def test_resnet20_takes_other_input_sizes_and_classes():
    assert build_model("resnet20", (1, 28, 28), 7)(torch.randn(2, 1, 28, 28)).shape == (2, 7)


def test_group_norm_output_does_not_depend_on_the_local_batch():
    """Why "group" is the default: in training mode a sample's output is the same
    whatever else is in its local batch; with BatchNorm it is not."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, 32)
    group = build_model("resnet20", (3, 32, 32), 10, norm="group").train()
    torch.testing.assert_close(group(x)[:2], group(x[:2]), rtol=1e-4, atol=1e-5)
    batch = build_model("resnet20", (3, 32, 32), 10, norm="batch").train()
    assert not torch.allclose(batch(x)[:2], batch(x[:2]), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("side", [12, 28, 32, 33])
def test_cifar_cnn_pooling_rounds_up_like_caffe(side):
    model = CifarQuickCNN(3, 10, side, side)
    features = model.features(torch.zeros(1, 3, side, side))
    expected = side
    for _ in range(3):
        expected = caffe_pooled_size(expected)
    assert features.shape == (1, 64, expected, expected)
    assert model(torch.randn(2, 3, side, side)).shape == (2, 10)
    assert caffe_pooled_size(32) == 16 and caffe_pooled_size(16) == 8 and caffe_pooled_size(8) == 4


def test_cifar_cnn_backward():
    model = build_model("cifar-cnn", (3, 32, 32), 10)
    nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name, shape, norm, words", [
    ("resnet20", (3, 32), "group", r"shape \(C, H, W\)"),
    ("resnet20", (784,), "group", r"shape \(C, H, W\)"),
    ("mlp", (1, 0, 28), "group", "positive sizes"),
    ("lenet5", (1, 28, 32), "group", "square"),
    ("lenet5", (1, 12, 12), "group", "at least 16x16"),
    ("cifar-cnn", (3, 8, 8), "group", "at least 12x12"),
    ("resnet20", (3, 32, 32), "layer", "unknown norm"),
    ("resnet56", (3, 32, 32), "group", "unknown model"),
])
def test_build_model_errors(name, shape, norm, words):
    with pytest.raises(ValueError, match=words):
        build_model(name, shape, 10, norm=norm)


def test_models_and_data_never_import_mpi():
    code = "import sys, dbs_mpi.tools.models, dbs_mpi.tools.data; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
