"""Lifting a ban that coupling justified, once the speeds behind it have changed.

A set the check measured slower with coupling seen (set_check.py: the larger set a trial
of the fastest ranks alone beat, ranks taken back that slowed the others, the smaller set
of a plan that left ranks out and lost, the larger set a coupled start confirmed) is
banned for TRIAL_BAN steps at first, doubling up to BAN_MAX: the per-rank model cannot
see the coupling and would take that set back at once. But the speeds behind a ban can
change. A rank left out because it was slow comes back fast (a slow-down's end, another
job's work on its node done); the fast ranks kept alone slow down; a rank kept in becomes
50x slower. The ban then holds the set that would pay out: on the coupled pair of the
tests (rank 0 2x slower per sample beside rank 1), rank 1 made 4x faster sat out to the
ban's end, about 190 steps at 1.5x the pair's time, and the retry there, balanced by the
per-rank model, lost again (rank 0, priced at its speed alone, took 384 of 512 samples
and computed them at half that speed).

So the set check keeps, per pair of sets one inside the other, the factor k by which the
smaller set's ranks computed faster per sample in it than beside the others, as its
latest check or trial between the two measured it (`saw`). Where the planner's model
wants a set whose coupling ban may be lifted while the other set of such a pair runs,
the banned set is *priced* with the coupling: the smaller set's ranks cost k times their
per-sample cost alone inside the larger set (the larger set banned), or 1/k times their
cost beside the others alone (the smaller one banned); the set is balanced at that price
and its step predicted. Where that beats the current set's predicted step (as it runs,
or re-balanced, whichever is less) by LIFT_GAIN, the plan offers the lift: it moves to
the priced vector (cause "lift"), and when that move applies the ban ends and the new set
is checked as any change. Priced so, the model explains the loss the ban came from (the
coupled pair above predicts 1.33x rank 0 alone, as measured), so it lifts only where the
speeds changed since. A lifted set that loses its check is banned again, doubled, and
that ban is not lifted: a price that is wrong costs one check (RECENT + 2 steps at the
slower set's time, EARLY + 2 where the two measure far apart) per coupling ban, not one
per plan. Bans without coupling (BAN) are never lifted: there the per-rank model itself
predicted the set faster and it measured slower, for a reason the model does not hold.

Pure code, no MPI, run by every rank's planner alike (within_epoch.py).
"""
from __future__ import annotations

import numpy as np

from ..allocation import SpeedModel
from ..participation import members
from .estimate import RECENT


LIFT_GAIN = 0.1       # a banned set, priced with the coupling seen, must be predicted this much faster


LIFT_EVERY = 0.1      # seconds of predicted steps (and RECENT steps) at least between two re-estimates for a lift


def priced(model: SpeedModel, ranks, factor: float) -> SpeedModel:
    """`model` with the per-sample cost of `ranks` times `factor`."""
    per_sample = np.asarray(model.per_sample, float).copy()
    per_sample[list(ranks)] *= factor
    return SpeedModel(per_sample, np.asarray(model.overhead, float).copy())


class Lifts:
    """The coupling seen between pairs of sets, the bans it may lift, and the lift a plan
    offers (module docstring)."""

    def __init__(self):
        self.seen: dict = {}       # (smaller set, larger set) -> how much faster the smaller set's ranks were in it
        self.liftable: dict = {}   # set -> the end of its ban, where coupling justified it and no lift lost it
        self.offer = None          # (set, planner step, step before s, priced step s): a plan's lift, until it applies

    def saw(self, smaller, larger, factor: float) -> None:
        self.seen[(tuple(smaller), tuple(larger))] = float(factor)

    def banned(self, key, until: int, liftable: bool) -> None:
        """Set `key` is banned until step `until`, a ban that may be lifted or not."""
        if liftable:
            self.liftable[key] = int(until)
        else:
            self.liftable.pop(key, None)

    def in_force(self, sets, key, step: int) -> bool:
        """Whether set `key` is under a ban (`sets`: set_check.SetCheck) at planner step `step` that may be lifted."""
        until = self.liftable.get(key)
        return until is not None and until > step and sets.banned.get(key) == until

    def offered(self, key, step: int) -> bool:
        """Whether the plan at planner step `step` offers to lift the ban of set `key`."""
        return self.offer is not None and tuple(self.offer[0]) == tuple(key) and self.offer[1] == step

    def vector(self, sets, candidate, current, model: SpeedModel, step: int, allocate) -> np.ndarray:
        """`candidate`, or where its set's ban may be lifted (`sets`: set_check.SetCheck) and
        the set, priced with the coupling seen between it and the current set, is predicted
        LIFT_GAIN faster than the current set (as it runs, or re-balanced): the priced vector
        (allocate(model, within) balances one), the lift offered. The same plan's second
        allocation (within a growth limit) is priced alike."""
        key, now = members(candidate), members(current)
        small, large = (key, now) if len(key) < len(now) else (now, key)
        factor, offered = self.seen.get((small, large)), self.offered(key, step)
        if factor is None or key == now or not offered and not self.in_force(sets, key, step):
            return candidate
        price = priced(model, small, factor if key == large else 1.0 / factor)
        vector = allocate(price, np.asarray(candidate) > 0)
        if vector is None or offered:
            return candidate if vector is None else vector
        balanced = allocate(model, np.asarray(current) > 0)
        before = min(float(model.predict(v).max()) for v in (np.asarray(current), balanced) if v is not None)
        after = float(price.predict(vector).max())
        if after > (1.0 - LIFT_GAIN) * before:
            return candidate
        self.offer = (key, step, before, after)
        return vector

    def due(self, sets, current, model: SpeedModel, step: int, since: int, own_time, interval: int = 1) -> bool:
        """Whether the model should be re-estimated now for a lift (the planner does so every
        REFIT_STEADY steps otherwise): a ban in force may be lifted from the current set, a
        rank that sits out reported a probe of its own time (`own_time`: each rank's last, on
        the planner's clock) since the last re-estimate, `since` steps ago, and that was
        RECENT steps or more, at one of every RECENT (the planner plans every `interval`
        steps: at one of its plans within each RECENT), and at least LIFT_EVERY seconds of
        predicted steps ago. A re-estimate costs some 0.7 ms, so at most 1% of the steps;
        the test is plain Python up to its last lines (numpy right after a backward costs
        tens of microseconds)."""
        if since < RECENT or since % RECENT >= interval:
            return False
        live = [key for key in self.liftable if self.in_force(sets, key, step)]
        if not live:
            return False
        now = members(current)
        if not any((key, now) in self.seen or (now, key) in self.seen for key in live):
            return False
        return bool((np.asarray(own_time) >= step - since).any()) and \
            since * float(model.predict(np.asarray(current)).max()) >= LIFT_EVERY

    def cause(self, vector, step: int) -> str:
        """A plan's cause (replan/cause): "lift" where it goes into a set whose ban it offers to lift."""
        return "lift" if self.offered(members(vector), step) else "plan"

    def take(self, sets, key, step: int) -> None:
        """The move of the lift offered into set `key` applies from step `step`: its ban ends."""
        if self.offer is not None and tuple(self.offer[0]) == tuple(key):
            sets.banned.pop(tuple(key), None)
            self.liftable.pop(tuple(key), None)
            sets.verdicts.append((step, tuple(key), "lifted", self.offer[2], self.offer[3]))
            self.offer = None

    def state_dict(self) -> dict:
        return {"seen": [[list(s), list(g), k] for (s, g), k in self.seen.items()],
                "liftable": [[list(k), v] for k, v in self.liftable.items()],
                "offer": None if self.offer is None else [list(self.offer[0]), *self.offer[1:]]}

    @classmethod
    def from_state(cls, state: dict | None) -> "Lifts":
        self = cls()
        if state:
            self.seen = {(tuple(s), tuple(g)): float(k) for s, g, k in state["seen"]}
            self.liftable = {tuple(k): int(v) for k, v in state["liftable"]}
            offer = state["offer"]
            self.offer = None if offer is None else (tuple(offer[0]), int(offer[1]), float(offer[2]), float(offer[3]))
        return self
