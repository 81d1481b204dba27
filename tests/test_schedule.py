"""Learning-rate schedules (planning/schedule.py): torch's schedulers over the run's
steps, the settings refused in one line, and a resume that would change a schedule's
length refused. (Resumed in the middle of an epoch, bit for bit: test_checkpoint.py.)"""
import numpy as np
import pytest
import torch

from dbs_mpi.options import ConfigError
from dbs_mpi.planning.schedule import check_length, make_scheduler
from dbs_mpi.tools import config


def lrs(kind, epochs=3, steps_per_epoch=4, lr=0.1, **kw):
    """The lr of every step of a run under the schedule."""
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=lr, momentum=0.9)
    scheduler = make_scheduler(optimizer, kind, epochs=epochs, steps_per_epoch=steps_per_epoch, **kw)
    out = []
    for _ in range(epochs * steps_per_epoch):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return np.array(out)


def test_constant_without_warm_up_schedules_nothing():
    p = torch.nn.Parameter(torch.zeros(1))
    assert make_scheduler(torch.optim.SGD([p], lr=0.1), "constant", epochs=2, steps_per_epoch=5) is None
    np.testing.assert_allclose(lrs("constant"), 0.1)


def test_a_warm_up_ramps_linearly_to_the_lr_then_the_schedule_runs():
    ramp = lrs("constant", warmup_epochs=1)
    np.testing.assert_allclose(ramp[:5], [0.025, 0.04375, 0.0625, 0.08125, 0.1])
    np.testing.assert_allclose(ramp[4:], 0.1)
    cosine = lrs("cosine", warmup_epochs=1)
    np.testing.assert_allclose(cosine[:5], ramp[:5])
    assert np.all(np.diff(cosine[4:]) < 0) and cosine[-1] < 0.01            # annealed towards 0


def test_step_multiplies_at_the_milestones_and_onecycle_peaks_at_the_lr():
    step = lrs("step", epochs=4, milestones=(2.0, 3.0), gamma=0.5)
    np.testing.assert_allclose(step, [0.1] * 8 + [0.05] * 4 + [0.025] * 4)
    one = lrs("onecycle", epochs=4)
    assert one.max() == pytest.approx(0.1, rel=1e-3) and one[0] < 0.01 and one[-1] < 1e-4


@pytest.mark.parametrize("settings, field", [
    ({"lr_schedule": "linear"}, "lr_schedule"),
    ({"lr_schedule": "step"}, "lr_milestones"),                              # no milestone
    ({"lr_schedule": "step", "lr_milestones": "2,1"}, "lr_milestones"),      # not increasing
    ({"lr_schedule": "step", "lr_milestones": "3"}, "lr_milestones"),        # not before the last epoch
    ({"lr_schedule": "cosine", "lr_milestones": "1"}, "lr_milestones"),      # milestones of another schedule
    ({"lr_schedule": "onecycle", "warmup_epochs": 1}, "warmup_epochs"),
    ({"warmup_epochs": 3}, "warmup_epochs"),                                 # the whole run
    ({"warmup_epochs": -1}, "warmup_epochs"),
    ({"lr_gamma": 0}, "lr_gamma"),
])
def test_bad_schedule_settings_are_one_line_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        config.from_dict({"epochs": 3, **settings})


def test_a_resume_may_not_change_a_schedules_length():
    assert check_length("cosine", 0.0, 3, 5).startswith("epochs: the cosine schedule was planned over 3 epochs")
    assert check_length("constant", 1.0, 3, 5) is not None                  # a warm-up's shape depends on it too
    assert check_length("constant", 0.0, 3, 5) is None and check_length("step", 0.0, 3, 5) is None
    assert check_length("cosine", 0.0, 3, 3) is None
