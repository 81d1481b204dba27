"""Learning-rate schedules: torch's schedulers, stepped once per training step.

`dbs-mpi train --lr-schedule KIND` (and a library loop, with `make_scheduler`):

  constant   the configured lr throughout (after the warm-up, if any)
  step       lr multiplied by `gamma` at each epoch of `milestones` (torch's MultiStepLR)
  cosine     cosine annealing from lr to 0 over the steps after the warm-up
             (CosineAnnealingLR)
  onecycle   torch's OneCycleLR with max_lr = lr over the whole run: its own warm-up
             (the first 30% of the steps), and it cycles SGD's momentum too

`warmup_epochs` W > 0 (not with onecycle, which has its own) ramps the lr linearly over
the first W epochs' steps, from lr/k to lr (k: the warm-up's steps; LinearLR), then runs
the schedule (SequentialLR). W may be fractional.

The schedule counts steps, not epochs: every rank takes the same steps (one global
batch each, whatever the vector), so every rank's lr is the same at every step, and a
schedule's length is epochs x steps per epoch. Where the global batch adapts, steps are
counted at the starting batch and the schedule advances by samples (`position`). Its state (torch's state_dict) travels in
checkpoints: a run stopped in the middle of an epoch resumes the schedule at the step
it stopped at, bit for bit. Its length is fixed when the run starts: a resume that
changes the number of epochs of a schedule whose shape depends on it (cosine, onecycle,
or any warm-up) is refused (`check_length`). No MPI, and torch only to build the scheduler.
"""
from __future__ import annotations

SCHEDULES = ("constant", "step", "cosine", "onecycle")


def make_scheduler(optimizer, kind: str, *, epochs: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
                   milestones=(), gamma: float = 0.1):
    """torch's scheduler for `kind` over epochs x steps_per_epoch steps, stepped after every
    optimizer step; None for a constant lr without warm-up (nothing to schedule)."""
    from torch.optim import lr_scheduler         # here: planning answers without torch (the checks below)
    total = int(epochs) * int(steps_per_epoch)
    warmup = int(round(float(warmup_epochs) * steps_per_epoch))
    if kind == "onecycle":
        return lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                       total_steps=max(total, 2))
    if kind == "constant" and warmup == 0:
        return None
    after = max(total - warmup, 1)
    if kind == "step":
        main = lr_scheduler.MultiStepLR(optimizer, [int(m * steps_per_epoch) - warmup for m in milestones], gamma)
    elif kind == "cosine":
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=after)
    else:
        main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def position(epoch: int, done: int, total: int, steps_per_epoch: int) -> int:
    """The steps a schedule of `steps_per_epoch` steps an epoch has taken once `done` of
    the `total` samples of epoch `epoch` (from 0) are trained: epoch x steps_per_epoch
    plus the epoch's share of them, rounded down. At a fixed global batch that is one
    step per training step (the epoch's last, partial one included); where the batch
    changes (global_batch="auto", steps_per_epoch counted at the starting batch) an epoch
    is the same share of the schedule at any batch."""
    return int(epoch) * int(steps_per_epoch) + (int(done) * int(steps_per_epoch)) // max(int(total), 1)


def step_to(scheduler, target: int) -> None:
    """Step `scheduler` until it has taken `target` steps (its last_epoch; none if it has)."""
    while scheduler is not None and scheduler.last_epoch < target:
        scheduler.step()


def check(kind: str, epochs: int, warmup_epochs: float, milestones) -> str | None:
    """What is wrong with a schedule's settings (one line), or None."""
    if kind not in SCHEDULES:
        return f"lr_schedule: must be one of {', '.join(SCHEDULES)}; got {kind!r}"
    if warmup_epochs < 0 or warmup_epochs >= epochs:
        return f"warmup_epochs: must be at least 0 and less than epochs ({epochs}); got {warmup_epochs:g}"
    if kind == "onecycle" and warmup_epochs:
        return "warmup_epochs: onecycle warms up by itself (the first 30% of the steps); leave warmup_epochs at 0"
    if kind == "step" and not milestones:
        return "lr_milestones: the step schedule needs at least one epoch at which to multiply the lr by lr_gamma"
    if milestones and (list(milestones) != sorted(set(milestones)) or milestones[0] <= warmup_epochs
                       or milestones[-1] >= epochs):
        return (f"lr_milestones: must increase, after the warm-up ({warmup_epochs:g} epochs) and before the last "
                f"epoch ({epochs}); got {list(milestones)}")
    if milestones and kind != "step":
        return f"lr_milestones: only the step schedule has milestones (lr_schedule is {kind})"
    return None


def check_length(kind: str, warmup_epochs: float, saved_epochs: int, epochs: int) -> str | None:
    """A resume's schedule: refused (one line) where its shape depends on the number of
    epochs and that changed."""
    if saved_epochs != epochs and (kind in ("cosine", "onecycle") or warmup_epochs):
        return (f"epochs: the {kind} schedule was planned over {saved_epochs} epochs; a resume cannot change its "
                f"length (resume with --epochs {saved_epochs}, or start a new run)")
    return None
