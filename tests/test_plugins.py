"""Plug-ins: --model, --dataset and --loss as MODULE:CALLABLE or file.py:CALLABLE.

Unit tests of the contracts (plugins.py), then the command line as users run it: every
strategy with a plug-in model and dataset, checkpoints and resume, emulated speeds;
bad specs get one line naming the spec and exit 2 on every rank, within seconds."""
import os
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from conftest import run_cli
from dbs_mpi.tools import plugins
from dbs_mpi.tools.config import UserError
from dbs_mpi.training.results import read_run

PLUGIN = '''
import torch
import torch.nn.functional as F
from torch import nn


class Tiles(torch.utils.data.Dataset):
    """4 classes of 1x8x8 images; item i is (image, int label)."""
    classes = ["a", "b", "c", "d"]

    def __init__(self, split, size=None):
        self.size = size or (480 if split == "train" else 96)
        self.offset = 0 if split == "train" else 10_000

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + int(i))
        label = int(torch.randint(4, (1,), generator=g))
        x = torch.randn(1, 8, 8, generator=g)
        x[:, 4 * (label // 2):4 * (label // 2) + 4, 4 * (label % 2):4 * (label % 2) + 4] += 1.0
        return x, label


def tiles(split):
    return Tiles(split)


class Net(nn.Module):
    def __init__(self, sample_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(sample_shape[0] * sample_shape[1] * sample_shape[2], num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


def net_with_kwargs(**kw):
    return Net(kw["sample_shape"], kw["num_classes"])


def net_bare():
    return Net((1, 8, 8), 4)


def needs_depth(depth, num_classes):
    return Net((1, 8, 8), num_classes)


def not_a_model():
    return 3


def items_without_labels(split):
    return [torch.zeros(1, 8, 8)] * 8


def generator_dataset(split):
    return iter([])


def broken(split):
    raise OSError("disk on fire")


def summed(output, target):
    return F.cross_entropy(output, target, reduction="sum")


def per_sample(output, target):
    return F.cross_entropy(output, target, reduction="none")


def smooth(output, target):
    return F.cross_entropy(output, target, label_smoothing=0.1)


COUNT = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plug-in module, importable as `tinyplug` (PYTHONPATH) and by its path."""
    path = tmp_path / "tinyplug.py"
    path.write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sys.modules.pop("tinyplug", None)
    yield path
    sys.modules.pop("tinyplug", None)


# --- the contracts, one process ------------------------------------------------------

def test_specs_name_a_module_from_pythonpath_or_a_file(plugin):
    assert plugins.load_callable("tinyplug:tiles", "dataset")("train").size == 480
    assert plugins.load_callable(f"{plugin}:Tiles", "dataset")("test").size == 96
    assert plugins.load_callable("torch.nn:CrossEntropyLoss", "loss") is nn.CrossEntropyLoss
    assert not plugins.is_spec("lenet5") and plugins.is_spec("a:b")


@pytest.mark.parametrize("spec, message", [
    ("nosuchmodule_xyz:Net", "model: nosuchmodule_xyz:Net: cannot import nosuchmodule_xyz (ModuleNotFoundError"),
    ("tinyplug:Nope", "model: tinyplug:Nope: tinyplug has no attribute 'Nope'"),
    ("tinyplug:COUNT", "model: tinyplug:COUNT: COUNT is not callable (type int)"),
    ("no/such/file.py:Net", "model: no/such/file.py:Net: cannot import no/such/file.py (FileNotFoundError"),
    (":Net", "model: ':Net' is not MODULE:CALLABLE"),
    ("tinyplug:not_a_model", "model: tinyplug:not_a_model returned type int, not a torch.nn.Module"),
    ("tinyplug:needs_depth", "model: tinyplug:needs_depth requires depth; a model factory may take only"),
])
def test_bad_model_specs_name_the_spec_and_what_is_wrong(plugin, spec, message):
    with pytest.raises(UserError) as exc:
        plugins.build_model(spec, (1, 8, 8), 4)
    assert str(exc.value).startswith(message), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_model_factory_gets_the_keywords_it_names(plugin):
    for spec in ("tinyplug:Net", "tinyplug:net_with_kwargs", "tinyplug:net_bare", f"{plugin}:Net"):
        model = plugins.build_model(spec, (1, 8, 8), 4)
        assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    assert type(plugins.build_model("lenet5", (1, 28, 28), 10)).__name__ == "LeNet5"
    with pytest.raises(UserError, match="^model: lenet5 needs square inputs"):
        plugins.build_model("lenet5", (1, 28, 20), 10)


@pytest.mark.parametrize("spec, message", [
    ("tinyplug:items_without_labels", "dataset: tinyplug:items_without_labels('train')[0] is of type Tensor, not "
                                      "(input tensor, int label)"),
    ("tinyplug:generator_dataset", "dataset: tinyplug:generator_dataset('train') returned type list_iterator, "
                                   "not a map-style Dataset"),
    ("tinyplug:broken", "dataset: tinyplug:broken('train') failed (OSError: disk on fire)"),
])
def test_bad_dataset_specs_name_the_spec_and_what_is_wrong(plugin, spec, message):
    with pytest.raises(UserError) as exc:
        plugins.load_dataset(spec, "train")
    assert str(exc.value).startswith(message), str(exc.value)


def test_losses_must_be_scalar_means(plugin):
    model = nn.Linear(3, 4)
    x, y = torch.randn(2, 3), torch.tensor([1, 2])
    for spec in ("", "torch.nn:CrossEntropyLoss", "tinyplug:smooth", "torch.nn.functional:cross_entropy"):
        plugins.check_loss(plugins.build_loss(spec), model, x, y, spec)
    with pytest.raises(UserError, match="tinyplug:summed is not the mean over the batch"):
        plugins.check_loss(plugins.build_loss("tinyplug:summed"), model, x, y, "tinyplug:summed")
    with pytest.raises(UserError, match=r"tinyplug:per_sample returned Tensor torch.Size\(\[1\]\), not a scalar"):
        plugins.check_loss(plugins.build_loss("tinyplug:per_sample"), model, x, y, "tinyplug:per_sample")
    with pytest.raises(UserError, match="loss: 'nll' is not MODULE:CALLABLE"):
        plugins.build_loss("nll")


# --- the command line -------------------------------------------------------------------

TRAIN = ["train", "--model", "tinyplug:Net", "--dataset", "tinyplug:tiles", "--global-batch", "48",
         "--benchmark-steps", "1", "--benchmark-warmup", "0", "--lr", "0.05"]


@pytest.mark.parametrize("strategy, ranks, extra", [
    ("ssgd", 2, []), ("static", 3, ["--speeds", "1,0.5,0.25"]), ("dbs", 2, ["--optimizer", "adamw", "--lr", "0.01"]),
    ("asgd", 3, []), ("nsoftsync", 3, ["--optimizer", "adam", "--lr", "0.01"]), ("dbs-sgd", 3, ["--speeds", "1,1,0.5"]),
])
def test_every_strategy_trains_a_plug_in_model_on_a_plug_in_dataset(plugin, tmp_path, strategy, ranks, extra):
    out = tmp_path / f"{strategy}.h5"
    proc = run_cli([*TRAIN, "--strategy", strategy, "--epochs", "2", "--loader-workers", "1", "--loss",
                    "torch.nn:CrossEntropyLoss", "--out", str(out), *extra], ranks=ranks, timeout=240)
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    attrs = run["attrs"]
    assert attrs["status"] == "complete" and attrs["model"] == "tinyplug:Net" and attrs["model_class"] == "tinyplug.Net"
    assert attrs["dataset"] == "tinyplug:tiles" and attrs["loss"] == "torch.nn:CrossEntropyLoss"
    assert attrs["num_parameters"] == 8 * 8 * 4 + 4
    accuracy = run["data"]["epoch/test_accuracy"]
    assert accuracy.shape == (2,) and accuracy[-1] > 0.4, "4 classes: chance is 25%"


def test_a_plug_in_run_resumes_and_extends(plugin, tmp_path):
    out = tmp_path / "resume.h5"
    spec_file = ["--model", f"{plugin}:Net", "--dataset", f"{plugin}:Tiles"]
    proc = run_cli([*TRAIN, *spec_file, "--strategy", "dbs", "--epochs", "1", "--out", str(out)], ranks=2)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(["train", "--resume", str(out), "--epochs", "2"], ranks=2)
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    assert run["attrs"]["status"] == "complete" and len(run["attrs"]["resumed"]) == 1
    assert run["data"]["epoch/train_loss"].shape == (2,)


@pytest.mark.parametrize("args, message", [
    (["--model", "tinyplug:Nope"], "dbs-mpi: error: model: tinyplug:Nope: tinyplug has no attribute 'Nope'"),
    (["--dataset", "tinyplug:broken"], "dbs-mpi: error: dataset: tinyplug:broken('train') failed (OSError: disk"),
    (["--loss", "tinyplug:summed"], "dbs-mpi: error: loss: tinyplug:summed is not the mean over the batch"),
    (["--optimizer", "lamb"], "dbs-mpi: error: optimizer: must be one of sgd, adam, adamw"),
])
def test_bad_specs_give_one_line_and_exit_2_on_every_rank(plugin, tmp_path, args, message):
    out = tmp_path / "bad.h5"
    start = time.monotonic()
    proc = run_cli([*TRAIN, "--epochs", "1", "--out", str(out), *args], ranks=2, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dbs-mpi: error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and errors[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert time.monotonic() - start < 30


def test_plug_in_datasets_need_a_class_count(plugin, tmp_path):
    (tmp_path / "nocls.py").write_text(textwrap.dedent('''
        import torch
        class Plain(torch.utils.data.Dataset):
            def __init__(self, split): pass
            def __len__(self): return 64
            def __getitem__(self, i): return torch.zeros(1, 8, 8), i % 3
    '''))
    args = [*TRAIN, "--dataset", f"{tmp_path / 'nocls.py'}:Plain", "--epochs", "1"]
    proc = run_cli([*args, "--out", str(tmp_path / "a.h5")])
    assert proc.returncode == 2 and "num_classes: " in proc.stderr and "set num_classes" in proc.stderr
    proc = run_cli([*args, "--num-classes", "3", "--out", str(tmp_path / "b.h5")])
    assert proc.returncode == 0, proc.stderr
