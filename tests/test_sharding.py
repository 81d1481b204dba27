"""Sharding: pure functions, no MPI."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dbs_mpi.planning import allocation, sharding


@given(N=st.integers(1, 3000), B=st.integers(1, 400), speeds=st.lists(st.floats(0.01, 1), min_size=1, max_size=8),
       drop_last=st.booleans(), epoch=st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_every_sample_once_and_equal_step_counts(N, B, speeds, drop_last, epoch):
    n = len(speeds)
    assume(B >= n)                     # a global batch smaller than the ranks is refused earlier (config)
    vector = allocation.proportional(B, speeds)
    shards = [sharding.epoch_shard(N, epoch, 7, B, vector, r, drop_last) for r in range(n)]
    steps = {len(s) for s in shards}
    assert steps == {sharding.steps_per_epoch(N, B, drop_last)}     # same step count on every rank
    seen = np.concatenate([idx for s in shards for idx in s]) if N >= B or not drop_last else np.array([], int)
    expected = N if not drop_last else (N // B) * B
    assert len(seen) == expected and len(np.unique(seen)) == expected   # no sample twice, none lost
    for r in range(n):  # full steps read exactly b_r samples: shard size proportional to b_r
        for idx in shards[r][: N // B]:
            assert len(idx) == vector[r]


def test_union_of_a_step_does_not_depend_on_the_vector_or_ranks():
    N, B = 1000, 97
    one = sharding.epoch_shard(N, 3, 11, B, [B], 0)
    vector = allocation.proportional(B, [1, 0.3, 0.07])
    three = [sharding.epoch_shard(N, 3, 11, B, vector, r) for r in range(3)]
    assert len(one) == len(three[0]) == 11
    for s in range(len(one)):
        union = np.concatenate([three[r][s] for r in range(3)])
        assert union.tolist() == one[s].tolist()          # same samples, same order


def test_permutation_is_seeded_per_epoch():
    a = sharding.epoch_permutation(100, 0, 1)
    assert a.tolist() == sharding.epoch_permutation(100, 0, 1).tolist()
    assert a.tolist() != sharding.epoch_permutation(100, 1, 1).tolist()
    assert a.tolist() != sharding.epoch_permutation(100, 0, 2).tolist()
    assert sorted(a.tolist()) == list(range(100))


def test_partial_last_step_may_leave_a_rank_empty():
    table = sharding.step_batch_sizes(1001, 100, [97, 2, 1])
    assert table.shape == (11, 3)
    assert table[-1].tolist() == [1, 0, 0] and table[:-1].sum() == 1000


def test_vector_must_sum_to_global_batch():
    with pytest.raises(ValueError):
        sharding.step_batch_sizes(100, 10, [5, 4])


def test_eval_shard_covers_the_test_set():
    parts = [sharding.eval_shard(10, r, 4) for r in range(4)]
    covered = [i for p in parts for i in range(p.start, p.stop)]
    assert covered == list(range(10))
