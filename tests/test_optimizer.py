"""The command line's optimizers (training/named_optimizers.py): torch's SGD, Adam and AdamW
without the wrappers that import torch._dynamo. Every update and state is torch's to the
bit, hooks and grad mode behave as torch's, and no training launch imports torch._dynamo."""
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, mpiexec
from dbs_mpi.training import named_optimizers as optim

CASES = [(optim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
         (optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.0)),
         (optim.SGD, torch.optim.SGD, dict(lr=0.1)),
         (optim.Adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2)),
         (optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2, amsgrad=True))]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")])]


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(8, 6, generator=gen).to(device), torch.randint(0, 3, (8,), generator=gen).to(device)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ours, theirs, kwargs", CASES)
def test_updates_and_state_are_torchs_to_the_bit(ours, theirs, kwargs, device):
    """On a GPU torch takes its multi-tensor (foreach) code: the same for both classes."""
    a, b = _model(device=device), _model(device=device)
    opt_a, opt_b = ours(a.parameters(), **kwargs), theirs(b.parameters(), **kwargs)
    assert isinstance(opt_a, theirs) and type(opt_a).__name__ == theirs.__name__
    _train(a, opt_a, 7)
    _train(b, opt_b, 7)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    _same_state(opt_a.state_dict(), opt_b.state_dict())
    # Checkpoints go both ways: torch's state into ours and on, ours into torch's and on.
    c, d = _model(device=device), _model(device=device)
    c.load_state_dict(b.state_dict())
    d.load_state_dict(a.state_dict())
    opt_c, opt_d = ours(c.parameters(), **kwargs), theirs(d.parameters(), **kwargs)
    opt_c.load_state_dict(opt_b.state_dict())
    opt_d.load_state_dict(opt_a.state_dict())
    _train(c, opt_c, 3, seed=2)
    _train(d, opt_d, 3, seed=2)
    for pc, pd in zip(c.parameters(), d.parameters()):
        assert torch.equal(pc, pd)


def test_step_keeps_grad_mode_hooks_and_closure():
    model = _model()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    assert torch.is_grad_enabled()                          # restored after the step
    assert all(p.grad_fn is None and p.requires_grad for p in model.parameters())   # not recorded
    with torch.no_grad():
        opt.step(closure)                                   # the closure still gets its gradients
        assert not torch.is_grad_enabled()                  # the caller's mode, kept
    assert calls == ["pre", "post"] * 2



FUSED = optim.HAS_FUSED     # (this torch has fused SGD, Adam, AdamW on CPU and CUDA)


def _cfg():
    from types import SimpleNamespace
    return SimpleNamespace(lr=0.05, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, theirs", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                          ("adamw", torch.optim.AdamW)])
def test_the_command_lines_optimizers_are_fused_where_torch_has_it(name, theirs, device):
    """make_optimizer takes torch's one-kernel update from torch 2.4 on (CPU and CUDA), and
    updates as torch's fused class does, to the bit."""
    kwargs = dict(lr=0.05, weight_decay=1e-3, **({"momentum": 0.9} if name == "sgd" else {}))
    a, b = _model(device=device), _model(device=device)
    opt_a = optim.make_optimizer(name, a.parameters(), _cfg())    # (a generator, as train passes it)
    opt_b = theirs(b.parameters(), **kwargs, **({"fused": True} if FUSED else {}))
    assert bool(opt_a.param_groups[0].get("fused")) == FUSED
    _train(a, opt_a, 5)
    _train(b, opt_b, 5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("name, theirs", [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_a_loaded_state_keeps_the_update_of_the_rank_that_loads_it(name, theirs):
    """A state saved by a per-tensor update (an older run, a rank without the fused kernel)
    loads into a fused one and on; and a fused state into a rank without the kernel."""
    kwargs = dict(lr=0.05, weight_decay=1e-3, **({"momentum": 0.9} if name == "sgd" else {}))
    a, b = _model(), _model()
    plain = theirs(a.parameters(), **kwargs)
    _train(a, plain, 3)
    b.load_state_dict(a.state_dict())
    ours = optim.make_optimizer(name, b.parameters(), _cfg())
    ours.load_state_dict(plain.state_dict())
    assert bool(ours.param_groups[0].get("fused")) == FUSED
    _train(b, ours, 2)                                        # (a fused Adam needs its step counts placed for it)
    c = _model()
    c.load_state_dict(b.state_dict())
    without = optim.fused(_without_fused(theirs), c.parameters(), **kwargs)
    without.load_state_dict(ours.state_dict())
    assert not without.param_groups[0].get("fused")
    _train(c, without, 2)


def _without_fused(cls):
    class NoFused(cls):                  # as an older torch's class: no fused argument
        def __init__(self, params, fused=None, **kwargs):
            if fused is not None:
                raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument 'fused'")
            super().__init__(params, **kwargs)
    return NoFused



def test_a_weight_in_channels_last_order_takes_the_per_tensor_update():
    """torch's fused update pairs a weight's and its gradient's elements by memory position:
    a channels-last weight beside a gradient in the default order (as the exchange's flat
    buffer holds it) was updated wrongly. make_optimizer does not fuse such a model."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 6, 5).to(memory_format=torch.channels_last)
    ref = torch.nn.Conv2d(3, 6, 5)
    ref.load_state_dict(conv.state_dict())
    grads = [torch.randn(p.shape) for p in conv.parameters()]            # the default order
    opt = optim.make_optimizer("sgd", conv.parameters(), _cfg())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)
    assert not opt.param_groups[0].get("fused")
    for _ in range(2):
        for model in (conv, ref):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
        opt.step()
        opt_ref.step()
    for p, q in zip(conv.parameters(), ref.parameters()):
        assert torch.equal(p, q)

def test_without_a_fused_kernel_the_optimizer_is_torchs_default():
    model, no_fused = _model(), _without_fused(torch.optim.SGD)
    opt = optim.fused(no_fused, model.parameters(), lr=0.1)    # the generator survives the first try
    assert isinstance(opt, no_fused) and not opt.param_groups[0].get("fused")
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))


PROBE = """
import sys, torch
from dbs_mpi.training.named_optimizers import make_optimizer
from types import SimpleNamespace
cfg = SimpleNamespace(lr=0.1, momentum=0.9, weight_decay=0.0)
for name in ("sgd", "adam", "adamw"):
    p = torch.zeros(3, requires_grad=True)
    opt = make_optimizer(name, [p], cfg)
    p.grad = torch.ones(3)
    opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())
print("ours", "torch._dynamo" in sys.modules)
torch.optim.SGD([p], lr=0.1)
print("torch's", "torch._dynamo" in sys.modules)
"""


def test_no_torch_dynamo_in_the_command_lines_optimizers():
    """The reason they exist: a rank that trains never imports torch._dynamo (about 1.3 s
    of CPU). torch's own class still does, which shows the check is not empty."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["ours False", "torch's True"], proc.stdout


TRAIN = """
import gc
import sys
from dbs_mpi.tools import cli
code = cli.main(sys.argv[1:])
frozen = gc.get_freeze_count() > 100_000      # torch's objects, out of the collector's passes
sys.stdout.write(f"dynamo {'torch._dynamo' in sys.modules} frozen {frozen} collecting {gc.isenabled()}\\n")  # one write
sys.stdout.flush()
sys.exit(code)
"""


@pytest.mark.parametrize("strategy", ["dbs", "asgd"])
def test_a_training_run_never_imports_torch_dynamo(tmp_path, strategy):
    """One process through the whole run: start-up calibration, training, the checkpoint,
    evaluation, the result file; asgd: the parameter server's optimizer and warm-up. The
    garbage collector, off during the imports, runs again, and leaves torch's objects out."""
    out = tmp_path / "run.h5"
    args = ["train", "--dataset", "synthetic", "--synthetic-samples", "256", "--test-subset", "64", "--epochs", "1",
            "--global-batch", "32", "--strategy", strategy, "--benchmark-steps", "1", "--benchmark-warmup", "0",
            "--out", str(out)]
    if strategy == "asgd":      # a server and a worker need 2 ranks
        cmd = [mpiexec(), "-n", "2", sys.executable, "-c", TRAIN, *args]
    else:
        cmd = [sys.executable, "-c", TRAIN, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("dynamo False frozen True collecting True") == (2 if strategy == "asgd" else 1), \
        proc.stdout


def test_the_update_script_times_each_implementation_torch_has():
    """scripts/optimizer-update.py (docs/performance.md's figures of the update alone)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "optimizer-update.py"), "--models", "mlp",
                           "--updates", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("mlp")]
    assert len(rows) == 2 and all("per tensor" in row and "foreach" in row for row in rows), proc.stdout
    assert all(("fused: " not in row) == FUSED for row in rows), proc.stdout     # timed where torch has it
