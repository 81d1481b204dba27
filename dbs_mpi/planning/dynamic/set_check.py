"""The set of ranks taking part, checked by measurement.

The planner's model is per rank: t_i(b) = a_i + c_i b, every rank's speed independent
of which other ranks compute. On one host it is not: ranks share the memory bandwidth,
the caches and the cores that feed a GPU, so a rank computes slower while the others
of its host compute (*coupled*; on an H200 node a GPU rank ran at half its speed beside
7 CPU ranks). A model fitted per rank sees the coupled speed only, and keeps ranks that
cost more than they bring. So every change of the set is checked by what it measures:

  step time   of a full step: the slowest taking-part rank's compute seconds (what the
              planner predicts, max_i t_i(b_i)); a set's: the median of RECENT steps
              under it (its first step, at new batch shapes, left out)
  check       after the set changes, once RECENT steps ran under the new one: where its
              step time exceeds the old set's last RECENT steps' by the margin (at least
              MARGIN, and CHECK_Z standard errors of the two medians from their spread),
              the planner goes back to the old vector, and the new set is *banned*: no
              plan may take it for BAN steps (doubling each time it fails again, at most
              BAN_MAX), since speeds change
  early       a check is decided after EARLY steps (its first left out) where every one
              of them lies beyond every one of the old set's RECENT by EARLY_MARGIN,
              slower or faster: a coupled pair's take-back measured 1.7-1.9x its
              fast rank alone, and its RECENT + 2 steps cost a 3-epoch LeNet-5 run 0.28 s
  trial       where ranks of the set share a host (where coupling can happen), the
              fastest ranks alone (per-sample cost within FASTEST of the fastest's) are
              tried: first after TRIAL_FIRST steps (QUIET_FIRST where the start-up timed
              them alone and saw no coupling; UNSEEN_FIRST where it saw every rank
              among the fastest, so timed none alone, on a shared host: a timing
              disturbed beside the others, found out once the steps tell the ranks
              apart), then after a wait that doubles with
              every trial lost (at most TRIAL_MAX); a trial is a set change, so it is
              checked as above, the other way round: kept only where the old set's step
              time exceeds its by the margin, else reverted (not banned: it was an
              experiment; at the crossover, where the two sets measure alike, a trial
              kept by default moved a 1:0.1 rank between 0 and its share). Where the fast ranks computed at least
              COUPLED times faster per sample alone than beside the others (coupling), a
              trial that won bans the larger set (for TRIAL_BAN steps, doubling on every
              repeat), which the per-rank model, now seeing the fast ranks' speed
              alone, would take back at once; without coupling the
              model saw what the trial saw and decides as before. A trial that lost
              without coupling ends the trials. Ranks taken back that measured slower
              with coupling seen (the ranks there before computed COUPLED times slower
              beside them) are banned for TRIAL_BAN too: the same evidence as a
              trial's; so is a plan's set without some ranks that measured slower
              while its ranks computed COUPLED times faster alone (the per-rank model,
              seeing that speed, would leave them out again after BAN). A start with
              the fastest ranks alone, where the calibration saw
              coupling (coupling.py), bans the larger set until its first steps alone
              decide (StartBan). No trial starts within SETTLE steps of a new vector (a
              change of the set, or a move within it): a rank that comes back takes its
              share over a few plans, and a trial then would compare the fastest ranks
              with a vector not yet balanced (it came 7 steps after a 50x slow rank's
              return, and held the return back 20 steps; 6 steps after the move that
              followed a 4x slow-down, it beat the unsettled pair, and the pair, banned
              with the coupling this VM shows, stayed out after the slow-down ended)

A trial costs at most RECENT + 2 steps at the slower set's time (EARLY + 2 where the two
sets measure far apart: its first and the one that carries the way back too), once per
wait: 7 steps after the first 64, then in 128, ... (without coupling, once). Pure code,
no MPI: the planner (within_epoch.py) runs it on every rank from the same summed times,
and rank 0's proposals are the ones applied.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..participation import members
from .estimate import MAD_SIGMA, MEDIAN_SE, RECENT
from .lift import Lifts


MARGIN = 0.03         # a new set must be at least this much slower to be reverted ...
CHECK_Z = 3.0         # ... and this many standard errors of the difference of the two medians
EARLY = 2             # steps of a new set (after its first) that decide its check at once ...
EARLY_MARGIN = 0.2    # ... where each lies this much beyond every step of the old set's last RECENT


BAN = 64              # steps a set that measured slower is banned for (doubling on every repeat) ...
BAN_MAX = 2048        # ... at most
TRIAL_BAN = 256       # ... and the larger set a trial beat with coupling seen, at first (each take-back of it
                      # costs RECENT + 2 steps at its time, EARLY + 2 far apart: 1.4x on the coupled pair,
                      # 5% of the steps at BAN)


TRIAL_FIRST = 64      # steps before the first trial of the fastest ranks alone (8 gave the coupled 1:0.25
                      # case 1.03 for 1.10 in its second epoch, but puts a trial into short runs everywhere)
TRIAL_MAX = 4096      # the longest wait between two trials
QUIET_FIRST = 512     # the first trial where the start-up timed the fastest ranks alone and saw no coupling
START_WAIT = 4 * RECENT   # a coupled start's ban of the larger set waits this long for its steps alone (StartBan)
SETTLE = 3 * RECENT   # steps after a new vector before a trial may start
UNSEEN_FIRST = SETTLE     # the first trial where the start-up saw every rank among the fastest (it timed none alone)
FASTEST = 1.5         # ranks whose per-sample cost is within this factor of the fastest rank's are "the fastest"
COUPLED = 1.25        # the fast ranks computed this much faster alone: coupling seen (trials go on)


UNCHECKED = ("revert", "forced", "probe")   # changes of the set that are not checked


def apart(before, after) -> bool:
    """Whether EARLY or more step times of a new set (`after`) all lie EARLY_MARGIN beyond
    every one of the old set's RECENT (`before`), slower or faster: its check needs no more."""
    if len(after) < EARLY or len(before) < RECENT:
        return False
    return min(after) > (1 + EARLY_MARGIN) * max(before) or (1 + EARLY_MARGIN) * max(after) < min(before)


def shares_host(hosts, vector) -> bool:
    """Whether two ranks taking part in `vector` share a host (hosts None: unknown, no)."""
    if hosts is None:
        return False
    theirs = [hosts[r] for r in members(vector) if r < len(hosts)]
    return len(theirs) != len(set(theirs))


def slower_beyond_noise(before, after) -> bool:
    """Whether the step times `after` are slower than `before` by the margin: MARGIN, and
    CHECK_Z standard errors of the difference of their medians (from their spread)."""
    logs_b, logs_a = np.log(before), np.log(after)
    spread = np.concatenate([logs_b - np.median(logs_b), logs_a - np.median(logs_a)])
    sigma = MAD_SIGMA * float(np.median(np.abs(spread)))
    se = MEDIAN_SE * sigma / math.sqrt(RECENT)
    return float(np.median(logs_a) - np.median(logs_b)) > max(math.log1p(MARGIN), CHECK_Z * math.sqrt(2) * se)


def measured_coupling(sets: "SetCheck", p: dict, rows: int = RECENT):
    """(smaller set, larger set, k) of a set change `p` (SetCheck.pending): the ranks of the
    smaller set computed k times faster per sample in it than beside the others (the
    medians of RECENT steps of the old set, of the new set's last `rows`, those its check
    read); None where neither set holds the other, or too few steps ran."""
    old, new = members(p["old"]), tuple(p["new"])
    if set(new) < set(old):                  # (a trial)
        ranks, larger, alone, with_others = new, old, sets.per_rank(new, rows, p["at"]), p["per_rank"]
    elif set(old) < set(new):                # ranks taken back
        ranks, larger, alone, with_others = old, new, p["per_rank"], sets.per_rank(new, rows, p["at"])
    else:
        return None
    if alone is None or with_others is None:
        return None
    return ranks, larger, float(np.median(with_others[list(ranks)] / np.maximum(alone[list(ranks)], 1e-12)))


class SetCheck:
    """The measured step time of the sets the planner ran, the check after a set change,
    the bans, and the trials of the fastest ranks alone (see the module docstring)."""

    def __init__(self, hosts=None):
        self.hosts = None if hosts is None else list(hosts)
        self.times: deque = deque(maxlen=2 * RECENT + 1)   # (set, step seconds, per-rank seconds, step) of full steps
        self.pending = None        # a set change to check: {"old": vector, "before": times, "trial": bool, "at": step}
        self.banned: dict = {}     # set -> the step until which it is banned
        self.strikes: dict = {}    # set -> times it measured slower
        self.next_trial, self.trial_wait = TRIAL_FIRST, TRIAL_FIRST
        self.changed_at = -math.inf    # the planner step from which the last new vector applied
        self.verdicts: list = []   # (step, set, "reverted" | "kept" | "lifted", before s, after s): for the records
        self.start: StartBan | None = None    # a coupled start's ban of the larger set, until its steps decide it
        self.lifts = Lifts()       # the coupling seen between sets, and the bans it lifted (lift.py)

    # --- measurement ---------------------------------------------------------------
    def observe(self, row, seconds, full: bool, step: int) -> None:
        """Planner step `step`'s local batches (0: sat out) and every rank's compute seconds."""
        part = np.asarray(row) > 0
        if full and part.any():
            per_sample = np.where(part, np.asarray(seconds, float) / np.maximum(np.asarray(row, float), 1), np.nan)
            self.times.append((members(row), float(np.max(np.asarray(seconds)[part])), per_sample, int(step)))
        if self.start is not None and self.start.settled(self, int(step)):
            self.start = None

    def switched(self, old, new, step: int, cause: str = "plan") -> None:
        """A new vector applies from planner step `step`: a new set is checked (UNCHECKED:
        not a change back after a check, a user's vector, or an in-step probe, which is
        meant to measure, slower or not)."""
        self.changed_at = int(step)
        if cause == "lift":
            self.lifts.take(self, members(new), int(step))
        if members(old) == members(new) or cause in UNCHECKED:
            self.pending = None if cause in UNCHECKED else self.pending
            return
        trial = cause == "trial"
        before = [t for s, t, _, _ in self.times if s == members(old)][-RECENT:]
        self.pending = {"old": np.asarray(old).copy(), "new": members(new), "before": before, "trial": trial,
                        "at": int(step), "per_rank": self.per_rank(members(old)), "lift": cause == "lift"}

    def start_alone(self, vector, larger, together, coupling) -> None:
        """The start-up began with the fastest ranks alone (`vector`), the calibration's plan
        (`larger`) slower where they compute `together`'s seconds per sample, `coupling`
        times their time alone: StartBan."""
        self.start = StartBan(members(vector), members(larger), together, coupling)
        self.banned[self.start.larger] = START_WAIT

    def resized(self) -> None:
        """The global batch changed: step times before it do not compare with those after."""
        self.times.clear()
        self.pending = None

    def first_trial(self, steps: int) -> None:
        """The first trial of the fastest ranks alone after `steps` planner steps, as the
        start-up decided (coupling.first_trial: TRIAL_FIRST, QUIET_FIRST or UNSEEN_FIRST)."""
        self.next_trial = steps

    def banned_set(self, vector, step: int) -> bool:
        """Whether `vector`'s set is banned at planner step `step` (not where this plan offers to lift it)."""
        return self.banned.get(members(vector), -1) > step and not self.lifts.offered(members(vector), step)

    # --- decisions -----------------------------------------------------------------
    def verdict(self, step: int):
        """The old vector where the set under check measured slower (go back), else None."""
        p = self.pending
        if p is None:
            return None
        after = [t for s, t, _, at in self.times if s == p["new"] and at > p["at"]]   # its first step: new shapes
        early = len(after) < RECENT and apart(p["before"], after)
        if len(after) < RECENT and not early:
            self.pending = None if step - p["at"] >= 4 * RECENT else p      # (too few steps: dropped)
            return None
        self.pending = None
        after = after[-RECENT:]
        if len(p["before"]) < RECENT:
            return None
        # early: the direction every step showed; a trial is an experiment: kept only where it won
        # by the margin (where the two sets measure alike, at the crossover, it would otherwise move
        # the ranks back and forth)
        slower = min(after) > max(p["before"]) if early else \
            not slower_beyond_noise(after, p["before"]) if p["trial"] else slower_beyond_noise(p["before"], after)
        if p["trial"]:
            self._after_trial(p, slower, step, len(after))
        elif slower:                      # a change that lost (a trial that lost is just undone)
            coupled = self._coupled(p, len(after))      # (a lifted set that lost: banned for good this time)
            self.ban(p["new"], step, TRIAL_BAN if coupled else BAN, coupled and not p.get("lift"))
        self.verdicts.append((step, p["new"], "reverted" if slower else "kept", float(np.median(p["before"])),
                              float(np.median(after))))
        return p["old"] if slower else None

    def trial(self, step: int, current, per_sample) -> np.ndarray | None:
        """The set of the fastest ranks alone, where a trial is due (None: not)."""
        if self.pending is not None or step < max(self.next_trial, self.changed_at + SETTLE) or \
                not shares_host(self.hosts, current):
            return None
        c = np.asarray(per_sample, float)
        fastest = c <= FASTEST * c[np.asarray(current) > 0].min()
        part = (np.asarray(current) > 0) & fastest
        if not part.any() or members(part) == members(current) or self.banned_set(part, step):
            return None
        self.next_trial = step + self.trial_wait
        return part

    # --- the rest --------------------------------------------------------------------
    def _after_trial(self, p: dict, slower: bool, step: int, rows: int = RECENT) -> None:
        """A trial that won bans the larger set where the fast ranks computed faster alone
        (coupling: else the per-rank model saw the same and decides as before); one that
        lost doubles the wait, and ends the trials where it showed no coupling."""
        coupled = self._coupled(p, rows)
        if not slower:
            if coupled:
                self.ban(members(p["old"]), step, TRIAL_BAN, True)
            return
        self.trial_wait = min(2 * self.trial_wait, TRIAL_MAX)
        self.next_trial = p["at"] + self.trial_wait if coupled else math.inf

    def _coupled(self, p: dict, rows: int = RECENT) -> bool:
        """Whether the change `p` showed coupling (measured_coupling; the factor goes to the lifts)."""
        seen = measured_coupling(self, p, rows)
        if seen is not None:
            self.lifts.saw(*seen)
        return seen is not None and seen[2] >= COUPLED

    def per_rank(self, key, last: int = RECENT, since: float = -math.inf):
        """Every rank's median seconds per sample over the `last` full steps of set `key`
        run after step `since` (NaN: not in it; None: too few steps)."""
        rows = [secs for s, _, secs, at in self.times if s == key and at > since][-last:]
        return None if len(rows) < last else np.median(np.array(rows), axis=0)

    def ban(self, key, step: int, first: int = BAN, liftable: bool = False) -> None:
        """Ban set `key` from `step` for `first` steps, doubled for every strike before (at most BAN_MAX);
        `liftable`: a coupling ban that lift.py may lift."""
        self.strikes[key] = self.strikes.get(key, 0) + 1
        self.banned[key] = step + min(first * 2 ** (self.strikes[key] - 1), BAN_MAX)
        self.lifts.banned(key, self.banned[key], liftable)

    def state_dict(self) -> dict:
        p = self.pending
        return {"banned": [[list(k), v] for k, v in self.banned.items()],
                "strikes": [[list(k), v] for k, v in self.strikes.items()],
                "next_trial": float(self.next_trial), "trial_wait": int(self.trial_wait),
                "changed_at": float(self.changed_at),
                "times": [[list(s), t, secs.copy(), at] for s, t, secs, at in self.times],
                "pending": None if p is None else {**p, "new": list(p["new"]), "before": list(p["before"])},
                "verdicts": [[v[0], list(v[1]), v[2], v[3], v[4]] for v in self.verdicts],
                "start": None if self.start is None else self.start.state_dict(), "lifts": self.lifts.state_dict()}

    @classmethod
    def from_state(cls, state: dict | None, hosts=None) -> "SetCheck":
        self = cls(hosts)
        if state:
            self.banned = {tuple(k): int(v) for k, v in state["banned"]}
            self.strikes = {tuple(k): int(v) for k, v in state["strikes"]}
            self.next_trial, self.trial_wait = float(state["next_trial"]), int(state["trial_wait"])
            self.changed_at = float(state.get("changed_at", -math.inf))     # (checkpoints before it: none)
            self.times.extend((tuple(s), float(t), np.asarray(secs, float), int(at[0]) if at else -1)   # (before: -1)
                              for s, t, secs, *at in state["times"])
            p = state["pending"]
            self.pending = None if p is None else {**p, "new": tuple(p["new"]), "old": np.asarray(p["old"])}
            self.verdicts = [(v[0], tuple(v[1]), v[2], v[3], v[4]) for v in state["verdicts"]]
            self.start = StartBan(*state["start"]) if state.get("start") else None    # (checkpoints before it: none)
            self.lifts = Lifts.from_state(state.get("lifts"))       # (checkpoints before it: none)
        return self


class StartBan:
    """A coupled start (planning/coupling.py: the calibration timed the fastest ranks
    COUPLED times faster alone than beside the others, and the plan starts with them alone).
    The larger set it beat (the calibration's plan) is banned until RECENT full steps of
    the ranks alone have run after their first (new shapes), at most until planner step
    START_WAIT (a planner starts at 0). Those steps cannot time the ranks beside the
    others, but they tell whether the calibration's timings carry over to training: where
    the ranks alone compute within COUPLED of the seconds per sample the calibration
    timed alone (`together` / `coupling` at the start's vector), either way, and still
    COUPLED times faster than its fit beside the others (`together`; NaN: not timed
    alone), the larger set is banned for TRIAL_BAN steps, as when a trial wins. Where not
    (training computes otherwise than the calibration's eager copy timed: compiled,
    autocast, data-bound), the ban is lifted, the planner takes the larger set back,
    checked as any change, and the first trial waits as after a quiet start
    (QUIET_FIRST). A busy spell that slowed only the calibration's timing beside
    the others passes this: it costs TRIAL_BAN steps alone. (Without it the per-rank
    model, which sees the fastest ranks' speed alone, took the larger set back at its
    first plan, and the check ran EARLY + 2 steps at the coupled speed: 0.2 s of a
    3-epoch LeNet-5 run at 1:0.25.)"""

    def __init__(self, alone, larger, together, coupling):
        self.alone, self.larger = tuple(alone), tuple(larger)
        self.together, self.coupling = np.asarray(together, float), np.asarray(coupling, float)

    def settled(self, sets: SetCheck, step: int) -> bool:
        """Whether the start is decided at planner step `step`: the ban made TRIAL_BAN long
        or lifted, or no RECENT steps alone within START_WAIT (the ban then ends there)."""
        measured = sets.per_rank(self.alone, RECENT, 0)
        if measured is None:
            return step >= START_WAIT
        ranks = list(self.alone)            # (all timed alone: coupled_start's vector; a NaN lifts the ban)
        m = np.maximum(measured[ranks], 1e-12)
        beside = np.median(self.together[ranks] / m)
        alone = np.median(self.together[ranks] / self.coupling[ranks] / m)
        if beside >= COUPLED and 1 / COUPLED <= alone <= COUPLED:
            sets.lifts.saw(self.alone, self.larger, beside)
            sets.ban(self.larger, step, TRIAL_BAN, True)
            return True
        if sets.banned.get(self.larger) == START_WAIT:
            del sets.banned[self.larger]
        sets.first_trial(max(sets.next_trial, QUIET_FIRST))   # (the take-back's check does a trial's work)
        return True

    def state_dict(self) -> list:
        return [list(self.alone), list(self.larger), self.together.tolist(), self.coupling.tolist()]
