"""Coupled ranks seen at the start-up: the fastest ranks timed alone too.

A rank that shares a host with others may compute slower while they compute (memory
bandwidth, caches, the cores that feed a GPU: an H200 rank ran at half its speed beside
7 CPU ranks). The start-up calibration times every rank at once, so it sees each rank
at its coupled speed, and a plan from it keeps every rank. The set check
(dynamic/set_check.py) finds this out by a trial of the fastest ranks alone, but only
after its first wait (TRIAL_FIRST steps at the coupled speed). Here the calibration
finds it before the first step:

  who        where the fastest ranks (per-sample cost within FASTEST of the fastest's)
             share a host with slower ranks, and ranks may sit out
  timed      those ranks time the calibration's large batch once more, alone (the
             others wait, computing nothing): t_i(alone); with every rank computing
             the calibration measured t_i(together) (read off its line where the
             rank was slower than the fastest at the small batch: calibration.py)
  coupling   k_i = t_i(together) / t_i(alone); seen where the median over the fastest
             ranks is at least COUPLED
  start      then the fastest ranks alone, their models scaled by 1 / k_i (the speed
             they will have), against every rank's best vector under the calibration's
             fit: the fastest alone is taken where it is predicted LEAVE_GAIN faster

Only dbs re-planning within the epoch starts so, since its set check
(dynamic/set_check.py) then decides by measurement (the per-epoch rule would take every
rank back after the first epoch, unchecked). The first RECENT steps alone decide
(set_check.StartBan): where the fastest ranks compute there as the calibration timed
them alone (within COUPLED), and so COUPLED times faster per sample than its fit beside
the others, the larger set stays out for TRIAL_BAN steps, as when a trial of them alone
wins; where not (training computes otherwise than the calibration's copy), their
per-rank model, now at the speed they measure, takes the larger set back, the check
measures it, and the first trial waits as after a quiet start. Real coupling so costs
no step at the coupled speed before the ban ends (before, the model took the pair back
at its first plan and the check ran EARLY + 2 steps at that speed; a start from the
coupled fit ran TRIAL_FIRST); a busy spell that slowed only the calibration's timing
beside the others costs TRIAL_BAN steps alone, where the check would have taken the
larger set back after a few. static plans once and has no check: it keeps the
calibration's plan. Where the calibration saw every rank among the fastest on a shared
host, it timed none alone; if that timing was disturbed (a fast rank read 2.3x slower
beside the others than undisturbed), the steps soon tell the fastest ranks apart, and the
set check's first trial of them alone comes after UNSEEN_FIRST steps (first_trial).

What it costs: ALONE_STEPS + 1 more steps of the large batch on the fastest ranks, only
on a shared host with ranks of other speeds that the calibration's plan keeps. Pure
code, no MPI: the balancer times, every rank decides from the same gathered numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..options import UserError
from .allocation import SpeedModel
from .dynamic.set_check import COUPLED, FASTEST, QUIET_FIRST, TRIAL_FIRST, UNSEEN_FIRST, members, shares_host
from .participation import LEAVE_GAIN, allocate_for


ALONE_STEPS = 3       # timed steps alone, after one untimed (the large batch was just timed: warm)


@dataclass
class Start:
    """The calibration's plan where coupling was seen: the fastest ranks alone."""
    vector: np.ndarray          # (R,) int: only the fastest ranks take part
    model: SpeedModel           # the fit, the fastest ranks' models at their speed alone
    coupling: np.ndarray        # (R,) t(together) / t(alone) (NaN: not timed alone)
    every: np.ndarray           # (R,) int: the calibration's plan, the larger set it beat
    together: np.ndarray        # (R,) seconds per sample at `vector` under the fit beside the others (NaN: out)


def timed_alone(model: SpeedModel, hosts, participation: str = "auto", checked: bool = True,
                plan=None) -> np.ndarray | None:
    """The ranks (bool) the calibration times alone too, or None where no coupling could
    change the plan, or no set check would follow the start (checked: dbs's within-epoch
    planner runs; the per-epoch rule takes every rank back unchecked): ranks may not sit
    out, the hosts are unknown, every rank is among the fastest, the calibration's plan
    (the vector from `model`, if given) already leaves the others out, or no fastest
    rank shares a host with a slower one."""
    if not checked or participation != "auto" or hosts is None:
        return None
    c = np.asarray(model.per_sample, float)
    fastest = c <= FASTEST * c.min()
    if fastest.all() or (plan is not None and not (np.asarray(plan) > 0)[~fastest].any()):
        return None
    theirs = {hosts[i] for i in np.flatnonzero(fastest)}
    if not any(hosts[j] in theirs for j in np.flatnonzero(~fastest)):
        return None
    return fastest


def coupled_start(fit: SpeedModel, together, alone, global_batch: int, min_local: int = 1,
                  max_local=None, every=None) -> Start | None:
    """The fastest ranks alone where coupling was seen and they are predicted faster than
    every rank's best vector (see the module docstring), else None. together, alone:
    (R,) seconds of the calibration's large batch with every rank computing, and alone
    (NaN where a rank was not timed alone); every: the calibration's plan, if known."""
    alone = np.asarray(alone, float)
    timed = np.isfinite(alone) & (alone > 0)
    if not timed.any():
        return None
    coupling = np.where(timed, np.asarray(together, float) / np.where(timed, alone, 1.0), np.nan)
    if coupling_of(together, alone) < COUPLED:
        return None
    scale = np.where(timed, 1.0 / np.where(timed, coupling, 1.0), 1.0)
    model = fit.scaled(scale)
    every = allocate_for(fit, global_batch, min_local, max_local, "auto") if every is None else every
    fastest = allocate_for(model, global_batch, min_local, max_local, within=timed)
    if fastest is None or members(fastest) == members(every):
        return None
    if float(model.predict(fastest).max()) >= (1.0 - LEAVE_GAIN) * float(fit.predict(every).max()):
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        together = np.where(fastest > 0, fit.predict(fastest) / fastest, np.nan)
    return Start(fastest, model, coupling, np.asarray(every), together)


def decide(fit: SpeedModel, together, alone, hosts, participation: str, checked: bool, global_batch: int,
           min_local: int = 1, max_local=None) -> tuple[Start | None, int]:
    """coupled_start where timed_alone says the calibration times ranks alone (a fresh
    timing, or one recorded by another launch, whose `alone` must then be of this world
    and is read only where this job would have timed; None: none), and the planner steps
    before the set check's first trial (first_trial)."""
    plan = allocate_for(fit, global_batch, min_local, max_local)
    mask = timed_alone(fit, hosts, participation, checked, plan)
    if mask is None or alone is None:
        return None, first_trial(fit, hosts, participation, checked, None)
    alone = np.asarray(alone, float).reshape(-1)
    if alone.shape != mask.shape:
        raise UserError(f"calibration: its alone_time has {alone.size} value(s); this job has {mask.size} rank(s)")
    alone = np.where(mask, alone, np.nan)
    return (coupled_start(fit, together, alone, global_batch, min_local, max_local, plan),
            first_trial(fit, hosts, participation, checked, coupling_of(together, alone)))


def first_trial(fit: SpeedModel, hosts, participation: str, checked: bool, ratio: float | None) -> int:
    """The planner steps before the set check's first trial of the fastest ranks alone
    (set_check.py), from the calibration's fit and `ratio`, the coupling it timed (None:
    none timed alone): QUIET_FIRST where it timed them alone and saw no coupling (a trial
    would measure the same; at the crossover it moved a rank between 0 and its share for
    nothing); UNSEEN_FIRST where it saw every rank among the fastest on a shared host, so
    timed none alone (a timing disturbed beside the others: the steps tell the fastest
    apart soon, and a start so disturbed ran a coupled 1:0.25 pair 1.33x slower than its
    fast rank alone for TRIAL_FIRST steps); while every rank stays among the fastest, no
    trial runs at all. Else TRIAL_FIRST."""
    if ratio is not None:
        return QUIET_FIRST if ratio < COUPLED else TRIAL_FIRST
    c = np.asarray(fit.per_sample, float)
    if checked and participation == "auto" and shares_host(hosts, np.ones(len(c))) and (c <= FASTEST * c.min()).all():
        return UNSEEN_FIRST
    return TRIAL_FIRST


def coupling_of(together, alone) -> float | None:
    """The median over the ranks timed alone of t(together) / t(alone) (None: none was)."""
    alone = np.asarray(alone, float)
    timed = np.isfinite(alone) & (alone > 0)
    if not timed.any():
        return None
    return float(np.median(np.asarray(together, float)[timed] / alone[timed]))
