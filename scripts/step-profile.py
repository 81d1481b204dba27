"""Where one rank's training step spends the host's time: the parts of dbs-mpi's step
against what a plain PyTorch loop also does (docs/performance.md, "Where a step's host
time goes").

    python scripts/step-profile.py [--model lenet5] [--synthetic-shape 1,28,28] [--local-batch 64]
                                   [--steps 200] [--device cpu] [--data-on-device auto] [--torch-profiler]

One rank, no mpirun needed; `strategy ssgd` on synthetic data, float32. Runs of `dbs-mpi
train` in this process, 2 epochs each (the first a warm-up), and of the plain loop that
`dbs-mpi bench overhead` compares against (the same model, batches, optimizer, device and
seed). Printed, each of the second epoch:

1. the step as it is (the epoch's duration over its steps) against the plain loop's step,
   `--repeats` of each in alternating order, medians;
2. the exclusive host time a step of each part of the step (the time in it less that in
   the timed parts it calls), timers put around each. "torch" parts a plain loop does too
   (the forward's modules, the loss, backward, the optimizer's update, the batch); the
   "dbs-mpi" parts are the framework's; "the loop's own lines" is what none of them holds.
   A part that waits for a GPU shows the wait. The timers' own cost is measured and printed
   (it lands in the parts that make the calls);
3. with `--torch-profiler`: torch.profiler's operators by their own host time (and on a
   GPU, by the device's).

A part below that the package no longer has stops the script, naming it: the list follows
the step's code (tests/test_step_profile.py runs the script).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (module, attribute of it, whose): what the timers go around; "torch" parts a plain loop does too
PARTS = [
    ("torch", "Tensor.backward", "torch"),
    ("torch.nn", "Module.__call__", "torch"),
    ("dbs_mpi.training.optimizer", "scaled_step", "torch"),                  # the wrapped optimizer's update
    ("dbs_mpi.training.optimizer", "DistributedOptimizer.zero_grad", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "DistributedOptimizer.synchronize", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "DistributedOptimizer.step", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "DistributedOptimizer._on_forward", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "DistributedOptimizer._new_step", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "_plan_next", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "_loss_share", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "StepPlanner.current", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "StepChecks.forward", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "StepChecks.same_step", "dbs-mpi"),
    ("dbs_mpi.training.optimizer", "StepChecks.samples_match", "dbs-mpi"),
    ("dbs_mpi.training.participants", "Participants.reduce", "dbs-mpi"),
    ("dbs_mpi.training.participants", "Participants.updated", "dbs-mpi"),
    ("dbs_mpi.training.exchange", "GradientExchange.reduce", "dbs-mpi"),
    ("dbs_mpi.training.exchange", "GradientExchange.zero_grad", "dbs-mpi"),
    ("dbs_mpi.training.exchange", "GradientBuffer.adopt_grads", "dbs-mpi"),
    ("dbs_mpi.training.step_clock", "StepClock.forward", "dbs-mpi"),
    ("dbs_mpi.training.step_clock", "StepClock.boundary", "dbs-mpi"),
    ("dbs_mpi.training.step_clock", "StepClock.compute", "dbs-mpi"),
    ("dbs_mpi.training.step_clock", "StepClock.record", "dbs-mpi"),
    ("dbs_mpi.training.clipping", "LocalEdits.check", "dbs-mpi"),
    ("dbs_mpi.training.clipping", "LocalEdits.backward_ended", "dbs-mpi"),
    ("dbs_mpi.training.clipping", "_OutputHook.__call__", "dbs-mpi"),
    ("dbs_mpi.training.balancer", "Balancer.record_step", "dbs-mpi"),
    ("dbs_mpi.training.balancer", "Balancer.telemetry", "dbs-mpi"),
    ("dbs_mpi.training.checkpoint", "StopRequest.start", "dbs-mpi"),
    ("dbs_mpi.training.checkpoint", "StopRequest.agreed", "dbs-mpi"),
    ("dbs_mpi.mpi.devices", "to_device", "dbs-mpi"),
    ("dbs_mpi.planning.schedule", "step_to", "dbs-mpi"),
    ("dbs_mpi.training.global_batch", "Resizing.schedule_position", "dbs-mpi"),
    ("dbs_mpi.tools.train", "Precision.autocast", "dbs-mpi"),
]
LOOP = ("dbs_mpi.tools.train", "SyncTrainer.train_epoch")     # the loop's own lines: what no part above holds
LOADER = ("dbs_mpi.training.batches", "InMemoryLoader.__iter__")     # each batch it yields
LOSS = ("dbs_mpi.tools.plugins", "build_loss")                 # the loss function it builds


class Timers:
    """Exclusive host time per part, counted inside the last training epoch only."""

    def __init__(self):
        self.own, self.calls = collections.Counter(), collections.Counter()
        self.children: list[float] = []
        self.inside = False

    def wrap(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.inside:
                return fn(*args, **kwargs)
            self.children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.own[label] += spent - self.children.pop()
                self.calls[label] += 1
                if self.children:
                    self.children[-1] += spent
        return timed

    def cost(self) -> float:
        """Seconds one timer adds to a call (a timed no-op against a bare one)."""
        bare = lambda: None      # noqa: E731
        timed, self.inside = self.wrap(bare, "(calibration)"), True
        start = time.perf_counter()
        for _ in range(20000):
            timed()
        spent = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(20000):
            bare()
        self.inside = False
        self.own.pop("(calibration)"), self.calls.pop("(calibration)")
        return max(spent - (time.perf_counter() - start), 0.0) / 20000


def _owner(module: str, path: str):
    """(the object that holds the attribute, its name) for "Class.attr" or "attr" of `module`."""
    owner = importlib.import_module(module)
    *classes, name = path.split(".")
    for cls in classes:
        owner = getattr(owner, cls, None)
    if owner is None or name not in vars(owner):
        raise SystemExit(f"step-profile: {module}.{path} is not in the package any more: update PARTS")
    return owner, name


def _patch(owner, name: str, new, undo: list) -> None:
    undo.append((owner, name, vars(owner)[name]))
    setattr(owner, name, new)


def _timed_loader(timers: Timers, undo: list) -> None:
    """The in-memory loader's batches, each timed (a plain loop gathers its batch too)."""
    owner, name = _owner(*LOADER)
    batches, step = vars(owner)[name], timers.wrap(next, "torch: the batch (sampler, gather; InMemoryLoader)")

    def timed(self):
        it = batches(self)
        while True:
            try:
                value = step(it)
            except StopIteration:
                return
            yield value
    _patch(owner, name, timed, undo)


def _timed_loss(timers: Timers, undo: list) -> None:
    """The loss function the run builds, timed."""
    owner, name = _owner(*LOSS)
    build = vars(owner)[name]
    _patch(owner, name, lambda *args, **kwargs: timers.wrap(build(*args, **kwargs), "torch: the loss"), undo)


def _last_epoch_only(timers: Timers, undo: list) -> None:
    """The timers count in the epoch under way, from its start: the run's last epoch."""
    owner, name = _owner(*LOOP)
    epoch = vars(owner)[name]

    def counted(self, loader, optimizer, number):
        timers.own.clear(), timers.calls.clear()
        timers.inside = True
        try:
            return epoch(self, loader, optimizer, number)
        finally:
            timers.inside = False
    _patch(owner, name, counted, undo)


@contextlib.contextmanager
def timed_parts(timers: Timers):
    """The timers around every part of PARTS, the loop, its batches and its loss; taken off after."""
    undo = []
    for module, path, whose in PARTS + [(*LOOP, "dbs-mpi")]:
        owner, name = _owner(module, path)
        fn = vars(owner)[name]
        label = f"{whose}: {path}" if (module, path) != LOOP else "dbs-mpi: the loop's own lines"
        timed = timers.wrap(getattr(fn, "__func__", fn), label)
        _patch(owner, name, staticmethod(timed) if isinstance(fn, staticmethod) else timed, undo)
    _timed_loader(timers, undo)
    _timed_loss(timers, undo)
    _last_epoch_only(timers, undo)
    try:
        yield
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)


def config(a):
    """One rank's `ssgd` run on synthetic data, `steps` batches an epoch, in float32 and the
    default memory format: what the plain loop does (it has no mixed precision)."""
    from dbs_mpi.tools.config import load
    return load(None, dict(model=a.model, dataset="synthetic", synthetic_shape=a.synthetic_shape,
                           synthetic_samples=a.steps * a.local_batch, global_batch=a.local_batch, strategy="ssgd",
                           epochs=2, test_subset=200, progress=False, threads=a.threads, device=a.device,
                           data_on_device=a.data_on_device, checkpoint_every=0))


def train_step(comm, cfg, path: Path, steps: int) -> float:
    """Seconds a step of one `dbs-mpi train` run's last epoch."""
    from dbs_mpi.tools.train import train
    return float(train(comm, cfg, out=str(path), log=lambda message: None).epochs[-1]["duration"]) / steps


def plain_step(comm, cfg, steps: int) -> float:
    """Seconds a step of the plain loop `dbs-mpi bench overhead` compares against."""
    import torch
    from dbs_mpi.tools.bench.plain import _plain_epoch
    from dbs_mpi.tools.train import load_data
    torch.set_num_threads(cfg.threads or 1)
    return _plain_epoch(comm, cfg, load_data(cfg)[0]) / steps


def side_by_side(comm, cfg, folder: Path, steps: int, repeats: int) -> str:
    """The step as it is against the plain loop's, `repeats` of each in alternating order:
    their medians and ratios."""
    times = {"dbs-mpi": [], "plain": []}
    for repeat in range(repeats):
        for which in ("dbs-mpi", "plain") if repeat % 2 == 0 else ("plain", "dbs-mpi"):
            times[which].append(train_step(comm, cfg, folder / f"as-it-is-{repeat}.h5", steps) if which == "dbs-mpi"
                                else plain_step(comm, cfg, steps))
    step, plain = (statistics.median(times[which]) for which in ("dbs-mpi", "plain"))
    ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(times["dbs-mpi"], times["plain"]))
    return (f"the step, median of {repeats}: dbs-mpi {1e3 * step:.3f} ms, the plain loop {1e3 * plain:.3f} ms: "
            f"{1e6 * (step - plain):+.0f} us a step ({step / plain:.3f}x; repeats {ratios})")


def breakdown(timers: Timers, steps: int, cost: float) -> list[str]:
    calls = sum(timers.calls.values()) / steps
    lines = [f"host time a step by part (exclusive; the {calls:.0f} timed calls a step add about "
             f"{1e6 * cost * calls:.0f} us, counted in the parts that make them)",
             f"  {'part':56s} {'us/step':>8s} {'calls/step':>10s}"]
    for label, own in sorted(timers.own.items(), key=lambda item: -item[1]):
        lines.append(f"  {label:56s} {1e6 * own / steps:8.1f} {timers.calls[label] / steps:10.2f}")
    for whose in ("torch", "dbs-mpi"):
        total = sum(own for label, own in timers.own.items() if label.startswith(whose + ":"))
        lines.append(f"  {'all ' + whose + ' parts':56s} {1e6 * total / steps:8.1f}")
    return lines


def operators(comm, cfg, path: Path, steps: int) -> str:
    """torch.profiler's tables of the last epoch's operators (a fourth run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    owner, name = _owner(*LOOP)
    epoch = vars(owner)[name]
    cuda = torch.device(cfg.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    held = {}

    def profiled(self, loader, optimizer, number):
        if number + 1 < cfg.epochs:
            return epoch(self, loader, optimizer, number)
        with profile(activities=activities) as held["profile"]:
            return epoch(self, loader, optimizer, number)
    setattr(owner, name, profiled)
    try:
        train_step(comm, cfg, path, steps)
    finally:
        setattr(owner, name, epoch)
    table = held["profile"].key_averages()
    return table.table(sort_by="self_cpu_time_total", row_limit=25) + (
        "\n" + table.table(sort_by="self_device_time_total", row_limit=15) if cuda else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lenet5")
    p.add_argument("--synthetic-shape", default="1,28,28")
    p.add_argument("--local-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="steps an epoch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-on-device", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of the step as it is and of the plain loop")
    p.add_argument("--torch-profiler", action="store_true", help="also torch.profiler's operator table")
    a = p.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 1 or a.repeats < 1 or a.steps < 1 or a.local_batch < 1:
        print("step-profile: one rank only (the plain loop it compares against has no exchange), and --repeats, "
              "--steps and --local-batch at least 1", file=sys.stderr)
        return 2
    cfg, timers = config(a), Timers()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"step-profile: {a.model}, local batch {a.local_batch}, device {a.device}, {a.steps} steps an epoch, "
              f"{a.threads} thread(s); the second epoch")
        print(side_by_side(comm, cfg, Path(tmp), a.steps, a.repeats))
        with timed_parts(timers):
            train_step(comm, cfg, Path(tmp) / "timed.h5", a.steps)
        print("\n".join(breakdown(timers, a.steps, timers.cost())))
        if a.torch_profiler:
            print(operators(comm, cfg, Path(tmp) / "profiled.h5", a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
