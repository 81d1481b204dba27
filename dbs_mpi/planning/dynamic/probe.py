"""Probing: a rank the plan holds at a tiny local batch is measured again now and then.

At a tiny batch a rank's step is mostly its fixed cost, so its steps say how fast it is
now (the level) but not what one more sample costs (the slope): the estimator keeps the
slope it had. If that slope came from a disturbed stretch (a burst of slow steps that
the line through the window read as a steep slope), the plan keeps the rank tiny, the
steps at one batch never correct the slope, and the rank stays pinned at 1-2 samples for
good, a few percent slower every step than the best vector.

So a rank held at a small local batch (below PROBE_BELOW of an equal share) whose window
has no spread of local batches (the estimator's flat()) for PROBE_FIRST steps gets a
probe: SPREAD times its local batch (at least one sample more), taken from the rank with
the largest one, for the RECENT steps a new vector runs before the planner plans again;
the line through the window then has two batches to fit the slope from. A probe that
changes nothing doubles the rank's wait, up to PROBE_MAX steps. The cost: a rank whose
batch is rightly small finishes its probe steps at most (SPREAD - 1) of its work later,
RECENT steps in PROBE_MAX (2% of the steps), a few percent of those steps' time; a rank
that recovered is given its work back within PROBE_MAX + REFIT_STEADY + 2 RECENT steps
(the planner re-estimates every REFIT_STEADY steps when nothing moves).
"""
from __future__ import annotations

import numpy as np

from .estimate import SPREAD


PROBE_BELOW = 0.125   # a local batch below this share of an equal one (B / n) is small


PROBE_FIRST = 32      # steps a rank is held tiny and unmeasured before its first probe


PROBE_MAX = 256       # the longest wait between two probes of a rank


class Probes:
    """When each rank may be probed next (on the planner's clock) and how long the wait
    after that one is."""

    def __init__(self, ranks: int):
        self.due_at = np.full(ranks, PROBE_FIRST, dtype=np.int64)
        self.wait = np.full(ranks, PROBE_FIRST, dtype=np.int64)

    def vector(self, step: int, current: np.ndarray, flat: np.ndarray, min_local: int, max_local) -> np.ndarray | None:
        """The probe vector for the first rank due at `step` (None: none due or none
        possible), and that rank's next wait; ranks no longer tiny or flat start afresh."""
        held = (current > 0) & (current < PROBE_BELOW * current.sum() / len(current)) & flat
        self.due_at = np.where(held, self.due_at, step + PROBE_FIRST)
        self.wait = np.where(held, self.wait, PROBE_FIRST)
        for rank in np.flatnonzero(held & (step >= self.due_at)):
            grow = max(1, int(np.ceil((SPREAD - 1) * current[rank])))
            grow = grow if not max_local else min(grow, int(max_local) - int(current[rank]))
            donor = int(np.argmax(np.where(np.arange(len(current)) == rank, -1, current)))
            if grow < 1 or current[donor] - grow < min_local:
                continue
            vector = current.copy()
            vector[rank] += grow
            vector[donor] -= grow
            self.due_at[rank] = step + self.wait[rank]
            self.wait[rank] = min(2 * self.wait[rank], PROBE_MAX)
            return vector
        return None

    def state_dict(self) -> dict:
        return {"due_at": self.due_at.copy(), "wait": self.wait.copy()}

    @classmethod
    def from_state(cls, state: dict | None, ranks: int) -> "Probes":
        self = cls(ranks)
        if state is not None:
            self.due_at = np.asarray(state["due_at"], dtype=np.int64).copy()
            self.wait = np.asarray(state["wait"], dtype=np.int64).copy()
        return self
