"""Time to accuracy (dbs_mpi.tools.time_to_accuracy) on tables written by hand: the
target a point below the best fixed global batch's final accuracy, each run's first
epoch at it, a seed that never reached it counting as infinite, medians over seeds, the
best fixed global batch."""
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from dbs_mpi.tools import time_to_accuracy

# (label, seed): the test accuracy after each of 3 epochs; every epoch takes 10 s of training
CURVES = {
    ("auto", 0): [0.70, 0.86, 0.88], ("auto", 1): [0.80, 0.85, 0.855], ("auto", 2): [0.60, 0.70, 0.86],
    ("64", 0): [0.86, 0.86, 0.86], ("64", 1): [0.86, 0.87, 0.87], ("64", 2): [0.70, 0.80, 0.855],
    ("512", 0): [0.50, 0.60, 0.80], ("512", 1): [0.60, 0.70, 0.86], ("512", 2): [0.50, 0.60, 0.84],
}


def tables(curves=CURVES, experiment="adaptive"):
    runs, epochs = [], []
    for (label, seed), accuracy in curves.items():
        run = f"{experiment}/{label}-{seed}"
        auto = label == "auto"
        runs.append(dict(run=run, experiment=experiment, seed=seed, global_batch=128 if auto else int(label),
                         global_batch_auto=auto if auto else np.nan))
        epochs += [dict(run=run, epoch=e, wall_time=10.0 * (e + 1), test_accuracy=a) for e, a in enumerate(accuracy)]
    return SimpleNamespace(runs=pd.DataFrame(runs), epochs=pd.DataFrame(epochs))


def test_the_target_is_set_near_the_best_fixed_global_batchs_final_accuracy():
    judged = time_to_accuracy.judge(tables(), "adaptive")
    # median finals: 64 0.86, 512 0.84 -> 0.86 less a point, rounded down to half a point
    assert judged.target == pytest.approx(0.85)
    assert judged.order == ["auto", "64", "512"] and judged.fixed == ["64", "512"]
    assert judged.times["auto"].tolist() == [20.0, 20.0, 30.0]
    assert judged.times["512"].tolist() == [math.inf, 30.0, math.inf]
    assert judged.median_time.to_dict() == {"auto": 20.0, "64": 10.0, "512": math.inf}
    assert judged.best_fixed == "64"
    assert judged.median_final.to_dict() == pytest.approx({"auto": 0.86, "64": 0.86, "512": 0.84})


def test_the_adaptive_runs_do_not_move_the_target():
    better = {**CURVES, **{("auto", seed): [0.9, 0.95, 0.99] for seed in range(3)}}
    assert time_to_accuracy.judge(tables(better), "adaptive").target == pytest.approx(0.85)
    only_auto = {key: acc for key, acc in CURVES.items() if key[0] == "auto"}
    with pytest.raises(ValueError, match="no run with a fixed global batch"):
        time_to_accuracy.judge(tables(only_auto), "adaptive")
    unevaluated = {key: acc if key[0] == "auto" else [np.nan] * 3 for key, acc in CURVES.items()}
    with pytest.raises(ValueError, match="and a test accuracy"):
        time_to_accuracy.judge(tables(unevaluated), "adaptive")


def test_a_given_accuracy_and_the_refusal_of_a_missing_experiment():
    judged = time_to_accuracy.judge(tables(), "adaptive", accuracy=0.8)
    assert judged.median_time.to_dict() == {"auto": 20.0, "64": 10.0, "512": 30.0}
    with pytest.raises(ValueError, match="no run of experiment 'fixed'"):
        time_to_accuracy.judge(tables(), "fixed")


def test_without_an_adaptive_run_the_labels_are_the_global_batches():
    fixed_only = {key: acc for key, acc in CURVES.items() if key[0] != "auto"}
    t = tables(fixed_only)
    t.runs = t.runs.drop(columns="global_batch_auto")
    judged = time_to_accuracy.judge(t, "adaptive")
    assert judged.order == ["64", "512"] and judged.target == pytest.approx(0.85)
