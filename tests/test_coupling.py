"""Coupled ranks seen at the start-up (planning/coupling.py): which ranks the calibration
times alone, when their times alone make the plan start with them alone, and what the
step planner's set check then makes of that start."""
import numpy as np
import pytest

from dbs_mpi.options import UserError
from dbs_mpi.planning import coupling, dynamic, participation
from dbs_mpi.planning.allocation import SpeedModel
from dbs_mpi.planning.dynamic import set_check

from test_set_check import coupled_times, own_time_probes, run

B = 512


def model(*per_sample, overhead=0.0):
    return SpeedModel(np.array(per_sample, float) * 1e-4, np.full(len(per_sample), overhead))


@pytest.mark.parametrize("per_sample, hosts, rule, expected", [
    ((1.0, 4.0), ["a", "a"], "auto", [True, False]),
    ((1.0, 1.2, 4.0, 4.0), ["a", "a", "a", "b"], "auto", [True, True, False, False]),
    ((1.0, 4.0), ["a", "b"], "auto", None),            # no slower rank beside the fastest
    ((1.0, 1.2), ["a", "a"], "auto", None),            # every rank is among the fastest
    ((1.0, 4.0), ["a", "a"], "all", None),             # no rank may sit out
    ((1.0, 4.0), None, "auto", None),                  # hosts unknown
])
def test_the_fastest_ranks_are_timed_alone_only_where_coupling_could_change_the_plan(per_sample, hosts, rule,
                                                                                      expected):
    alone = coupling.timed_alone(model(*per_sample), hosts, rule)
    assert (alone is None) if expected is None else alone.tolist() == expected
    assert coupling.timed_alone(model(*per_sample), hosts, rule, checked=False) is None   # no set check follows


def test_nothing_is_timed_alone_where_the_plan_already_leaves_the_slower_ranks_out():
    """1:0.001 (one sample of the slow rank takes twice the fast rank's whole step): the
    calibration's plan is the fast rank alone; timing it alone could not change that
    (and would cost the start-up its steps)."""
    fit = model(1.0, 1000.0)
    plan = participation.allocate_for(fit, B)
    assert plan.tolist() == [B, 0]
    assert coupling.timed_alone(fit, ["a", "a"], plan=plan) is None
    assert coupling.timed_alone(fit, ["a", "a"], plan=np.array([500, 12])).tolist() == [True, False]


def test_coupling_seen_starts_with_the_fastest_rank_alone_at_its_speed_alone():
    """1:0.25, rank 0 timed 2x faster alone: alone it computes B in 512 x 0.5e-4 s, the
    pair under the calibration's (coupled) fit takes 512 / (1/1e-4 + 1/4e-4): rank 0
    alone is faster, so it starts alone, its model halved."""
    fit = model(1.0, 4.0)
    together = fit.predict(np.array([256, 256]))
    alone = np.array([together[0] / 2, np.nan])
    start = coupling.coupled_start(fit, together, alone, B)
    assert start.vector.tolist() == [B, 0]
    assert start.model.per_sample.tolist() == pytest.approx([0.5e-4, 4e-4])
    assert start.coupling[0] == pytest.approx(2.0) and np.isnan(start.coupling[1])


@pytest.mark.parametrize("speed_up", [1.0, 1.1, set_check.COUPLED - 0.01])
def test_without_coupling_the_calibration_s_plan_stands(speed_up):
    fit = model(1.0, 4.0)
    together = fit.predict(np.array([256, 256]))
    assert coupling.coupled_start(fit, together, np.array([together[0] / speed_up, np.nan]), B) is None


def test_coupling_that_does_not_pay_keeps_every_rank():
    """1:0.6 and rank 0 1.3x faster alone (coupling seen): alone it takes 512 x 1e-4 / 1.3
    = 394 units, the pair 512 / (1 + 1/1.6) = 315: the pair stays; 2x faster alone it
    takes 256, LEAVE_GAIN below the pair's: rank 0 starts alone."""
    fit = model(1.0, 1.6)
    together = fit.predict(np.array([256, 256]))
    assert coupling.coupled_start(fit, together, np.array([together[0] / 1.3, np.nan]), B) is None
    assert coupling.coupled_start(fit, together, np.array([together[0] / 2.0, np.nan]), B).vector.tolist() == [B, 0]


def test_a_coupled_start_leaves_the_pair_to_the_set_check():
    """The coupled host of test_set_check, started as the calibration would: rank 0 alone,
    at its speed alone. The per-rank model soon takes rank 1 back; the check measures the
    pair slower with coupling seen, reverts it and bans it for TRIAL_BAN: over 300 steps
    the pair runs one check's steps (a start from the coupled fit ran TRIAL_FIRST steps
    coupled before its first trial: 1.08x rank 0 alone over the 300)."""
    rng = np.random.default_rng(2)
    seconds_of = coupled_times(rng)
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([1e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])
    probes = own_time_probes(lambda rank, size, step: 1e-3 + 4e-4 * size)
    rows, switches = run(replanner, 300, seconds_of, [B, 0], probe_every=1, probe_of=probes)
    assert [cause for _, _, cause in switches] == ["plan", "revert"], switches
    assert 0 < (rows[:, 1] > 0).sum() <= set_check.RECENT + 2, switches
    step_time = [max(t for t in seconds_of(s, row) if t) for s, row in enumerate(rows)]
    assert np.mean(step_time) <= 1.03 * (1e-3 + 1e-4 * B), switches


def test_a_recorded_timing_alone_counts_only_where_this_job_would_have_timed_it():
    """decide (engine and simulator, fresh or from `--calibration-from`): with ranks that
    may not sit out, or no set check to follow (the per-epoch rule), or no timing, the
    calibration's plan stands; a timing of another world size is refused in one line."""
    fit = model(1.0, 4.0)
    together = fit.predict(np.array([256, 256]))
    alone = np.array([together[0] / 2, np.nan])
    hosts = ["a", "a"]
    assert coupling.decide(fit, together, alone, hosts, "auto", True, B)[0].vector.tolist() == [B, 0]
    assert coupling.decide(fit, together, alone, hosts, "all", True, B) == (None, False)
    assert coupling.decide(fit, together, alone, hosts, "auto", False, B) == (None, False)
    assert coupling.decide(fit, together, None, hosts, "auto", True, B) == (None, False)
    assert coupling.decide(fit, together, alone, ["a", "b"], "auto", True, B) == (None, False)
    with pytest.raises(UserError, match="alone_time has 3 value"):
        coupling.decide(fit, together, np.array([0.1, np.nan, np.nan]), hosts, "auto", True, B)


def test_ranks_timed_alone_without_coupling_postpone_the_first_trial():
    """Rank 0 as fast alone as beside rank 1 (a 1:0.1 pair, the crossover): the start keeps
    the calibration's plan and says it saw no coupling, and the planner started so runs
    no trial before QUIET_FIRST steps (without it, one at TRIAL_FIRST took rank 1 to 0 for
    its steps); with coupling the start is rank 0 alone and nothing is postponed."""
    fit = model(1.0, 10.0)
    together = fit.predict(np.array([470, 42]))
    start, quiet = coupling.decide(fit, together, np.array([together[0] * 0.97, np.nan]), ["a", "a"], "auto", True, B)
    assert start is None and quiet
    start, quiet = coupling.decide(fit, together, np.array([together[0] / 2, np.nan]), ["a", "a"], "auto", True, B)
    assert start is not None and not quiet
    rng = np.random.default_rng(4)

    def seconds_of(step, row):
        return [(1e-3 + c * b) * rng.lognormal(0, 0.03) if b else 0.0 for c, b in zip((1e-4, 1e-3), row)]
    causes = {}
    for quiet in (False, True):
        calibrated = SpeedModel(np.array([1e-4, 1e-3]), np.array([1e-3, 1e-3]))
        replanner = dynamic.Replanner(0, 2, B, model=calibrated, hosts=["node", "node"])
        replanner.start_from(calibrated, quiet)
        _, switches = run(replanner, 400, seconds_of, [470, 42])
        causes[quiet] = [cause for _, _, cause in switches]
    assert "trial" in causes[False], causes
    assert "trial" not in causes[True], causes
