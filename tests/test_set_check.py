"""The planner on synthetic step times: probes a rank that sits out runs on its own time,
and the set of ranks taking part checked by measurement (planning/dynamic/set_check.py)."""
import numpy as np

from dbs_mpi.planning import dynamic, participation
from dbs_mpi.planning.allocation import SpeedModel
from dbs_mpi.planning.dynamic import set_check

B = 512


def run(replanner, steps: int, seconds_of, start, probe_every: int = 0, probe_of=None):
    """Drive a 2-rank Replanner with the step times seconds_of(step, row) (and, every
    probe_every steps, a probe of rank 1 at probe_of(step) = (samples, seconds) while it
    sits out); returns the vector of every step and the switches (step, vector, cause)."""
    current, rows, switches = np.array(start), [], []
    for step in range(steps):
        row = current.copy()
        rows.append(row)
        seconds = seconds_of(step, row)
        own = probe_of(step) if probe_every and row[1] == 0 and step % probe_every == 0 else None
        summed = replanner.outgoing(seconds[0], 0).copy()
        other = np.zeros(replanner.size, np.float32)
        other[1], other[-1] = seconds[1], 1.0
        if own is not None:
            other[4 * 2 + 1], other[3 * 2 + 1] = own
        switch = replanner.incoming(summed + other, row, current, step + 1)
        if switch is not None:
            switches.append((step, switch.vector.tolist(), switch.proposal and switch.proposal.cause))
            current = switch.vector.copy()
    return np.array(rows), switches


def own_time_probes(time_of):
    """Rank 1's own-time probes as training/prober.py runs them: 2 samples, and 128 after
    one that ran twice as fast as the one before."""
    last = {}

    def probe_of(step):
        size = 128 if last.get("sped_up") else 2
        seconds = time_of(1, size, step)
        if size == 2:
            last["sped_up"], last["small"] = seconds < 0.5 * last.get("small", np.inf), seconds
        else:
            last["sped_up"] = False
        return size, seconds
    return probe_of


def test_a_rank_that_probes_itself_on_its_own_time_is_back_soon_after_its_slow_down_ends():
    """Rank 1 is 50x slower until step 60 and sits out; its own-time probes ride every
    step, at 2 samples, and at 128 after one that ran twice as fast as the one before
    (as training/prober.py runs them): it is back with most of its share within 5 steps
    of the end, and no probe ever entered the steps."""
    rng = np.random.default_rng(0)

    def time_of(rank, b, step):
        return (3e-3 + 1e-4 * b) * (50 if rank == 1 and step < 60 else 1) * rng.lognormal(0, 0.05) if b else 0.0

    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([1e-4, 5e-3]), np.array([3e-3, 0.15])))
    rows, switches = run(replanner, 100, lambda s, row: [time_of(r, row[r], s) for r in (0, 1)], [B, 0],
                         probe_every=1, probe_of=own_time_probes(time_of))
    assert (rows[:60, 1] == 0).all(), switches
    back = next(s for s in range(60, 100) if rows[s, 1] >= 0.8 * B / 2)
    assert back - 60 <= 5, switches
    assert all(cause != "probe" for _, _, cause in switches), switches


def test_no_trial_starts_while_a_rank_that_came_back_takes_its_share():
    """As above on one host, rank 1 half as fast as rank 0 (so rank 0 alone is worth a
    trial), the slow-down ending just before the first trial is due (TRIAL_FIRST): rank 1
    is back with most of its share within 5 steps, and no trial of rank 0 alone starts
    within SETTLE steps of a change of the set (on a 2-core machine one came 7 steps after
    the return, and held rank 1 at a third of its share 20 steps)."""
    rng = np.random.default_rng(2)
    end = set_check.TRIAL_FIRST - 4

    def time_of(rank, b, step):
        per_sample = 2e-4 if rank == 1 else 1e-4
        return (3e-3 + per_sample * b) * (50 if rank == 1 and step < end else 1) * rng.lognormal(0, 0.05) if b else 0.0

    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([1e-4, 1e-2]), np.array([3e-3, 0.15])),
                                  hosts=["node", "node"])
    rows, switches = run(replanner, end + 60, lambda s, row: [time_of(r, row[r], s) for r in (0, 1)], [B, 0],
                         probe_every=1, probe_of=own_time_probes(time_of))
    back = next(s for s in range(end, end + 60) if rows[s, 1] >= 0.8 * B / 3)
    assert back - end <= 5, switches
    changes = [s for s in range(1, len(rows)) if (rows[s] > 0).tolist() != (rows[s - 1] > 0).tolist()]
    trials = [s + 1 for s, _, cause in switches if cause == "trial"]
    assert all(not 0 < t - c < set_check.SETTLE for t in trials for c in changes), (changes, switches)


def coupled_times(rng):
    """Rank 0 computes at half its speed while rank 1 computes (one host); rank 1 is 4x slower."""
    def seconds_of(step, row):
        c0 = 1e-4 * (2 if row[1] > 0 else 1)
        return [(1e-3 + c0 * row[0]) * rng.lognormal(0, 0.03) if row[0] else 0.0,
                (1e-3 + 4e-4 * row[1]) * rng.lognormal(0, 0.03) if row[1] else 0.0]
    return seconds_of


def test_on_a_coupled_host_the_fastest_rank_alone_is_tried_kept_and_the_pair_reverted_when_retried():
    """Per rank, the model sees rank 0 at its coupled speed and keeps both ranks; the trial
    of rank 0 alone measures faster and is kept; when the ban of the pair ends the planner
    takes rank 1 back, the check measures the pair slower and goes back. The last 200
    steps run within 1.05x of rank 0 alone."""
    rng = np.random.default_rng(1)
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])
    seconds_of = coupled_times(rng)
    rows, switches = run(replanner, 600, seconds_of, [340, 172])
    causes = [cause for _, _, cause in switches]
    assert "trial" in causes and "revert" in causes, switches
    step_time = [max(t for t in seconds_of(s, row) if t) for s, row in enumerate(rows)]
    alone = 1e-3 + 1e-4 * B
    assert np.mean(step_time[-200:]) <= 1.05 * alone, switches


def test_on_a_coupled_host_the_set_a_trial_beat_stays_out_for_the_trial_ban():
    """The coupled host from its first step: once the trial of rank 0 alone is kept, the
    pair, banned for TRIAL_BAN steps, is not taken back before that ban ends (its check
    costs RECENT + 1 steps at the pair's 1.3x each time)."""
    rng = np.random.default_rng(4)
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])
    rows, switches = run(replanner, set_check.TRIAL_FIRST + 300, coupled_times(rng), [340, 172])
    kept = next(step for step, _, cause in switches if cause == "trial") + 2 * set_check.RECENT
    assert (rows[kept:kept + 250, 1] == 0).all(), switches


def test_a_new_global_batch_keeps_out_of_a_set_the_set_check_banned():
    """The coupled host: after the trial of rank 0 alone won, the pair is banned. A new
    global batch (B 512 -> 1024, `--global-batch auto`) took its vector from the model,
    which gives rank 1 a share, and nothing checked it: the planner sat on the banned pair
    at 1.3-1.6x rank 0's time alone until the next trial. The new B starts within the set
    it had, and stays there."""
    rng = np.random.default_rng(4)
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])
    rows, switches = run(replanner, set_check.TRIAL_FIRST + 20, coupled_times(rng), [340, 172])
    assert rows[-1].tolist() == [B, 0], switches
    model_vector = participation.vector_at("dbs", replanner.planner.model, 2 * B, 2)
    assert model_vector[1] > 0                                      # the model alone would take the pair
    replanner.resize(2 * B)
    vector = replanner.allowed(model_vector, rows[-1])
    assert vector.tolist() == [2 * B, 0]
    rows, switches = run(replanner, 100, coupled_times(rng), vector)
    assert (rows[:, 1] == 0).all(), switches
    assert replanner.allowed([700, 324], [2 * B, 0]).tolist() == [2 * B, 0]
    assert replanner.allowed([2 * B, 0], [700, 324]).tolist() == [2 * B, 0]     # (a set not banned: as given)


def test_where_every_rank_must_take_part_no_set_is_tried():
    """participation "all": the coupled host of the test above, and no rank is ever left out."""
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"], participation="all")
    rows, switches = run(replanner, 300, coupled_times(np.random.default_rng(1)), [340, 172])
    assert (rows > 0).all(), switches
    assert all(cause not in ("trial", "revert") for _, _, cause in switches), switches


def test_without_a_shared_host_or_coupling_the_trials_stop():
    """Ranks on two hosts are never tried alone; on one host, a trial that shows no coupling
    (rank 0 as fast beside rank 1) ends the trials."""
    check = set_check.SetCheck(["a", "b"])
    assert check.trial(1000, np.array([300, 212]), np.array([1e-4, 4e-4])) is None
    rng = np.random.default_rng(2)
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([1e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])

    def seconds_of(step, row):
        return [(1e-3 + c * b) * rng.lognormal(0, 0.03) if b else 0.0 for c, b in zip((1e-4, 4e-4), row)]
    rows, switches = run(replanner, 1000, seconds_of, [410, 102])
    assert [cause for _, _, cause in switches].count("trial") == 1, switches
    assert replanner.planner.sets.next_trial == np.inf


def test_the_set_check_survives_a_checkpoint():
    replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([2e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                  hosts=["node", "node"])
    run(replanner, 150, coupled_times(np.random.default_rng(3)), [340, 172])
    state = replanner.planner.sets.state_dict()
    again = set_check.SetCheck.from_state(state, ["node", "node"])
    assert again.banned == replanner.planner.sets.banned and len(again.times) == len(replanner.planner.sets.times)
    assert again.state_dict()["verdicts"] == state["verdicts"]


def test_ranks_taken_back_that_slowed_the_others_stay_out_as_long_as_after_a_trial():
    """Rank 1 taken back and the pair measured slower: where rank 0 computed 2x slower per
    sample beside it (coupling seen, the evidence a trial gives) the pair is banned for
    TRIAL_BAN steps; where rank 1 is merely slow, for BAN."""
    for rank0, ban in ((0.081, set_check.TRIAL_BAN), (0.041, set_check.BAN)):     # 400 samples at 2e-4 / 1e-4
        sets = set_check.SetCheck(["node", "node"])
        for step in range(set_check.RECENT):
            sets.observe([512, 0], [0.052, 0.0], True, step)
        sets.switched([512, 0], [400, 112], 5)
        for step in range(5, 6 + set_check.RECENT):
            sets.observe([400, 112], [rank0, 0.09], True, step)
        assert sets.verdict(12).tolist() == [512, 0]
        assert sets.banned_set([400, 112], 12 + ban - 1) and not sets.banned_set([400, 112], 12 + ban)


def test_a_trial_is_kept_only_where_it_won_by_the_margin():
    """The fastest rank alone, tried: measuring 1% faster than the pair (the crossover,
    where both sets are alike) it goes back to the pair; 10% faster, it stays."""
    rng = np.random.default_rng(5)
    for gain, kept in ((0.99, False), (0.90, True)):
        sets = set_check.SetCheck(["node", "node"])
        for step in range(65, 70):
            sets.observe([460, 52], [0.050 * rng.lognormal(0, 0.005), 0.049], True, step)
        sets.switched([460, 52], [512, 0], 70, cause="trial")
        for step in range(70, 71 + set_check.RECENT):
            sets.observe([512, 0], [0.050 * gain * rng.lognormal(0, 0.005), 0.0], True, step)
        verdict = sets.verdict(77)
        assert (verdict is None) == kept, (gain, verdict)
        assert sets.verdicts[-1][2] == ("kept" if kept else "reverted")
        assert not sets.banned_set([512, 0], 78)                 # a trial that lost is undone, not banned


def test_a_check_whose_steps_lie_far_apart_is_decided_after_early_steps():
    """Rank 1 taken back: where rank 0 then steps 1.8x its time alone (the coupled pair on
    this machine measured 1.7-1.9x) the pair is reverted after its first step and EARLY
    more, and banned for TRIAL_BAN (the coupling read from those steps); where the steps
    are only 10% slower, or one of them lies within the old set's, the check waits for
    RECENT steps; a trial EARLY_MARGIN faster is kept as soon."""
    def check(after, cause="plan", old=(512, 0), new=(400, 112)):
        sets = set_check.SetCheck(["node", "node"])
        for step, t in enumerate((0.050, 0.052, 0.051, 0.049, 0.050)):
            sets.observe(old, [t, 0.0] if old[1] == 0 else [t, t], True, step)
        sets.switched(old, new, 5, cause)
        verdicts = []
        for step, t in enumerate(after, start=5):
            sets.observe(new, [t, 0.04] if new[1] else [t, 0.0], True, step)
            verdicts.append(sets.verdict(step + 1))
        return sets, verdicts

    sets, verdicts = check([0.095, 0.092, 0.094])
    assert verdicts[:2] == [None, None] and verdicts[2].tolist() == [512, 0], verdicts
    assert sets.banned_set([400, 112], 8 + set_check.TRIAL_BAN - 1) and sets.verdicts[-1][2] == "reverted"
    for after in ([0.056, 0.055, 0.057], [0.095, 0.060, 0.094]):
        sets, verdicts = check(after)
        assert verdicts == [None] * 3 and sets.pending is not None, (after, verdicts)
    sets, verdicts = check([0.030, 0.036, 0.035], cause="trial", old=(400, 112), new=(512, 0))
    assert verdicts == [None] * 3 and sets.pending is None and sets.verdicts[-1][2] == "kept", verdicts


def test_a_coupled_take_back_runs_a_few_steps_however_long_the_hold_after_a_move():
    """The coupled host, rank 0 alone at the start with its speed alone in the model (as
    after coupling.py's start): the per-rank model takes rank 1 back at once, and the pair,
    its steps 1.9x rank 0's alone, runs its first step, EARLY more and the one that carries
    the revert (not RECENT + 2: the planner asks the check while the move's hold lasts),
    then stays out for TRIAL_BAN steps."""
    for seed in range(3):
        replanner = dynamic.Replanner(0, 2, B, model=SpeedModel(np.array([1e-4, 4e-4]), np.array([1e-3, 1e-3])),
                                      hosts=["node", "node"])
        rows, switches = run(replanner, 300, coupled_times(np.random.default_rng(seed)), [512, 0])
        assert [cause for _, _, cause in switches[:2]] == ["plan", "revert"], switches
        assert (rows[:, 1] > 0).sum() <= set_check.EARLY + 2, switches
        assert (rows[switches[1][0] + 1:, 1] == 0).all(), switches


def test_a_set_taken_back_soon_is_checked_on_its_new_steps_only():
    """The pair ran, then rank 0 alone (kept early: far faster), then the pair again within
    a few steps: its steps from before the two changes are still among the times kept, and
    its check must not read them (they would revert it before it ran a step)."""
    sets = set_check.SetCheck(["node", "node"])
    for step in range(5):
        sets.observe([400, 112], [0.095, 0.04], True, step)
    sets.switched([400, 112], [512, 0], 5)
    verdicts = []
    for step in range(5, 10):
        sets.observe([512, 0], [0.050, 0.0], True, step)
        verdicts.append(sets.verdict(step + 1))
    assert sets.verdicts and sets.verdicts[-1][2] == "kept" and verdicts == [None] * 5, sets.verdicts
    sets.switched([512, 0], [400, 112], 10)
    assert sets.verdict(10) is None and sets.pending is not None
    sets.observe([400, 112], [0.052, 0.04], True, 10)               # its first step
    assert sets.verdict(11) is None and sets.pending is not None


def test_a_plan_that_left_ranks_out_and_lost_with_coupling_seen_is_banned_for_the_trial_ban():
    """A plan leaves rank 1 out ([40, 24] -> [64, 0], not a trial): rank 0 alone computes
    1.5x faster per sample, yet the step is 7% slower. The set goes back and the smaller
    set is banned for TRIAL_BAN steps, not BAN: the per-rank model, which now sees rank
    0's speed alone, would leave rank 1 out again as soon as a shorter ban ended."""
    sets = set_check.SetCheck(hosts=["node", "node"])
    for step in range(set_check.RECENT + 1):
        sets.observe([40, 24], [40 * 2e-4, 24 * 3.3e-4], True, step)
    at = set_check.RECENT + 1
    sets.switched([40, 24], [64, 0], at, "plan")
    for step in range(at, at + set_check.RECENT + 1):
        sets.observe([64, 0], [64 * 1.34e-4, 0.0], True, step)
    step = at + set_check.RECENT
    assert sets.verdict(step).tolist() == [40, 24]
    assert sets.banned[(0,)] == step + set_check.TRIAL_BAN
