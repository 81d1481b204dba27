"""A ban that coupling justified, lifted once the speeds behind it changed
(planning/dynamic/lift.py), on synthetic step times."""
import io

import numpy as np
import pytest
import torch

from dbs_mpi.planning import dynamic, participation
from dbs_mpi.planning.allocation import SpeedModel
from dbs_mpi.planning.dynamic import estimate, probe, set_check
from dbs_mpi.training import checkpoint

from test_set_check import own_time_probes, run

B = 512
FAST = 150          # the step from which rank 1 runs at its full speed


def coupled_pair(seed: int, rank1_factor):
    """The coupled host of test_set_check (rank 0 computes 2x slower while rank 1 computes),
    rank 1's whole step `rank1_factor(step)` times 1 ms + 0.1 ms a sample."""
    rng = np.random.default_rng(seed)

    def time_of(rank, b, step):
        return (1e-3 + 1e-4 * b) * rank1_factor(step) * rng.lognormal(0, 0.03) if b else 0.0

    def seconds_of(step, row):
        c0 = 1e-4 * (2 if row[1] > 0 else 1)
        return [(1e-3 + c0 * row[0]) * rng.lognormal(0, 0.03) if row[0] else 0.0, time_of(1, row[1], step)]
    return seconds_of, time_of


def replanner(interval: int = 1):
    return dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 4e-3])),
                             hosts=["node", "node"], interval=interval)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_a_coupling_ban_left_out_is_back_within_5_steps_once_it_became_fast(seed):
    """Rank 1 4x slower until FAST: the trial of rank 0 alone wins and bans the pair for
    TRIAL_BAN steps. From FAST rank 1 computes as fast as rank 0 alone, and the pair, rank
    0 at its coupled speed, is 1.5x faster than rank 0 alone. Before, rank 1 sat out to the
    ban's end, and the retry there, balanced at rank 0's speed alone ([384, 128]), lost
    again (the pair banned 512 steps more). Now its probes lift the ban: back within 5
    steps, balanced with the coupling priced in (rank 0 about a third of B)."""
    seconds_of, time_of = coupled_pair(seed, lambda step: 4.0 if step < FAST else 1.0)
    planner = replanner()
    rows, switches = run(planner, FAST + 100, seconds_of, [340, 172], probe_every=1,
                         probe_of=own_time_probes(time_of))
    trial = next(step for step, vector, cause in switches if cause == "trial")
    assert trial < FAST and (rows[trial + 2 * set_check.RECENT:FAST, 1] == 0).all(), switches
    back = next(step for step in range(FAST, len(rows)) if rows[step, 1] > 0)
    assert back - FAST <= 5, switches
    assert rows[back, 0] <= 0.4 * B, switches                           # priced: not 384 of 512
    assert [cause for step, _, cause in switches if step >= FAST][0] == "lift", switches     # (replan/cause)
    verdicts = [v for v in planner.planner.sets.verdicts if v[2] == "lifted"]
    assert len(verdicts) == 1 and verdicts[0][1] == (0, 1), planner.planner.sets.verdicts
    step_time = [max(t for t in seconds_of(s, row) if t) for s, row in enumerate(rows)]
    pair = 1e-3 + B / (1 / 2e-4 + 1 / 1e-4)
    assert np.median(step_time[back + 2 * set_check.RECENT:]) <= 1.1 * pair, switches


def probes_with_large_ones(time_of):
    """Rank 1's own-time probes as training/prober.py runs them while nothing sped up: 2
    samples, and every LARGE_EVERY-th at 128."""
    count = [0]

    def probe_of(step):
        count[0] += 1
        size = 128 if count[0] % probe.LARGE_EVERY == 0 else 2
        return size, time_of(1, size, step)
    return probe_of


@pytest.mark.parametrize("change", [150, 153, 157])
def test_a_rank_whose_cost_a_sample_fell_is_back_once_a_large_probe_shows_it(change):
    """Rank 1 costs 0.4 ms a sample beside a 4 ms fixed cost until `change`, then 0.1 ms:
    its 2-sample probes move 12% (within the window's bound), and only its large probes,
    every LARGE_EVERY-th, show the change. Before, the window followed once most large
    probes in it were new, and the plan waited for its next re-estimate: rank 1 was back
    41 steps later, or not in 120. Now the first large probe that ran RETURN times faster
    than the model sets the line through it and the small one after it at once: back within
    LARGE_EVERY + 5 steps, the coupling priced (a lift)."""
    rng = np.random.default_rng(change)

    def time_of(rank, b, step):
        return (4e-3 + (4e-4 if step < change else 1e-4) * b) * rng.lognormal(0, 0.03) if b else 0.0

    def seconds_of(step, row):
        c0 = 1e-4 * (2 if row[1] > 0 else 1)
        return [(1e-3 + c0 * row[0]) * rng.lognormal(0, 0.03) if row[0] else 0.0, time_of(1, row[1], step)]
    rows, switches = run(replanner(), change + 60, seconds_of, [340, 172], probe_every=1,
                         probe_of=probes_with_large_ones(time_of))
    assert (rows[100:change, 1] == 0).all(), switches
    back = next(step for step in range(change, len(rows)) if rows[step, 1] > 0)
    assert back - change <= probe.LARGE_EVERY + 5, switches
    assert [cause for step, _, cause in switches if step >= change][0] == "lift", switches


def refits(scale: float, steps: int = 200, interval: int = 1) -> int:
    """Re-estimates from step 100 of a planner whose pair stays banned (rank 1 4x slower
    throughout, its probes every step), the step times `scale` times the coupled pair's,
    planning every `interval` steps."""
    seconds_of, time_of = coupled_pair(4, lambda step: 4.0)
    planner = replanner(interval)
    update, count = planner.planner.estimator.update, [0]

    def counted():
        count[0] += 1 if planner.planner.step >= 100 else 0
        return update()
    planner.planner.estimator.update = counted
    run(planner, steps, lambda step, row: [scale * t for t in seconds_of(step, row)], [340, 172], probe_every=1,
        probe_of=lambda step: (2, scale * time_of(1, 2, step)))
    assert planner.planner.sets.banned_set([256, 256], steps - 1), planner.planner.sets.banned
    return count[0]


def test_a_liftable_ban_is_watched_every_few_steps_at_a_bounded_cost():
    """While a ban that may be lifted holds and the rank out reports probes, the model is
    re-estimated every RECENT steps (the pair's steps take 50 ms), not every REFIT_STEADY
    (a lift waited up to 32 steps for its plan); where the steps are 100x shorter, at most
    every LIFT_EVERY seconds of steps (a re-estimate costs some 0.7 ms)."""
    assert refits(1.0) >= 100 // (estimate.RECENT + 1)
    assert refits(0.01) <= 100 // estimate.REFIT_STEADY + 1


@pytest.mark.parametrize("interval", [4, 8])
def test_a_liftable_ban_is_watched_as_often_where_the_planner_plans_every_few_steps(interval):
    """With dbs_interval 4 or 8 the planner's steps since a re-estimate are multiples of
    the interval: the watch still comes at the first plan RECENT steps or more after the
    last re-estimate (every 8 steps for both), not only at multiples of both (20 steps for
    4; for 8, not before REFIT_STEADY)."""
    assert refits(1.0, interval=interval) >= 100 // (2 * max(interval, estimate.RECENT)) - 1


def test_a_coupling_ban_holds_while_the_speeds_behind_it_hold():
    """Rank 1 4x slower throughout: priced with the coupling its trial measured, the pair
    predicts 1.33x rank 0 alone, so its ban is never lifted, and the pair runs no step
    while it lasts."""
    seconds_of, time_of = coupled_pair(4, lambda step: 4.0)
    planner = replanner()
    rows, switches = run(planner, 320, seconds_of, [340, 172], probe_every=1, probe_of=own_time_probes(time_of))
    kept = next(step for step, _, cause in switches if cause == "trial") + 2 * set_check.RECENT
    assert (rows[kept:, 1] == 0).all(), switches
    assert "lifted" not in [v[2] for v in planner.planner.sets.verdicts]
    assert planner.planner.sets.lifts.seen[((0,), (0, 1))] >= set_check.COUPLED


PAIR = np.array([200, 312])


def banned_alone():
    """A SetCheck in which a plan left rank 1 out ([200, 312] -> [512, 0]) and lost: rank 0
    alone computed 2x faster per sample (1e-4 s), yet its step took 51 ms for the pair's 40:
    rank 0 alone is banned for TRIAL_BAN steps."""
    sets = set_check.SetCheck(["node", "node"])
    for step in range(set_check.RECENT + 1):
        sets.observe(PAIR, [0.040, 0.040], True, step)
    at = set_check.RECENT + 1
    sets.switched(PAIR, [512, 0], at)
    for step in range(at, at + set_check.RECENT + 1):
        sets.observe([512, 0], [0.0512, 0.0], True, step)
    assert sets.verdict(at + set_check.RECENT).tolist() == PAIR.tolist()
    assert sets.banned_set([512, 0], at + set_check.RECENT + 1)
    return sets, at + set_check.RECENT + 1


SLOW = SpeedModel(np.array([2e-4, 50 * 1.28e-4]), np.zeros(2))     # rank 1 50x slower


def allocate(price, within):
    return participation.allocate_for(price, B, 1, None, within=within)


def lift_into(sets, vector, current, model, step):
    """What the planner does: the plan at `step` allocates `vector`'s set, and where the set
    check offers the lift, the move applies from the next step (cause "lift")."""
    offered = sets.lifts.vector(sets, np.asarray(vector), np.asarray(current), model, step, allocate)
    if sets.lifts.cause(offered, step) == "lift":
        sets.switched(current, offered, step + 1, "lift")
    return offered


def test_a_rank_kept_in_by_a_coupling_ban_leaves_once_it_became_50x_slower():
    """The smaller set banned (rank 0 alone lost, though it computed 2x faster per sample):
    while rank 1 computes as it did, rank 0 alone, priced at half its coupled cost, is
    slower than the pair, and the ban holds; once rank 1 is 50x slower, the pair takes
    40x rank 0's time alone, the plan offers the lift, rank 0 priced at its speed alone,
    and the ban ends when that move applies."""
    sets, step = banned_alone()
    coupled = SpeedModel(np.array([2e-4, 1.28e-4]), np.zeros(2))      # what the model sees in the pair
    assert sets.lifts.seen[((0,), (0, 1))] == pytest.approx(2.0)
    assert lift_into(sets, [B, 0], PAIR, coupled, step).tolist() == [B, 0]
    assert sets.banned_set([B, 0], step) and sets.lifts.offer is None
    assert lift_into(sets, [B, 0], PAIR, SLOW, step + 1).tolist() == [B, 0]
    assert not sets.banned_set([B, 0], step + 2) and sets.verdicts[-1][2] == "lifted"
    assert sets.verdicts[-1][4] == pytest.approx(B * 1e-4)      # rank 0 priced alone
    assert sets.pending["lift"] and sets.pending["new"] == (0,)  # checked as any change


def test_a_priced_gain_below_the_lift_gain_lifts_nothing():
    """Rank 1 slower, so that rank 0 alone (priced) is predicted 5% faster than the pair
    re-balanced: within LIFT_GAIN, the ban holds."""
    sets, step = banned_alone()
    c1 = 1.0 / (1.0 / (0.95 * 1e-4) - 1.0 / 2e-4)       # the pair re-balanced: 1 / (1/2e-4 + 1/c1) = 0.95e-4 / 0.95 ...
    model = SpeedModel(np.array([2e-4, c1 / 0.95 ** 2]), np.zeros(2))
    assert lift_into(sets, [B, 0], PAIR, model, step).tolist() == [B, 0]
    assert sets.banned_set([B, 0], step + 1) and "lifted" not in [v[2] for v in sets.verdicts]


def test_a_ban_without_coupling_is_never_lifted():
    """The pair taken back lost with rank 0 as fast beside rank 1 as alone (BAN): whatever
    the model says now, the ban holds (the model predicted the pair faster before, and it
    measured slower)."""
    sets = set_check.SetCheck(["node", "node"])
    for step in range(set_check.RECENT + 1):
        sets.observe([B, 0], [0.0512, 0.0], True, step)
    at = set_check.RECENT + 1
    sets.switched([B, 0], [256, 256], at)
    for step in range(at, at + set_check.RECENT + 1):
        sets.observe([256, 256], [0.026, 0.07], True, step)
    assert sets.verdict(at + set_check.RECENT).tolist() == [B, 0]
    step = at + set_check.RECENT + 1
    assert sets.banned[(0, 1)] == step - 1 + set_check.BAN and sets.lifts.seen[((0,), (0, 1))] < set_check.COUPLED
    fast = SpeedModel(np.array([1e-4, 1e-5]), np.zeros(2))
    assert lift_into(sets, [256, 256], [B, 0], fast, step).tolist() == [256, 256]
    assert sets.banned_set([256, 256], step + 1)


@pytest.mark.parametrize("delay", [0, 20])
def test_a_lifted_set_that_loses_its_check_again_is_not_lifted_before_that_ban_ends(delay):
    """A price that is wrong costs one check per ban, not one per plan, however many steps
    a prefetching loader puts between the plan and the move (`delay`)."""
    sets, step = banned_alone()
    offered = sets.lifts.vector(sets, np.array([B, 0]), PAIR, SLOW, step, allocate)
    assert sets.lifts.cause(offered, step) == "lift"
    sets.switched(PAIR, offered, step + 1 + delay, "lift")
    for at in range(step + 1 + delay, step + 2 + delay + set_check.RECENT):
        sets.observe([B, 0], [0.0512, 0.0], True, at)        # as before the lift: the price was wrong
    decided = step + 1 + delay + set_check.RECENT
    assert sets.verdict(decided).tolist() == PAIR.tolist()
    until = sets.banned[(0,)]
    assert until - decided == 2 * set_check.TRIAL_BAN                 # a second strike
    for later in (decided + 1, until - 2):
        assert lift_into(sets, [B, 0], PAIR, SLOW, later).tolist() == [B, 0]
        assert sets.banned_set([B, 0], later + 1)
    assert not sets.banned_set([B, 0], until)
    sets.ban((0,), until + 5, set_check.TRIAL_BAN, True)              # a later coupling ban of the same set ...
    lift_into(sets, [B, 0], PAIR, SLOW, until + 6)
    assert not sets.banned_set([B, 0], until + 7)                     # ... may be lifted again


def test_the_coupling_seen_and_the_lifts_survive_a_checkpoint():
    """Saved as a checkpoint stores them (torch.save of checkpoint.to_safe, read back
    weights-only): saved after a plan offered a lift, before the move applies, and again
    after a lifted set lost its check, a set check restored from it goes on as the one
    that ran on."""
    def restored(sets):
        buffer = io.BytesIO()
        torch.save(checkpoint.to_safe(sets.state_dict()), buffer)
        buffer.seek(0)
        return set_check.SetCheck.from_state(torch.load(buffer, weights_only=True), ["node", "node"])
    sets, step = banned_alone()
    offered = sets.lifts.vector(sets, np.array([B, 0]), PAIR, SLOW, step, allocate)
    again = restored(sets)
    assert again.lifts.seen == sets.lifts.seen and again.lifts.offer == sets.lifts.offer is not None
    for each in (sets, again):
        each.switched(PAIR, offered, step + 1, "lift")
        for at in range(step + 1, step + 2 + set_check.RECENT):
            each.observe([B, 0], [0.0512, 0.0], True, at)
        each.verdict(step + 1 + set_check.RECENT)
    assert again.banned == sets.banned and again.verdicts == sets.verdicts
    again = restored(sets)
    later = step + 3 + set_check.RECENT
    for each in (sets, again):
        assert lift_into(each, [B, 0], PAIR, SLOW, later).tolist() == [B, 0] and each.banned_set([B, 0], later + 1)
    assert again.lifts.state_dict() == sets.lifts.state_dict()
