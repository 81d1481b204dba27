"""The within-epoch rule: every `interval` steps, a new vector when the estimate says it
pays, announced with a step's exchange and applied from a step nobody has handed out.

The planner proposes a new vector when a re-allocation from the updated models lowers
the predicted step time max_i t_i(b_i) by at least `min_gain`, and, where no rank's
speed changed, by GAIN_Z standard errors of the estimate too (a dead band: noise never
walks the vector). A rank whose step time at its current local batch is mostly fixed
cost (per-sample share below TINY_SHARE) may at most double its batch (or grow by B/2n)
in one move: its measurement says little about its per-sample cost, so a large jump
would be a guess (the overshoot of a rank cut to a few samples); near its balance (not
IDLE) it grows at most to SPREAD times the largest batch its window measured
(growth_limit). The rest of the move follows once RECENT steps have run at the new
batch, judged with the whole move (its gain over the slower of the vector now and the
one before the move's first part: alone, the rest of a small rank's move is often within
the dead band, and it stayed undone). A rank whose speed just changed and that the new
vector would cut far below what it measured, to a few samples priced on a fixed cost
nothing measured, sits out instead (cut_unmeasured). After any move the planner waits
until RECENT steps have run with the new vector; after an in-step probe (probe.py) it
goes back to the vector before it unless the measurement finds a better one by the dead
band.


How fast: a persistent change is in the level after ceil(RECENT / 2) = 3 steps, the
planner proposes at the next planning step (every `interval` steps), the proposal
reaches every rank with the next step's exchange, and the new vector applies from the
first step whose samples no rank has handed out yet (`switch_step`). With interval 1
and no prefetching the vector changes 4 steps after the change of speed began (the
5th step is the first under the new vector); a DataLoader prefetching P batches per
rank adds P.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..allocation import SpeedModel
from ..participation import allocate_for, least_step_time_sitting_out
from .estimate import RECENT, REFIT, REFIT_STEADY, SPREAD, TINY_SHARE, WINDOW, StepTimeEstimator
from .probe import PROBE_BELOW, PROBE_STEPS, Probes
from .set_check import TRIAL_FIRST, SetCheck


DEFAULT_INTERVAL = 1  # steps between re-plans (chosen by measurement: docs/method.md, section 5)


GAIN_Z = 3.0          # a new vector must gain at least this many standard errors of the estimate


IDLE = 2.0            # a rank whose step is below 1/IDLE of the slowest other's is idle most of the step


CUT = 4.0             # cut to a small batch under 1/CUT of all it measured at a new speed: out (cut_unmeasured)


def least_step_time_every_rank(model: SpeedModel, global_batch: int) -> float:
    """A lower bound of the step time of any vector in which every rank takes part (and
    pays its a_i): the continuous optimum with no bounds, sum_i (t - a_i) / c_i = B.
    (participation.least_step_time_sitting_out is the bound where ranks may sit out.)"""
    inverse = 1.0 / np.asarray(model.per_sample, float)
    return float((global_batch + np.sum(np.asarray(model.overhead, float) * inverse)) / np.sum(inverse))


def least_step_time(model: SpeedModel, global_batch: int, participation: str) -> float:
    """A lower bound of the step time of any vector the planner may choose: ranks may sit
    out under "auto" (participation.least_step_time_sitting_out), not under "all"."""
    if participation == "auto":
        return least_step_time_sitting_out(model.per_sample, model.overhead, global_batch)
    return least_step_time_every_rank(model, global_batch)


def switch_step(next_step: int, horizons) -> int:
    """The first step of the epoch from which a vector announced now may apply: not before
    the next step, and not before any rank's sampler has finished handing out the steps it
    already gave away (horizons: steps of the epoch handed out, per rank)."""
    return max(int(next_step), int(np.max(horizons)) if len(horizons) else 0)


@dataclass
class Proposal:
    """A new vector and the estimate that caused it."""
    vector: np.ndarray              # (R,) int
    per_sample: np.ndarray          # (R,) seconds per sample of the estimate
    overhead: np.ndarray            # (R,) seconds per step of the estimate
    predicted_before: float         # seconds: predicted step time (slowest rank) of the current vector
    predicted_after: float          # ... of the new one
    changed: np.ndarray             # (R,) bool: ranks whose speed changed (rather than drifted)
    cause: str = "plan"             # plan | probe (in the step) | revert | trial (set_check.py) | lift (lift.py)


def set_proposal(sets: SetCheck, model: SpeedModel, step: int, current, global_batch: int, min_local: int,
                 max_local, trials: bool) -> Proposal | None:
    """A proposal the set check makes (set_check.py): back to the vector before a set
    change that measured slower (as soon as its steps lie far apart: set_check.apart, so
    the planner asks while a move's hold lasts too), or (trials) a trial of the fastest
    ranks alone."""
    vector, cause = sets.verdict(step), "revert"
    if vector is None and trials:
        part, cause = sets.trial(step, current, model.per_sample), "trial"
        vector = None if part is None else allocate_for(model, global_batch, min_local, max_local, within=part)
    if vector is None or np.array_equal(vector, current):
        return None
    return Proposal(np.asarray(vector, np.int64), model.per_sample.copy(), model.overhead.copy(),
                    float(model.predict(current).max()), float(model.predict(vector).max()),
                    np.zeros(len(current), bool), cause)


class StepPlanner:
    """The within-epoch DBS rule: observe() every step, plan() proposes a new vector (or
    None) at most every `interval` steps, scheduled() says from which step a proposal
    applies. Steps are counted over the whole run."""

    def __init__(self, model: SpeedModel, global_batch: int, min_local: int = 1, max_local: int | None = None, *,
                 interval: int = DEFAULT_INTERVAL, window: int = WINDOW, follow: float = 0.25,
                 min_gain: float = 0.03, participation: str = "auto", hosts=None):
        self.estimator = StepTimeEstimator(model, window, RECENT, follow)
        self.global_batch, self.min_local, self.max_local = int(global_batch), int(min_local), max_local
        self.interval, self.min_gain, self.participation = int(interval), float(min_gain), participation
        self.step = 0                   # steps observed
        self.capped = False             # the last move stopped short at a tiny batch's growth limit ...
        self.move_from = None           # ... from this vector: its rest is judged with the whole move
        self.probes = Probes(len(self.estimator.model.per_sample))
        self.probed = False             # the vector of the steps to come is a probe (probe.py) ...
        self.probe_from = None          # ... from this vector, where it goes back unless a better one is found
        self.since_plan = self.since_refit = 0      # steps observed since the last planning, the last re-estimate
        self.hold_until = 2 * RECENT    # no planning before this step (the first steps; a move under way)
        self.settle_until = window      # re-estimate every REFIT steps before this step, then every REFIT_STEADY
        self.sets = SetCheck(hosts)     # the set of ranks taking part, checked by measurement

    @property
    def model(self) -> SpeedModel:
        return self.estimator.model

    def observe(self, batches, seconds, own_time=None) -> None:
        """One step's local batches and compute seconds; own_time (bool per rank, or None):
        the rank sat out and its entry is a probe it ran on its own time (probe.py), warm."""
        self.estimator.observe(batches, seconds, own_time)
        row = batches if own_time is None else np.where(own_time, 0, batches)
        self.sets.observe(row, seconds, int(np.sum(row)) == self.global_batch, self.step)
        self.probes.ran(row, self.step)
        if own_time is not None:
            self.probes.heard(own_time, self.step)
            self.capped |= self.probes.sped_up(self.estimator, own_time, batches, seconds)   # (plan at once)
        self.step, self.since_plan, self.since_refit = self.step + 1, self.since_plan + 1, self.since_refit + 1

    def plan(self, current) -> Proposal | None:
        """A better vector than `current` (the vector of the steps to come), or None. Every `interval` steps
        the ranks' recent levels are checked (cheap); the whole window is re-estimated when one moved, or at
        least every REFIT steps (drift; refit_due). A rank held at a small batch or sitting out is probed now and then
        (probe.py). A pending set check is asked at every step, a move's hold and the interval aside."""
        if self.step < self.hold_until or self.since_plan < self.interval:     # (only a pending set check)
            return None if self.sets.pending is None else self._checked(np.asarray(current, np.int64), False)
        self.since_plan = 0
        checked = self._checked(np.asarray(current, dtype=np.int64))
        if checked is not None or self.sets.pending is not None:      # a new set is measured first
            return checked
        if not refit_due(self, current):
            return None
        self.since_refit = 0
        changed, model = self.estimator.update(), self.estimator.model    # (in this order: the model re-estimated)
        current = np.asarray(current, dtype=np.int64)
        base = current if self.probe_from is None else self.probe_from    # a probe's vector is no plan: not the base
        reference = base if self.move_from is None else self.move_from   # the rest of a move that was cut short
        gain = self.min_gain
        if not changed.any() and not self.capped and not self.probed:    # drift: a move must also beat the noise
            gain = max(gain, -math.expm1(-GAIN_Z * float(self.estimator.uncertainty().max())))
        self.capped, self.probed, self.probe_from = False, False, None      # (move_from: kept through a probe)
        candidate = None if changed.any() else self.probes.vector(self.step, base, self.estimator.flat(), model,
                                                                   self.min_local, self.max_local)
        if candidate is not None and self.sets.banned_set(candidate, self.step):
            candidate = None                               # (a probe may not take a set measured slower either)
        self.probed, self.probe_from = candidate is not None, None if candidate is None else base.copy()
        if candidate is None:
            candidate = self._better(base, model, float(max(model.predict(base).max(), model.predict(reference).max()))
                                     * (1.0 - gain), changed)
            self.move_from = reference.copy() if self.capped else None
            back = base is not current and not self.sets.banned_set(base, self.step)
            candidate = base if candidate is None and back else candidate   # back from a probe
        if candidate is None or np.array_equal(candidate, current):
            return None
        self.hold_until = self.step + 1                    # until the announcement says when it applies
        return Proposal(candidate, model.per_sample.copy(), model.overhead.copy(), float(model.predict(current).max()),
                        float(model.predict(candidate).max()), changed,
                        "probe" if self.probed else self.sets.lifts.cause(candidate, self.step))

    def _better(self, current: np.ndarray, model: SpeedModel, target: float, changed) -> np.ndarray | None:
        """The model's vector if its predicted step time is at most `target` (None if not, or if no
        vector can be: the continuous optimum is the bound), less the ranks cut_unmeasured() sends
        out; where growth_limit holds a rank back, the part of that move it allows, if no slower than now."""
        if least_step_time(model, self.global_batch, self.participation) >= target:
            return None                                    # no vector can pass the dead band
        whole = self._allocate(model, current, self.max_local, changed)
        if whole is None or float(model.predict(whole).max()) > target or np.array_equal(whole, current):
            return None
        limit = growth_limit(current, self.estimator, self.global_batch, self.max_local, self.min_local)
        candidate = whole if limit is self.max_local else self._allocate(model, current, limit, changed)
        if candidate is None or np.array_equal(candidate, current) or \
                float(model.predict(candidate).max()) > float(model.predict(current).max()):
            return None
        self.capped = not np.array_equal(candidate, whole)    # the rest of the move goes on after RECENT steps
        return candidate

    def _allocate(self, model: SpeedModel, current: np.ndarray, limit, changed) -> np.ndarray | None:
        """The model's vector within `limit`, less the ranks cut_unmeasured() sends out where the others
        can take their samples within it; a set banned lately is re-balanced within the current one
        instead, unless its ban is lifted (lift.py: the set, priced with the coupling seen, pays now)."""
        candidate = allocate_for(model, self.global_batch, self.min_local, limit, self.participation)
        if self.participation == "auto":
            candidate = cut_unmeasured(candidate, changed, self.estimator, model, self.min_local, limit)
        candidate = self.sets.lifts.vector(self.sets, candidate, current, model, self.step, lambda price, within:
                                           allocate_for(price, self.global_batch, self.min_local, limit, within=within))
        if not self.sets.banned_set(candidate, self.step):
            return candidate
        return None if self.sets.banned_set(current, self.step) else \
            allocate_for(model, self.global_batch, self.min_local, limit, within=current > 0)

    def _checked(self, current: np.ndarray, trials: bool = True) -> Proposal | None:
        """The set check's proposal (set_proposal; trials only where ranks may sit out)."""
        proposal = set_proposal(self.sets, self.estimator.model, self.step, current, self.global_batch,
                                self.min_local, self.max_local, trials and self.participation == "auto")
        if proposal is not None:
            self.hold_until = self.step + 1
        return proposal

    def resize(self, global_batch: int) -> None:
        """Another global batch from the next step on (set_check.SetCheck.resized; no way back from a probe)."""
        self.global_batch, self.probe_from, self.move_from = int(global_batch), None, None
        self.sets.resized()

    def scheduled(self, ahead: int, old=None, new=None, cause: str = "plan") -> None:
        """A new vector applies `ahead` steps after the last step observed (0: from the next one): plan
        again once RECENT steps have run with it, re-estimating often while the window fills with them.
        Counted on the planner's own clock (steps observed), so a planner built in the middle of a run
        (a resume on another number of ranks, a second calibration) holds as long as one built at step 0."""
        first = self.step + int(ahead)
        if cause not in ("plan", "probe", "lift"):    # a trial, a revert or a forced vector: no way back from a probe
            self.probed, self.probe_from, self.move_from = False, None, None
        if old is not None:
            self.sets.switched(old, new, first, cause)
        self.hold_until = first + (PROBE_STEPS if self.probed else RECENT)
        self.settle_until = first + self.estimator.window

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "global_batch": self.global_batch, "step": self.step,
                "min_local": self.min_local, "max_local": self.max_local and int(self.max_local), "capped": self.capped,
                "interval": self.interval, "min_gain": self.min_gain, "since_plan": self.since_plan,
                "since_refit": self.since_refit, "hold_until": self.hold_until, "settle_until": self.settle_until,
                "participation": self.participation, "probes": self.probes.state_dict(), "probed": self.probed,
                "probe_from": None if self.probe_from is None else self.probe_from.copy(),
                "move_from": None if self.move_from is None else self.move_from.copy(), "sets": self.sets.state_dict()}

    @classmethod
    def from_state(cls, state: dict) -> "StepPlanner":
        self = cls.__new__(cls)
        self.estimator = StepTimeEstimator.from_state(state["estimator"])
        self.global_batch, self.min_local = int(state["global_batch"]), int(state["min_local"])
        self.max_local = state["max_local"] and int(state["max_local"])
        self.interval, self.min_gain = int(state["interval"]), float(state["min_gain"])
        self.participation = str(state.get("participation", "all"))     # saved before planners chose the set
        self.step, self.since_plan, self.since_refit, self.hold_until, self.settle_until = (
            int(state[k]) for k in ("step", "since_plan", "since_refit", "hold_until", "settle_until"))
        self.capped, self.probed = bool(state["capped"]), bool(state.get("probed", False))
        self.probe_from, self.move_from = (None if state.get(k) is None else np.asarray(state[k], np.int64).copy()
                                           for k in ("probe_from", "move_from"))
        self.probes = Probes.from_state(state.get("probes"), len(self.estimator.model.per_sample))
        self.sets = SetCheck.from_state(state.get("sets"))
        return self


def refit_due(planner: StepPlanner, current) -> bool:
    """Whether `planner` re-estimates its model at this plan: a rank's level moved, a move
    was cut short or a probe ran, REFIT steps passed (REFIT_STEADY once settled), or a ban
    may be lifted and the rank out reported a probe (lift.Lifts.due)."""
    refit = REFIT if planner.step < planner.settle_until else REFIT_STEADY
    return planner.since_refit >= refit or planner.estimator.moved() or planner.capped or planner.probed or \
        planner.sets.lifts.due(planner.sets, current, planner.model, planner.step, planner.since_refit,
                               planner.probes.own_time, planner.interval)


def growth_limit(current: np.ndarray, estimator: StepTimeEstimator, global_batch: int, max_local, min_local: int = 1):
    """Per-rank upper bounds of a move: a rank at a tiny batch (mostly fixed cost) at most
    doubles (or grows by B/2n, if that is more; never below min_local, so that a rank out
    may take part: above B/2n the bounds were infeasible and the planner raised); the
    others are bounded by max_local only.
    Where such a rank's step takes at least 1/IDLE of the slowest other rank's (near its
    balance, not idle most of the step), it grows at most to SPREAD times the largest
    batch its window measured (at least one sample more): beyond that its slope is a
    guess, read from batches close together or only scaled (at 1:0.1 a slope read from
    batches 1.4x apart took a rank at 19 samples to 48, 1.4x the step there, and back).
    The move itself spreads the window's batches as a probe does, and the rest follows
    on a measured slope."""
    model, flat = estimator.model, estimator.flat()
    largest = estimator.measured_range()[1]
    per_sample = model.per_sample * current
    share = per_sample / np.maximum(model.overhead + per_sample, 1e-300)
    if (current == 0).any():             # a rank out whose own-time probes spread: its slope is measured
        share = np.where((current == 0) & ~flat, 1.0, share)
    step = model.predict(current)
    second, top = np.sort(step)[-2:] if len(step) > 1 else (0.0, float(step[0]))
    others = np.where(step >= top, second, top)               # the slowest other rank's step, per rank
    guess = (current > 0) & (IDLE * step >= others)
    measured = np.maximum(np.ceil(SPREAD * np.maximum(largest, current)), current + 1) - current
    lift = np.where(guess, measured, np.maximum(current, math.ceil(global_batch / (2 * len(current)))))
    bound = np.inf if not max_local else float(max_local)
    limit = np.minimum(np.maximum(np.where(share < TINY_SHARE, current + lift, np.inf), min_local), bound)
    return limit if limit.sum() >= global_batch else max_local


def cut_unmeasured(vector: np.ndarray, changed, estimator: StepTimeEstimator, model: SpeedModel, min_local: int,
                   max_local) -> np.ndarray:
    """`vector` less the ranks it cuts, right after their speed changed, to a small batch
    (below PROBE_BELOW of an equal share) under 1/CUT of every batch their window measured
    at the new speed, where that window does not spread: the others take their samples
    (re-allocated by `model`), where they can within max_local (else `vector` as it is).
    Such a batch is priced on a fixed cost that nothing measured (the old model's, scaled
    by the new level): with a share f of the measured step fixed, a cut by k takes f k +
    1 - f times what a model without it says, and every rank waits for the few samples (a
    rank slowed 50x, priced at 0-36 ms of fixed cost where it had about 100, kept 2-10
    samples for 6-12 steps at 2-4x the others' step). Such a rank sits out instead: its
    own-time probes (probe.py) measure it at a small batch, and the plan takes it back
    where that pays. Its samples are below 1/8 of an equal share, so sitting out costs the
    others little; the error it avoids costs them the whole step."""
    vector = np.asarray(vector)
    if not np.any(changed):
        return vector
    low, high = estimator.measured_range()
    small = (vector > 0) & (vector < PROBE_BELOW * vector.sum() / len(vector))
    out = np.asarray(changed, bool) & small & (high < SPREAD * low) & (CUT * vector < low)
    cut = None if not out.any() else allocate_for(model, int(vector.sum()), min_local, max_local,
                                                  within=(vector > 0) & ~out)
    return vector if cut is None else cut


def with_probes(row, seconds, probe_batches, probe_seconds):
    """A step's local batches and seconds with the probes that ranks sitting out (local
    batch 0) ran on their own time in their place; and which ranks those are (None: none)."""
    if not any(probe_batches):
        return row, seconds, None
    own_time = (np.asarray(row) == 0) & (np.rint(probe_batches) > 0)
    row = np.where(own_time, np.rint(probe_batches), row).astype(np.int64)
    return row, np.where(own_time, probe_seconds, seconds), own_time


@dataclass
class Switch:
    """A new vector for the steps from `first_step` of the open epoch on, and what caused it."""
    vector: np.ndarray              # (R,) int
    first_step: int                 # step of the epoch from which it applies (may be past its end)
    proposal: Proposal | None       # this rank's estimate behind it (None: forced, or planned elsewhere)


class Replanner:
    """The within-epoch rule as every rank runs it, without MPI: every step each rank sends
    `outgoing()` (its slots, zeros elsewhere), the ranks' arrays are summed (the balancer
    puts them into the gradient allreduce's buffer), and `incoming()` reads the sum:

        [0, R)      every rank's pre-collective compute seconds of the step
        [R, 2R)     every rank's steps of the epoch handed out by its sampler
        [2R, 3R)    rank 0's proposal, announced (zeros: none)
        [3R, 4R)    every rank's probe on its own time (probe.py): the seconds it measured ...
        [4R, 5R)    ... and at how many samples (0: no probe reported with this step)
        5R          1 from every rank: the sum is R, or the array is not the sum over all ranks


    Every rank then holds the same times and runs the same planner on them; the vector
    that counts is rank 0's, so that floating-point differences between ranks (other CPUs,
    other libraries) can never split them. A proposal made after step s is announced with
    step s + 1 and applies from switch_step(): the first step whose samples no rank has
    handed out yet, so a DataLoader that prefetched batches never mixes two vectors in
    one step. Values are float32: exact for vectors and step counts below 2**24."""

    def __init__(self, rank: int, world_size: int, global_batch: int, min_local: int = 1, max_local=None, *,
                 model: SpeedModel | None = None, interval: int = DEFAULT_INTERVAL, window: int = WINDOW,
                 follow: float = 0.25, min_gain: float = 0.03, participation: str = "auto", hosts=None):
        self.rank, self.world_size, self.global_batch = int(rank), int(world_size), int(global_batch)
        self.settings = dict(min_local=int(min_local), max_local=max_local and int(max_local), interval=int(interval),
                             window=int(window), follow=float(follow), min_gain=float(min_gain),
                             participation=str(participation))
        self.hosts = None if hosts is None else list(hosts)     # every rank's host (where sets are tried)
        self.planner = None if model is None else self._planner(model)
        self.announce: np.ndarray | None = None     # rank 0: the vector to announce with the next step
        self.proposal: Proposal | None = None       # the last proposal of this rank's planner
        self._out = np.zeros(self.size, dtype=np.float32)
        self._out[-1] = 1.0                         # every rank's count: the sum is the world size
        self.probes = None                          # the own-time probes of the last step: (samples, seconds)
        self._announced = False

    def _planner(self, model: SpeedModel) -> StepPlanner:
        s = self.settings
        return StepPlanner(model, self.global_batch, s["min_local"], s["max_local"], interval=s["interval"],
                           window=s["window"], follow=s["follow"], min_gain=s["min_gain"],
                           participation=s["participation"], hosts=self.hosts)

    def on_hosts(self, hosts) -> None:
        """Every rank's host (set_check.py tries sets where ranks share one)."""
        self.hosts = list(hosts)
        if self.planner is not None:
            self.planner.sets.hosts = self.hosts

    def start_from(self, model: SpeedModel, first_trial: int = TRIAL_FIRST, coupled=None) -> None:
        """Begin from a calibrated model (else the first step's measurement is the start);
        first_trial: the steps before the set check's first trial, as the calibration
        decided (coupling.first_trial); coupled: it saw coupling, and the start is the
        fastest ranks alone (coupling.Start: SetCheck.start_alone)."""
        if isinstance(first_trial, bool):        # (the `quiet` flag it replaced: True would try at step 1)
            raise TypeError("start_from: first_trial is a number of steps (coupling.first_trial), not a bool")
        self.planner = self._planner(model)
        self.planner.sets.first_trial(first_trial)
        if coupled is not None:
            self.planner.sets.start_alone(coupled.vector, coupled.every, coupled.together, coupled.coupling)

    @property
    def size(self) -> int:
        return 5 * self.world_size + 1

    def resize(self, global_batch: int) -> None:
        """Another global batch from the next step on (between epochs): a proposal of the
        old one is dropped; the estimate, per rank, goes on."""
        self.global_batch, self.announce, self.proposal = int(global_batch), None, None
        if self.planner is not None:
            self.planner.resize(self.global_batch)

    def allowed(self, vector, current) -> np.ndarray:
        """A global batch's `vector`, or where the set check bans its set, the model's for that
        global batch within the set of `current` (where those ranks can hold it; the planner
        would otherwise sit on a banned set, unchecked, until the ban ended)."""
        p, vector = self.planner, np.asarray(vector)
        if p is None or not p.sets.banned_set(vector, p.step):
            return vector
        within = allocate_for(p.model, int(vector.sum()), p.min_local, p.max_local, within=np.asarray(current) > 0)
        return vector if within is None else within

    def propose(self, vector) -> None:
        """Ask for `vector` (rank 0's request is the one all ranks follow)."""
        vector = np.asarray(vector, dtype=np.int64)
        if vector.shape != (self.world_size,) or vector.sum() != self.global_batch or vector.min() < 0:
            raise ValueError(f"propose: {vector.tolist()} is not {self.world_size} local batches summing to the "
                             f"global batch {self.global_batch}")
        self.proposal = None
        if self.rank == 0:
            self.announce = vector.copy()

    def outgoing(self, seconds: float, handed: int, probe=None) -> np.ndarray:
        """This rank's slots of the step's sum (one array, reused: the others stay zero).
        probe: (samples, seconds) of a probe this rank ran on its own time, or None."""
        out, n = self._out, self.world_size
        out[self.rank] = seconds
        out[n + self.rank] = handed
        out[4 * n + self.rank], out[3 * n + self.rank] = (0, 0.0) if probe is None else probe
        if self.announce is not None:
            out[2 * n:3 * n] = self.announce
            self.announce = None
            self._announced = True
        elif self._announced:                      # last step's proposal went out: zeros again
            out[2 * n:3 * n] = 0.0
            self._announced = False
        return out

    def incoming(self, summed, row, current, next_step: int) -> Switch | None:
        """The step's sum arrived. row: the step's local batches; current: the vector of the
        steps to come; next_step: the epoch's next step. Returns the switch announced with
        this step (None if none), then observes the step and plans."""
        summed = summed.tolist() if hasattr(summed, "tolist") else list(summed)   # plain numbers: cheap to read
        n = self.world_size
        seconds, handed, announced = summed[:n], summed[n:2 * n], summed[2 * n:3 * n]
        if len(summed) != self.size or summed[-1] != n:
            raise RuntimeError(
                f"rank {self.rank}: the step's telemetry counts {summed[-1] if summed else 0:g} of the {n} ranks: "
                f"record_step(telemetry=...) takes the sum over all ranks of balancer.telemetry() that the step's "
                f"exchange carried, not this rank's own array")
        switch = None
        if any(announced):
            vector = np.rint(announced).astype(np.int64)
            if vector.sum() != self.global_batch or vector.min() < 0:
                raise RuntimeError(f"the announced batch vector {vector.tolist()} does not sum to the global batch "
                                   f"{self.global_batch}: the step's exchange was corrupted")
            switch = Switch(vector, switch_step(next_step, handed), self.proposal)
            self.proposal = None
        if self.planner is None:                    # not calibrated: start from the first step's measurement
            self.planner = self._planner(SpeedModel.measured(row, np.asarray(seconds)))
        self.probes = None if not any(summed[4 * n:5 * n]) else (np.rint(summed[4 * n:5 * n]).astype(np.int64),
                                                                 np.where(summed[4 * n:5 * n], summed[3 * n:4 * n],
                                                                          np.nan))
        row, seconds, own_time = with_probes(row, seconds, summed[4 * n:5 * n], summed[3 * n:4 * n])
        self.planner.observe(row, seconds, own_time)
        if switch is not None:
            cause = "forced" if switch.proposal is None else switch.proposal.cause
            self.planner.scheduled(switch.first_step - next_step, current, switch.vector, cause)
        proposal = self.planner.plan(switch.vector if switch is not None else current)
        if proposal is not None:
            self.proposal = proposal
            if self.rank == 0:
                self.announce = proposal.vector.copy()
        return switch

    def state_dict(self) -> dict:
        proposal = None if self.proposal is None else {
            "vector": self.proposal.vector.copy(), "per_sample": self.proposal.per_sample.copy(),
            "overhead": self.proposal.overhead.copy(), "predicted_before": float(self.proposal.predicted_before),
            "predicted_after": float(self.proposal.predicted_after), "changed": self.proposal.changed.copy(),
            "cause": self.proposal.cause}
        return {"rank": self.rank, "world_size": self.world_size, "global_batch": self.global_batch,
                "settings": dict(self.settings), "planner": None if self.planner is None else self.planner.state_dict(),
                "announce": None if self.announce is None else self.announce.copy(), "proposal": proposal}

    @classmethod
    def from_state(cls, state: dict) -> "Replanner":
        self = cls(int(state["rank"]), int(state["world_size"]), int(state["global_batch"]), **state["settings"])
        self.planner = None if state["planner"] is None else StepPlanner.from_state(state["planner"])
        self.announce = None if state["announce"] is None else np.asarray(state["announce"], np.int64).copy()
        p = state["proposal"]
        self.proposal = None if p is None else Proposal(
            np.asarray(p["vector"], np.int64).copy(), np.asarray(p["per_sample"], float).copy(),
            np.asarray(p["overhead"], float).copy(), float(p["predicted_before"]), float(p["predicted_after"]),
            np.asarray(p["changed"], bool).copy(), str(p.get("cause", "plan")))
        return self
