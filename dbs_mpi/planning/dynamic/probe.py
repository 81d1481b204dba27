"""Probing: a rank the plan holds at a tiny local batch is measured again now and then.

At a tiny batch a rank's step is mostly its fixed cost, so its steps say how fast it is
now (the level) but not what one more sample costs (the slope): the estimator keeps the
slope it had. If that slope came from a disturbed stretch (a burst of slow steps that
the line through the window read as a steep slope), the plan keeps the rank tiny, the
steps at one batch never correct the slope, and the rank stays pinned at 1-2 samples for
good, a few percent slower every step than the best vector.

So a rank held at a small local batch (below PROBE_BELOW of an equal share) whose
window has no spread of local batches (the estimator's flat()) for PROBE_FIRST steps
gets a probe for PROBE_STEPS steps (the first at a new batch is no measurement, then
RECENT); the line through the window then has two batches to fit the slope from. The
probe spreads the batches the cheaper way by the model's prediction: down to 1/SPREAD of
the rank's batch, the samples given to the rank with the largest one, or up to SPREAD times
it (at least one sample more), the samples taken from that rank. A rank small because it
is slow goes down: going up, every rank would wait for its slow extra samples (at 1:0.1
rank 0's steps took 1.1-1.5x while one ran); going down, the fast rank computes a few
samples more. Up is left where the rank cannot go down (1 sample, min_local) or is far
below its balance. After the probe the planner goes back to the vector before it unless
the measurement finds one better by its dead band (StepPlanner: the probe's vector is a
measurement, not a plan to improve on), and where that set is not banned. A probe that
max_local would cut short is not made (it would not spread the batches). A rank that
sits out (participation.py: local batch 0) is not measured at all, so it is probed the
same way at min_local samples: if it became fast, the plan takes it back.
Where the rank can probe itself on its own time instead (training/prober.py), its probes
ride the steps (Probes.heard: no in-step probe for it), and two of them in a row RETURN
times faster than its model scale the model at once (sped_up), as do a large one RETURN
times faster and the small one after it that is not (its cost a sample fell: the line
through them). Its prober spaces them
(at 1:0.02 on synthetic data 45-118 steps apart on busy cores, 11-19 on idle ones), so once heard, a rank
counts as measuring itself for PROBE_MAX steps after its last probe; only then (its
prober failed) does the in-step probe take over. With PROBE_FIRST there, a rank 50x
slower got an in-step probe, 9-15x the others' step for PROBE_STEPS steps, in every gap.

A small rank of more than PROBE_FEW samples that fills the step (by its model, its step
within PROBE_IDLE of the longest) waits PROBE_MAX steps for each probe: its level says
where it stands, and probes after PROBE_FIRST steps held only moved its batch (at 1:0.1
on 2 ranks, by a third for PROBE_STEPS steps a few times a run). A pinned rank mostly
idles (its steep slope prices the samples that would fill its step above what the dead
band lets the plan move), and every pinned rank seen sat at 1-2 samples, where its step
is mostly fixed cost and may fill the step: there a probe moves one or two samples, and
comes after PROBE_FIRST steps held. (With PROBE_MAX there, a rank slowed 8x and held at
1-2 samples on CI's busy cores had its work back 51 steps after the slow-down ended.)

A probe that changes nothing doubles the rank's wait, up to PROBE_MAX steps: the wait
starts again at PROBE_FIRST only once the rank's batch has not been small (or 0) in any
step for PROBE_FIRST steps in a row, or while it probes itself on its own time, so the
probe's own lift and the spread it leaves in the window are no new spell (they reset it,
and a rank rightly small was probed every 71 steps for good). After the first probe (a
slow-down is often short: PROBE_FIRST steps after it the first probe looks), a probe
that the model predicts to be costly (a rank that sits out because its least share takes
longer than the others' whole step) waits longer still, until its predicted cost is at
most PROBE_BUDGET of the steps (PROBE_STEPS x the relative extra time / the wait). A
rank whose batch is rightly small spends PROBE_STEPS steps in 256 at most half its work
longer; a rank that recovered has its work back within WINDOW + its wait (at most
PROBE_MAX, or the budget's wait for a costly probe) + REFIT_STEADY + PROBE_STEPS + RECENT
steps (the wait of a rank held at a small batch starts once the spread of the move that
made it small has left its window: WINDOW; a rank that sits out has no window to wait
for; the planner re-estimates every REFIT_STEADY steps when nothing moves). Where its
steps at the small batch show the change (its level), it is back within a few steps,
as any rank; busy cores can hide that at 1 sample, where the step is mostly fixed cost
(CI held a rank slowed 8x at 1 sample from step 94, 6 before the slow-down's end, and
its probe came at step 158). Probing earlier would not help as a rule: a probe that
lands in the slow-down finds nothing and doubles the wait (on synthetic steps with 15-30%
noise, the recovery got faster for some seeds and slower for others).
"""
from __future__ import annotations

import math

import numpy as np

from ..allocation import SpeedModel
from .estimate import RECENT, SPREAD


PROBE_BELOW = 0.125   # a local batch below this share of an equal one (B / n) is small


PROBE_IDLE = 0.25     # a small rank whose step, by its model, is within this share of the longest fills the step


PROBE_FEW = 4         # ... where it has more samples than this (at fewer a probe moves one or two)


PROBE_FIRST = 32      # steps a rank is held tiny and unmeasured before its first probe


PROBE_MAX = 256       # the longest wait between two probes of a rank that costs little ...


PROBE_BUDGET = 0.02   # ... for a costly probe, the wait that keeps its predicted cost at this share of the steps


PROBE_STEPS = RECENT + 1   # steps a probe runs: its first is not a measurement (estimate.py), then RECENT


RETURN = 2.0          # two own-time probes in a row this many times faster than the model: the rank sped up


LARGE_EVERY = 8       # an own-time probe (training/prober.py) is large at most every LARGE_EVERY-th ...
LARGE_WITHIN = 4      # ... cut to the largest power of two the last small one says takes at most this many steps,
LARGE_LEAST = 8       # ... where that is at least LARGE_LEAST small ones (else the small size again)


def own_probe_bounds(min_local: int, global_batch: int, ranks: int, max_local) -> tuple[int, int]:
    """The two sizes of a rank's own-time probes: max(min_local, 2) samples (the level) and
    B / 2n (the slope; at least SPREAD small ones), within max_local."""
    small = max(int(min_local), 2)
    large = max(math.ceil(SPREAD * small), int(global_batch) // (2 * int(ranks)))
    return small, min(large, int(max_local)) if max_local else large


def after_own_probe(size: int, small: int, seconds: float, last_small: float | None,
                    sped_up: bool) -> tuple[float | None, bool]:
    """(last_small, sped_up) after an own-time probe of `size` samples took `seconds`: a
    small one is the level, and the rank sped up where it ran twice as fast as the last
    small one; a large one answers a speed-up's call for the slope (own_probe_size)."""
    if size == small:
        return seconds, last_small is not None and seconds < 0.5 * last_small
    return last_small, False


def own_probe_size(small: int, large: int, due: bool, last_small: float | None, step_time: float) -> int:
    """The samples of a rank's next own-time probe (training/prober.py; the simulator runs
    the same rule): `small` (the level, cheap), or where a large one is `due` (none of the
    last LARGE_EVERY - 1 was, or the last small one ran twice as fast as the one before: a rank
    that sped up, whose slope the planner wants at once) `large` (the slope, so that a rank
    taken back gets its whole share at once; `large` no more than the samples the rank
    kept), cut to the largest power of two that the last small one (`last_small` seconds;
    `step_time`: the steps' mean interval) says takes at most LARGE_WITHIN steps: a slow
    rank's large probe would hold back the small ones that tell when it became fast. That
    reading is in proportion to the samples, so it over-states a large probe: a small one
    is mostly fixed cost (2 samples of LeNet-5 took 1.8-4.1 ms here, 128 took 13-18 ms).
    Where the whole large size had to fit, a rank back at speed after a 50x slow-down
    probed at 2 samples again in about half the runs, came back at 22-128 samples rather
    than its 256, and had its share 11-18 steps after the slow-down, not 5. A cut below
    LARGE_LEAST small ones, or below SPREAD times the small one, measures no slope: the
    small size again."""
    fits = 0.0 if last_small is None else LARGE_WITHIN * step_time / max(last_small, 1e-9) * small
    size = large if fits >= large else 2 ** int(math.log2(max(fits, 1.0)))
    if due and size >= SPREAD * small and (size == large or size >= LARGE_LEAST * small):
        return int(size)
    return int(small)


class Probes:
    """Since when each rank has been held (or was last probed), on the planner's clock,
    and how long its wait for the next probe is."""

    def __init__(self, ranks: int):
        self.since = np.zeros(ranks, dtype=np.int64)
        self.wait = np.full(ranks, PROBE_FIRST, dtype=np.int64)
        self.own_time = np.full(ranks, -PROBE_FIRST, dtype=np.int64)   # the step of each rank's last own-time probe
        self.held_at = np.full(ranks, -PROBE_FIRST, dtype=np.int64)    # the last step each rank's batch was small (ran)
        self.ratios: dict = {}    # rank -> its last two own-time probes' ratios to its model

    def ran(self, batches, step: int) -> None:
        """A step ran with `batches`: a rank whose batch was small (or 0) is in its spell; a
        rank that took part forgets its last own-time probe (its next spell out pairs none
        of the last one's with its own)."""
        batches = np.asarray(batches)
        self.held_at = np.where(batches < PROBE_BELOW * batches.sum() / len(batches), step, self.held_at)
        for rank in [rank for rank in self.ratios if batches[rank] > 0]:
            del self.ratios[rank]

    def heard(self, ranks, step: int) -> None:
        """`ranks` (bool per rank) reported a probe run on their own time at `step`."""
        self.own_time = np.where(ranks, step, self.own_time)

    def sped_up(self, estimator, own_time, batches, seconds) -> bool:
        """A rank that sits out and probes itself every step or two: where its last two probes
        both ran RETURN times faster than its model, its model is set from them at once (the
        line through them where their batches differ by SPREAD, else scaled by their ratio)
        and its window keeps only them (the window's rule needs three of five steps beyond
        the bound, and a slow rank's noisy steps before could fake a change of the wrong
        size). So it is where a large probe ran RETURN times faster and the small one after
        it did not (nor RETURN times slower): its cost a sample fell and its fixed cost held (a neighbour's memory
        traffic ended, say). Its small probes, most of its window, barely move, and the
        window's fit followed only once most large ones in it were new (41 steps on
        synthetic steps, or not in 120); the line through the two is its model at once.
        (Not the small one before the large: where the whole rank sped up between the two,
        that line would hold a stale fixed cost and a slope 5x too low.) Returns whether a
        rank's model was set."""
        model, scaled = estimator.model, False
        for rank in np.flatnonzero(own_time):
            b, t = float(batches[rank]), float(seconds[rank])
            last = self.ratios.setdefault(int(rank), [])
            last[:] = [*last[-1:], (b, t, t / float(model.overhead[rank] + model.per_sample[rank] * b))]
            if len(last) < 2:
                continue
            (b0, t0, r0), (b1, t1, r1) = sorted(last)
            line = b1 >= SPREAD * b0 and t1 > t0
            fell = line and r1 <= 1.0 / RETURN and r0 < RETURN and last[-1][0] == b0   # large, then small
            if max(r0, r1) <= 1.0 / RETURN or fell:
                rescale(estimator, int(rank), 1.0 if line else math.sqrt(r0 * r1), keep=2)
                if line:                                  # the slope too: the line through the two
                    c = (t1 - t0) / (b1 - b0)
                    model.per_sample[rank], model.overhead[rank] = c, max(t0 - c * b0, 0.0)
                    estimator._refresh_plain_copies()
                last.clear()
                scaled = True
        return scaled

    def vector(self, step: int, current: np.ndarray, flat: np.ndarray, model: SpeedModel, min_local: int,
               max_local) -> np.ndarray | None:
        """The probe vector for the first rank due at `step` (None: none due or none
        possible); ranks no longer held start afresh."""
        times = model.predict(current)
        small = (current > 0) & (current < PROBE_BELOW * current.sum() / len(current)) & flat
        fills = small & (current > PROBE_FEW) & (times > (1.0 - PROBE_IDLE) * times.max())   # its level says enough
        quiet = np.where(self.own_time >= 0, PROBE_MAX, PROBE_FIRST)          # heard probing itself before: its
        measured = (current == 0) & (step - self.own_time < quiet)           # duty spaces them (no in-step probe)
        held = small | ((current == 0) & ~measured)
        self.since = np.where(held, self.since, step)
        self.wait = np.where(measured | (step - self.held_at >= PROBE_FIRST), PROBE_FIRST, self.wait)
        before = float(times.max())
        for rank in np.flatnonzero(held & (step - self.since >= np.where(fills, PROBE_MAX, self.wait))):
            vector = _probe(current, rank, min_local, max_local, model)
            if vector is None:
                continue
            cost = max(0.0, float(model.predict(vector).max()) / max(before, 1e-300) - 1.0)
            if self.wait[rank] > PROBE_FIRST and step - self.since[rank] < PROBE_STEPS * cost / PROBE_BUDGET:
                continue                                  # a costly probe after the first waits for its budget
            self.since[rank], self.wait[rank] = step, min(2 * self.wait[rank], PROBE_MAX)
            return vector
        return None

    def state_dict(self) -> dict:
        return {"since": self.since.copy(), "wait": self.wait.copy(), "own_time": self.own_time.copy(),
                "held_at": self.held_at.copy(),
                "ratios": [[rank, [list(step) for step in values]] for rank, values in self.ratios.items()]}

    @classmethod
    def from_state(cls, state: dict | None, ranks: int) -> "Probes":
        self = cls(ranks)
        if state is not None:
            self.since = np.asarray(state["since"], dtype=np.int64).copy()
            self.wait = np.asarray(state["wait"], dtype=np.int64).copy()
            if "own_time" in state:
                self.own_time = np.asarray(state["own_time"], dtype=np.int64).copy()
                self.ratios = {int(r[0]): [tuple(float(v) for v in step) for step in r[1]] for r in state["ratios"]}
            if "held_at" in state:                  # (older checkpoints: no rank small before, its next spell new)
                self.held_at = np.asarray(state["held_at"], dtype=np.int64).copy()
        return self


def rescale(estimator, rank: int, level: float, keep: int) -> None:
    """Scale `rank`'s model in `estimator` by `level` and keep only its last `keep` steps
    in the window (what the estimator does to a rank whose speed changed)."""
    estimator.model.per_sample[rank] *= level
    estimator.model.overhead[rank] *= level
    rows, _, seconds = estimator._ordered()
    valid = np.flatnonzero(np.isfinite(seconds[:, rank]))
    drop = rows[valid[:-keep]] if keep else rows[valid]
    estimator.batches[drop, rank] = np.nan
    estimator.seconds[drop, rank] = np.nan
    estimator.count[rank] = min(len(valid), keep)
    estimator._refresh_plain_copies()


def _probe(current: np.ndarray, rank: int, min_local: int, max_local, model: SpeedModel) -> np.ndarray | None:
    """The cheaper of `current` with `rank` at SPREAD times its batch (at least one sample
    more; a rank that sits out: min_local), the samples taken from the rank with the
    largest batch, and `current` with `rank` at 1/SPREAD of its batch (where that is at
    least min_local), the samples given to that rank; by the model's predicted step time.
    A rank small because it is slow probes down: going up, every rank waits for its slow
    extra samples; going down, the fast rank computes a few samples more (at 1:0.1 about
    1% of the step against 40%)."""
    donor = int(np.argmax(np.where(np.arange(len(current)) == rank, -1, current)))     # the largest other batch
    grow = max(1, int(np.ceil((SPREAD - 1) * current[rank]))) if current[rank] else max(1, min_local)
    up = _moved(current, donor, rank, grow, max_local, min_local)
    shrink = int(current[rank] - current[rank] // SPREAD)
    down = _moved(current, rank, donor, shrink, max_local, max(1, min_local)) if current[rank] else None
    if up is None or down is None:
        return up if down is None else down
    return down if float(model.predict(down).max()) <= float(model.predict(up).max()) else up


def _moved(current: np.ndarray, source: int, to: int, samples: int, max_local, floor: int):
    """`current` with `samples` moved from `source` to `to` (None where that would take `to`
    past max_local, a probe that would not spread the batches, or leave `source` below
    `floor`)."""
    if samples < 1 or current[source] - samples < floor:
        return None
    if max_local and current[to] + samples > int(max_local):
        return None
    vector = current.copy()
    vector[to] += samples
    vector[source] -= samples
    return vector
