"""Dynamic batch size: re-planning the batch vector from measured step times.

Pure code, no MPI: the balancer (balancer.py) feeds it every rank's measured step times
and carries its decisions to all ranks; the simulator (tools/simulator/) drives the same
classes with simulated times. Two rules:

* `DBSController`, once per epoch (`interval = "epoch"`, the DBS paper's granularity):
  the epoch's total compute time per rank against what the model predicted.
* `StepPlanner`, every `interval` steps (the default): a robust estimate of every rank's
  step time over a sliding window of the steps actually run (`StepTimeEstimator`), so
  that a real change of speed is followed within a few steps, while noise, a single
  slow step and a tiny local batch's fixed cost do not move the vector.

Both model rank i's step time as t_i(b) = a_i + c_i b (allocation.SpeedModel) and
allocate with allocation.allocate; docs/method.md, section 5, has the formulas.

One idea per file: the step-time estimate (`estimate.py`), the within-epoch planner
and the protocol that carries it to every rank (`within_epoch.py`), the probes that
measure a rank held at a small batch again (`probe.py`), the per-epoch rule
(`per_epoch.py`).
"""
from .estimate import (CHANGE_Z, FIXED_MAX, MAD_SIGMA, MEDIAN_SE, NOISE_FLOOR, OUTLIER, RECENT, REFIT,  # noqa: F401
                       REFIT_STEADY, SIGMA_WEIGHT, SPREAD, TINY_SHARE, WINDOW, StepTimeEstimator,
                       least_squares_line, robust_fit)
from .per_epoch import DBSController  # noqa: F401
from .probe import (LARGE_EVERY, LARGE_LEAST, LARGE_WITHIN, PROBE_BELOW, PROBE_BUDGET, PROBE_FEW,  # noqa: F401
                    PROBE_FIRST, PROBE_IDLE, PROBE_MAX, PROBE_STEPS, Probes, after_own_probe, own_probe_bounds,
                    own_probe_size)
from .within_epoch import (CUT, DEFAULT_INTERVAL, GAIN_Z, Proposal, Replanner, StepPlanner, Switch,  # noqa: F401
                           cut_unmeasured, least_step_time_every_rank, switch_step)


def planning_model(replanner, controller, fallback):
    """The speed model that plans now: the within-epoch estimate (a Replanner's, once it
    has a planner), else the per-epoch controller's, else `fallback` (the calibration's;
    None: none). The Balancer and the simulator ask it alike."""
    if replanner is not None and replanner.planner is not None:
        return replanner.planner.model
    return controller.model if controller is not None else fallback
