"""Coupled ranks seen at the start-up (planning/coupling.py): which ranks the calibration
times alone, when their times alone make the plan start with them alone, and what the
step planner's set check then makes of that start."""
import io

import numpy as np
import pytest
import torch

from dbs_mpi.options import UserError
from dbs_mpi.planning import coupling, dynamic, participation
from dbs_mpi.planning.allocation import SpeedModel
from dbs_mpi.planning.dynamic import set_check
from dbs_mpi.training import checkpoint

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


def coupled_start_of(fit_per_sample=(2e-4, 4e-4), speed_up=2.0):
    """The Start the calibration makes of a 1:0.25 pair whose rank 0 it timed `speed_up`
    times faster alone (fit: the coupled speeds it measured beside each other)."""
    fit = SpeedModel(np.array(fit_per_sample), np.array([1e-3, 1e-3]))
    together = fit.predict(np.array([B, B]))
    return coupling.coupled_start(fit, together, np.array([together[0] / speed_up, np.nan]), B)


def started(start):
    replanner = dynamic.Replanner(0, 2, B, model=start.model, hosts=["node", "node"])
    replanner.start_from(start.model, coupled=start)
    return replanner


def test_a_coupled_start_confirmed_by_its_steps_alone_keeps_the_pair_out_for_the_trial_ban():
    """The coupled host of test_set_check, started as the calibration starts it: rank 0
    alone, at its speed alone. Its first RECENT steps alone run 2x faster per sample than
    the calibration's fit said it computes beside rank 1 (coupling confirmed): the pair is
    banned for TRIAL_BAN steps, so no step runs at the coupled speed before the ban ends
    (before, the per-rank model took rank 1 back at its first plan and the check ran 4
    steps at 1.9x); then the pair's one check, reverted. Rank 1's own-time probes ride
    along throughout."""
    start = coupled_start_of()
    assert start.vector.tolist() == [B, 0] and start.every.tolist()[1] > 0
    assert start.together[0] == pytest.approx((1e-3 + 2e-4 * B) / B) and np.isnan(start.together[1])
    seconds_of = coupled_times(np.random.default_rng(2))
    probes = own_time_probes(lambda rank, size, step: 1e-3 + 4e-4 * size)
    replanner = started(start)
    assert replanner.planner.sets.banned_set([B - 64, 64], 0)          # until its steps alone decide
    rows, switches = run(replanner, 300, seconds_of, [B, 0], probe_every=1, probe_of=probes)
    assert (rows[:set_check.TRIAL_BAN, 1] == 0).all(), switches
    assert [cause for _, _, cause in switches] == ["plan", "revert"], switches
    assert 0 < (rows[:, 1] > 0).sum() <= set_check.RECENT + 2, switches
    step_time = [max(t for t in seconds_of(s, row) if t) for s, row in enumerate(rows)]
    assert np.mean(step_time) <= 1.02 * (1e-3 + 1e-4 * B), switches


def test_a_coupled_start_whose_timings_do_not_carry_over_takes_the_pair_back_at_once():
    """The calibration timed an eager copy of the model: rank 0 2x faster alone than beside
    rank 1. Training computes otherwise (compiled, twice as fast), and on this host without
    coupling: rank 0's first steps alone run 2x faster than the calibration timed it alone,
    so its timings do not carry over; the ban is lifted and the per-rank model (at the
    speed measured) takes rank 1 back within 3 RECENT steps, and the check keeps the pair,
    which is faster, for the rest of the run (no trial of rank 0 alone either: the
    take-back's check did a trial's work)."""
    rng = np.random.default_rng(3)

    def seconds_of(step, row):
        return [(1e-3 + c * b) * rng.lognormal(0, 0.03) if b else 0.0 for c, b in zip((0.5e-4, 4e-4), row)]
    start = coupled_start_of()
    rows, switches = run(started(start), 200, seconds_of, [B, 0])
    back = next(s for s in range(len(rows)) if rows[s, 1] > 0)
    assert back <= 3 * set_check.RECENT, switches
    assert (rows[back + set_check.RECENT:, 1] > 0).all(), switches
    assert "revert" not in [cause for _, _, cause in switches], switches


def test_a_coupled_start_s_ban_survives_a_checkpoint_before_its_steps_decide_it():
    """The planner's state after 2 steps alone holds the pending start; saved as a
    checkpoint stores it (torch.save of checkpoint.to_safe, read back weights-only), a
    planner restored from it confirms the coupling as the one that ran on."""
    start = coupled_start_of()
    seconds_of = coupled_times(np.random.default_rng(5))
    replanner = started(start)
    run(replanner, 2, seconds_of, [B, 0])
    state = replanner.planner.sets.state_dict()
    assert state["start"] is not None
    buffer = io.BytesIO()
    torch.save(checkpoint.to_safe(state), buffer)
    buffer.seek(0)
    again = set_check.SetCheck.from_state(torch.load(buffer, weights_only=True), ["node", "node"])
    assert np.isnan(again.start.together[1]) and again.start.alone == (0,)
    for step in range(2, 2 + set_check.RECENT):
        for sets in (replanner.planner.sets, again):
            sets.observe([B, 0], seconds_of(step, [B, 0]), True, step)
    assert replanner.planner.sets.start is None and again.start is None
    assert again.banned == replanner.planner.sets.banned
    assert again.banned[(0, 1)] >= set_check.TRIAL_BAN


def test_a_recorded_timing_alone_counts_only_where_this_job_would_have_timed_it():
    """decide (engine and simulator, fresh or from `--calibration-from`): with ranks that
    may not sit out, or no set check to follow (the per-epoch rule), or no timing, the
    calibration's plan stands; a timing of another world size is refused in one line."""
    fit = model(1.0, 4.0)
    together = fit.predict(np.array([256, 256]))
    alone = np.array([together[0] / 2, np.nan])
    hosts = ["a", "a"]
    assert coupling.decide(fit, together, alone, hosts, "auto", True, B)[0].vector.tolist() == [B, 0]
    first = set_check.TRIAL_FIRST
    assert coupling.decide(fit, together, alone, hosts, "all", True, B) == (None, first)
    assert coupling.decide(fit, together, alone, hosts, "auto", False, B) == (None, first)
    assert coupling.decide(fit, together, None, hosts, "auto", True, B) == (None, first)
    assert coupling.decide(fit, together, alone, ["a", "b"], "auto", True, B) == (None, first)
    with pytest.raises(UserError, match="alone_time has 3 value"):
        coupling.decide(fit, together, np.array([0.1, np.nan, np.nan]), hosts, "auto", True, B)


def test_ranks_timed_alone_without_coupling_postpone_the_first_trial():
    """Rank 0 as fast alone as beside rank 1 (a 1:0.1 pair, the crossover): the start keeps
    the calibration's plan and says it saw no coupling, and the planner started so runs
    no trial before QUIET_FIRST steps (without it, one at TRIAL_FIRST took rank 1 to 0 for
    its steps); with coupling the start is rank 0 alone and nothing is postponed."""
    fit = model(1.0, 10.0)
    together = fit.predict(np.array([470, 42]))
    start, first = coupling.decide(fit, together, np.array([together[0] * 0.97, np.nan]), ["a", "a"], "auto", True, B)
    assert start is None and first == set_check.QUIET_FIRST
    start, first = coupling.decide(fit, together, np.array([together[0] / 2, np.nan]), ["a", "a"], "auto", True, B)
    assert start is not None and first == set_check.TRIAL_FIRST
    rng = np.random.default_rng(4)

    def seconds_of(step, row):
        return [(1e-3 + c * b) * rng.lognormal(0, 0.03) if b else 0.0 for c, b in zip((1e-4, 1e-3), row)]
    causes = {}
    for quiet in (False, True):
        calibrated = SpeedModel(np.array([1e-4, 1e-3]), np.array([1e-3, 1e-3]))
        replanner = dynamic.Replanner(0, 2, B, model=calibrated, hosts=["node", "node"])
        replanner.start_from(calibrated, set_check.QUIET_FIRST if quiet else set_check.TRIAL_FIRST)
        _, switches = run(replanner, 400, seconds_of, [470, 42])
        causes[quiet] = [cause for _, _, cause in switches]
    assert "trial" in causes[False], causes
    assert "trial" not in causes[True], causes


@pytest.mark.parametrize("per_sample, hosts, rule, checked, expected", [
    ((4.2, 4.0), ["a", "a"], "auto", True, set_check.UNSEEN_FIRST),     # every rank among the fastest
    ((1.0, 1.2, 1.3), ["a", "b", "a"], "auto", True, set_check.UNSEEN_FIRST),
    ((4.2, 4.0), ["a", "b"], "auto", True, set_check.TRIAL_FIRST),      # no host shared: no trial anyway
    ((4.2, 4.0), ["a", "a"], "all", True, set_check.TRIAL_FIRST),
    ((4.2, 4.0), ["a", "a"], "auto", False, set_check.TRIAL_FIRST),
    ((1.0, 4.0), ["a", "a"], "auto", True, set_check.TRIAL_FIRST),      # not timed alone: no alone_time recorded
])
def test_a_calibration_that_saw_every_rank_among_the_fastest_brings_the_first_trial_forward(
        per_sample, hosts, rule, checked, expected):
    fit = model(*per_sample)
    together = fit.predict(np.full(len(per_sample), B // len(per_sample)))
    assert coupling.decide(fit, together, None, hosts, rule, checked, B) == (None, expected)


def test_the_first_trial_is_a_number_of_steps_not_the_quiet_flag_it_replaced():
    replanner = dynamic.Replanner(0, 2, B, hosts=["node", "node"])
    with pytest.raises(TypeError, match="not a bool"):
        replanner.start_from(model(1.0, 4.0), True)       # (once `quiet`: it would try at step 1)


def test_a_coupled_pair_whose_calibration_was_disturbed_is_tried_alone_within_unseen_first_steps():
    """The coupled host of test_set_check (rank 0 2x slower beside rank 1, rank 1 4x
    slower), its calibration disturbed: rank 0 read 4.2e-4 s a sample, as slow as rank 1,
    so it timed nothing alone and kept both. Its steps tell rank 0 apart at once; the
    trial of rank 0 alone comes after UNSEEN_FIRST steps, is kept, and steps 30-63 run
    within 1.05x of rank 0 alone. Started at TRIAL_FIRST, as before, those steps ran the
    pair, 1.33x slower."""
    fit = SpeedModel(np.array([4.2e-4, 4e-4]), np.array([1e-3, 1e-3]))
    together = fit.predict(fit.allocate(B))
    start, first = coupling.decide(fit, together, None, ["node", "node"], "auto", True, B)
    assert start is None and first == set_check.UNSEEN_FIRST
    alone = 1e-3 + 1e-4 * B
    for wait, expected in ((first, (0.95, 1.05)), (set_check.TRIAL_FIRST, (1.25, 1.4))):
        rng = np.random.default_rng(3)
        replanner = dynamic.Replanner(0, 2, B, model=fit, hosts=["node", "node"])
        replanner.start_from(fit, wait)
        seconds_of = coupled_times(rng)
        rows, switches = run(replanner, 100, seconds_of, fit.allocate(B))
        trials = [step for step, _, cause in switches if cause == "trial"]
        assert trials and trials[0] >= min(wait, set_check.TRIAL_FIRST) - 1, switches
        step_time = [max(t for t in seconds_of(s, row) if t) for s, row in enumerate(rows)]
        assert expected[0] <= np.mean(step_time[30:64]) / alone <= expected[1], switches
