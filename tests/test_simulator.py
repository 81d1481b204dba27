"""The simulator (dbs_mpi/tools/simulator/): the event engine on cases with known answers, the
replay of committed runs against their measured times, and the DBS controller's decisions
against a recorded run. All in one process, no MPI; `dbs-mpi simulate` through the CLI (and
a quick `simulate calibrate` under mpirun -n 2)."""
import json
import math
import shutil

import h5py
import numpy as np
import pytest

from conftest import ROOT, run_cli
from dbs_mpi.planning import dynamic, sharding
from dbs_mpi.tools.fingerprint import describe
from dbs_mpi.tools.machine import Machine, ModelCost
from dbs_mpi.tools.simulator.calibration import EMULATED, _spread, compute_extra
from dbs_mpi.tools.simulator.sync import OwnProbeSizes
from dbs_mpi.tools.simulator import (Cluster, Compute, Job, Network, buckets, crossover, dbs_controller, processor_sharing,
                                     recorded_start, replay, replay_job, simulate_async, simulate_sync, startup_fit,
                                     step_replanner)

VALIDATION = ROOT / "results" / "validation"
TOLERANCE = 0.10          # the target: mean absolute error of predicted epoch times


def linear_model(per_sample=1e-3, fixed=2e-3, numel=1000, update=1e-4) -> ModelCost:
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    return ModelCost(batches=batches, step_time=[fixed + per_sample * b for b in batches], update=update,
                     overhead=0.0, numel=numel, add=update / 2)


def job(strategy="ssgd", samples=1024, global_batch=128, epochs=2, **kw) -> Job:
    return Job(strategy=strategy, model=kw.pop("model", linear_model()), samples=samples, global_batch=global_batch,
               epochs=epochs, **kw)


def cluster(speeds, cores=None) -> Cluster:
    n = len(speeds)
    return Cluster(nodes=np.arange(n), cores=cores or 1, device=np.asarray(speeds, float))


# --- the alpha-beta network --------------------------------------------------------------

def test_ring_and_tree_allreduce_times_for_known_sizes():
    net = Network(alpha=1e-5, beta=1e-9, algorithm="ring")
    m = 4e6
    assert net.allreduce(4, m) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * m * 1e-9)       # 6 alpha + 1.5 m beta
    assert Network(1e-5, 1e-9, "tree").allreduce(4, m) == pytest.approx(2 * 2 * (1e-5 + m * 1e-9))
    assert Network(1e-5, 1e-9, "tree").allreduce(5, m) == pytest.approx(2 * 3 * (1e-5 + m * 1e-9))
    small, large = 8.0, 4e8          # latency-bound: the tree; bandwidth-bound: the ring
    auto = Network(1e-5, 1e-9, "auto")
    assert auto.allreduce(1024, small) == Network(1e-5, 1e-9, "tree").allreduce(1024, small)
    assert auto.allreduce(1024, large) == Network(1e-5, 1e-9, "ring").allreduce(1024, large)
    assert net.allreduce(1, m) == 0.0


def test_exchange_sums_the_buckets_and_adds_the_constants():
    net = Network(alpha=1e-5, beta=1e-9, algorithm="ring", sleep_wait=3e-6, crowded=1e-4)
    parts = [1e6, 3e6]
    assert net.exchange(2, parts) == pytest.approx(net.allreduce(2, 1e6) + net.allreduce(2, 3e6))
    assert net.exchange(2, parts, sleeping=True) == pytest.approx(net.exchange(2, parts) + 3e-6)
    assert net.exchange(2, parts, crowded=True) == pytest.approx(net.exchange(2, parts) + 2 * 2 * 1e-4)


def test_buckets_cover_the_gradient_with_ddp_caps():
    numel = 20 * 2 ** 20                                   # 80 MiB of float32 gradients
    parts = buckets(numel, bucket_mb=25, first_bucket_mb=1)
    assert sum(parts) == pytest.approx(4 * (numel + 1))
    assert parts[0] == 2 ** 20 and all(p <= 25 * 2 ** 20 for p in parts)
    assert buckets(1000) == [4 * 1001]                     # a small model: one bucket


def test_processor_sharing_of_cores():
    nodes = np.zeros(4, dtype=int)
    assert np.allclose(processor_sharing(np.ones(4), nodes, [2]), 2.0)        # 4 equal ranks on 2 cores
    assert np.allclose(processor_sharing(np.ones(2), np.zeros(2, int), [2]), 1.0)
    # 1 and 2 core-seconds on one core: both at half speed until the first is done (t = 2),
    # then the second alone: 1 core-second left -> t = 3
    assert np.allclose(processor_sharing(np.array([1.0, 2.0]), np.zeros(2, int), [1]), [2.0, 3.0])


# --- the synchronous step ----------------------------------------------------------------

def test_equal_speeds_do_not_wait():
    j, c = job("ssgd"), cluster([1, 1, 1, 1])
    net = Network(1e-5, 1e-9, "ring")
    r = simulate_sync(j, c, net, noise=0.0)
    assert r.wait == 0.0 and r.shares()["wait_share"] == 0.0
    steps = sharding.steps_per_epoch(j.samples, j.global_batch, j.drop_last)
    step = j.model.compute(32) + net.exchange(4, buckets(j.model.numel)) + j.model.update
    assert r.epoch_time == pytest.approx([steps * float(step)] * 2)


def test_one_slow_rank_makes_the_others_wait_its_extra_time():
    j, c = job("ssgd", epochs=1), cluster([1, 1, 1, 0.5])
    r = simulate_sync(j, c, Network(1e-5, 1e-9), noise=0.0)
    steps = sharding.steps_per_epoch(j.samples, j.global_batch, j.drop_last)
    per = float(j.model.compute(32))                       # fast ranks' compute; the slow one takes 2x
    assert r.wait == pytest.approx(steps * 3 * per)        # three ranks each wait `per` every step
    assert r.epoch_time[0] == pytest.approx(steps * (2 * per + Network(1e-5, 1e-9).exchange(4, buckets(1000))
                                                     + j.model.update))


def test_static_allocation_removes_most_of_the_wait():
    c, net = cluster([1, 1, 1, 0.5]), Network(1e-5, 1e-9)
    ssgd = simulate_sync(job("ssgd"), c, net, noise=0.0)
    static = simulate_sync(job("static"), c, net, noise=0.0)
    assert static.batch_sizes[0][3] < static.batch_sizes[0][0]
    assert static.wait < 0.2 * ssgd.wait and sum(static.epoch_time) < sum(ssgd.epoch_time)


def test_emulated_speeds_sleep_without_taking_a_core():
    """Two ranks on one core, the second emulated at half speed: the emulated sleep of the
    slow rank happens after its compute, outside the shared core, and stretches its CPU
    work w, not the 2w it took on the shared core."""
    j = job("ssgd", epochs=1, speeds=(1.0, 0.5))
    c = Cluster(nodes=np.zeros(2, int), cores=1, device=np.ones(2))
    r = simulate_sync(j, c, Network(0.0, 0.0), noise=0.0)
    steps = sharding.steps_per_epoch(j.samples, j.global_batch, j.drop_last)
    w = float(j.model.compute(64))
    # both compute together on one core: 2w each; the slow one then sleeps (1/0.5 - 1) x w
    assert r.epoch_time[0] == pytest.approx(steps * (2 * w + w + j.model.update * 2))


def test_a_coupled_rank_computes_k_times_slower_where_another_rank_of_its_host_computes():
    """Rank 0 coupled 3x: beside a computing rank of its host its steps take 3x its
    compute (and the calibration, where every rank computes, times it so); with the
    other rank on another host, or without samples, it runs at its own speed."""
    net = Network(0.0, 0.0)

    def run(hosts, couple, strategy="ssgd"):
        c = Cluster(nodes=np.arange(2), cores=1, device=np.ones(2), hosts=np.asarray(hosts))
        return simulate_sync(job(strategy, epochs=1, couple=couple), c, net, noise=0.0)
    steps = sharding.steps_per_epoch(1024, 128, False)
    w = float(linear_model().compute(64))
    update = linear_model().update
    plain, coupled, apart = run([0, 0], {}), run([0, 0], {0: 3.0}), run([0, 1], {0: 3.0})
    assert plain.epoch_time[0] == pytest.approx(steps * (w + update))
    assert coupled.epoch_time[0] == pytest.approx(steps * (3 * w + update))
    assert apart.epoch_time[0] == pytest.approx(plain.epoch_time[0])
    static = run([0, 0], {0: 3.0}, "static")       # the calibration times rank 0 coupled: it gets the smaller share
    assert static.batch_sizes[0][0] < static.batch_sizes[0][1]
    assert run([0, 1], {0: 3.0}, "static").batch_sizes[0] == [64, 64]


def test_a_coupled_fastest_rank_starts_alone_as_in_the_engine():
    """Rank 0 coupled 3x beside rank 1, 10x slower than it: dbs's simulated calibration
    times rank 0 alone too and starts with it alone (coupling.py); on two hosts, or with
    participation "all", nothing is timed alone and both take part."""
    net = Network(0.0, 0.0)

    def run(hosts, participation="auto"):
        c = Cluster(nodes=np.arange(2), cores=1, device=np.array([1.0, 0.1]), hosts=np.asarray(hosts))
        return simulate_sync(job("dbs", epochs=1, couple={0: 3.0}, participation=participation), c, net,
                             noise=0.0)
    assert run([0, 0]).batch_sizes[0] == [128, 0]
    assert 0 < run([0, 1]).batch_sizes[0][1] < 64
    assert 0 < run([0, 0], "all").batch_sizes[0][1]


def test_a_simulated_coupled_start_keeps_the_pair_out_as_the_engine_does():
    """1:0.25, rank 0 at half speed beside rank 1 (B = 512, 60 steps an epoch): the
    simulated start is rank 0 alone, its first steps alone confirm the calibration's
    timing (set_check.StartBan), and the pair is not taken back: every epoch takes rank
    0's time alone (before, the model took rank 1 back at step 11 and the check reverted
    it at 15, 4% more in epoch 1)."""
    c = Cluster(nodes=np.arange(2), cores=1, device=np.array([1.0, 0.25]), hosts=np.asarray([0, 0]))
    coupled = simulate_sync(job("dbs", epochs=3, couple={0: 2.0}, samples=30720, global_batch=512), c,
                            Network(0.0, 0.0), noise=0.0)
    alone = simulate_sync(job("dbs", epochs=3, samples=30720, global_batch=512),
                          Cluster(nodes=np.arange(1), cores=1, device=np.array([1.0]), hosts=np.asarray([0])),
                          Network(0.0, 0.0), noise=0.0)
    assert coupled.batch_sizes == [[512, 0]] * 3
    assert coupled.epoch_time == pytest.approx(alone.epoch_time, rel=1e-3)


def test_the_simulated_probers_size_their_probes_as_the_engines():
    """OwnProbeSizes runs training/prober.py's rule: small probes; after one twice as fast
    as the one before, one large probe cut to what the small one says fits (64 of 128
    here), then small ones again; a large one every LARGE_EVERY-th where it fits; a rank
    taken back and out again starts afresh."""
    sizes, j, due = OwnProbeSizes(2), job("dbs", global_batch=512), np.array([False, True])
    for _ in range(40):
        sizes.stepped(0.047)
    seen = []
    for seconds in (0.1, 0.004, 0.01, 0.004, 0.004):
        sizes.sat_out(due)                              # (as _SyncClock._probes, every step)
        size = sizes.next(due, j, 512)
        sizes.measured(due, size, np.array([0.0, seconds]))
        seen.append(int(size[1]))
    assert seen == [2, 2, 64, 2, 2]
    assert sorted(int(sizes.next(due, j, 512)[1]) for _ in range(dynamic.LARGE_EVERY)) == [2] * 7 + [64]
    sizes.sat_out(due)                                  # still out: its last small probe is kept
    assert sizes.last_small[1] == 0.004
    sizes.sat_out(np.array([False, False]))            # taken back, then out again: afresh
    sizes.sat_out(due)
    assert sizes.last_small[1] is None and not sizes.sped_up[1]


def test_dbs_converges_to_the_speed_ratio():
    j = job("dbs", samples=8192, global_batch=512, epochs=6, model=linear_model(fixed=0.0))
    r = simulate_sync(j, cluster([1.0, 0.5]), Network(1e-5, 1e-9), noise=0.02, seed=1)
    last = np.asarray(r.batch_sizes[-1])
    assert last.sum() == 512 and last[0] / last[1] == pytest.approx(2.0, rel=0.1)


# --- the parameter server ----------------------------------------------------------------

def test_async_applies_every_sample_and_staleness_emerges():
    j = job("asgd", samples=2048, global_batch=192, epochs=2)
    c = Cluster(nodes=np.arange(4), cores=1, device=np.array([1.0, 1.0, 1.0, 0.25]))
    r = simulate_async(j, c, Network(1e-5, 1e-9), noise=0.0, checkpoint_every=0)
    assert len(r.epoch_time) == 2 and all(t > 0 for t in r.epoch_time)
    assert np.mean(r.staleness) > 0.5                       # 3 workers push between one worker's pulls
    assert max(r.staleness) >= 3                            # the slow worker's gradients are older


def test_hardsync_waits_for_the_slowest_worker():
    j = job("nsoftsync", samples=1536, global_batch=192, epochs=1, softsync_n=1, softsync_wait=True)
    c = Cluster(nodes=np.arange(4), cores=1, device=np.array([1.0, 1.0, 1.0, 0.5]))
    r = simulate_async(j, c, Network(0.0, 0.0), noise=0.0, checkpoint_every=0)
    assert set(r.staleness) == {0}
    per_step = 2 * float(j.model.compute(64))               # the slow worker's compute, every group
    assert r.epoch_time[0] >= sharding.steps_per_epoch(1536, 192, False) * per_step


# --- replays of recorded runs ------------------------------------------------------------

def validation_runs():
    return sorted(p for p in VALIDATION.glob("*.h5"))


def test_the_committed_validation_set_is_there():
    names = {p.stem for p in validation_runs()}
    for strategy in ("ssgd", "static", "dbs", "asgd"):
        assert any(n.startswith(strategy) for n in names), strategy
    assert {"ssgd-4r-real", "ssgd-3r-pinned"} <= names


def test_replay_mean_absolute_error_is_within_the_target():
    machine = Machine.load()
    errors = {}
    for path in validation_runs():
        out = replay(path, machine)
        errors[path.stem] = sum(out["epoch_time_predicted"]) / sum(out["epoch_time_measured"]) - 1
    mae = float(np.mean(np.abs(list(errors.values()))))
    assert mae <= TOLERANCE, f"mean absolute error {100 * mae:.1f}% > {100 * TOLERANCE:.0f}%: " + ", ".join(
        f"{k} {100 * v:+.1f}%" for k, v in errors.items())


def test_replay_reads_no_epoch_or_step_timings(tmp_path):
    """A copy of a run without its epoch and step records replays to the same prediction."""
    machine = Machine.load()
    source = VALIDATION / "dbs-2r.h5"
    stripped = tmp_path / "stripped.h5"
    shutil.copy(source, stripped)
    with h5py.File(stripped, "a") as f:
        for group in ("epoch", "step", "update", "worker"):
            if group in f:
                del f[group]
    a, b = replay(source, machine), replay(stripped, machine)
    assert a["epoch_time_predicted"] == b["epoch_time_predicted"] and b["epoch_time_measured"] == []


def test_simulated_dbs_controller_makes_the_engines_decisions():
    """The simulator's controller (built as simulate_sync builds it, from the run's start-up
    calibration) fed each recorded epoch's compute times gives the vectors the engine chose."""
    machine = Machine.load()
    checked = 0
    for path in [p for p in validation_runs() if p.stem.startswith("dbs")]:
        j, c, _, cfg, startup = replay_job(path, machine)
        if j.dbs_interval != "epoch":
            continue
        with h5py.File(path, "r") as f:
            vectors, speed = f["epoch/batch_sizes"][()], f["epoch/speed"][()]
        controller = dbs_controller(j, startup_fit(j, startup, c.size))
        assert np.array_equal(vectors[0], startup["batch_sizes"])
        for e in range(len(vectors) - 1):
            table = sharding.step_batch_sizes(j.samples, j.global_batch, vectors[e], j.drop_last)
            samples = table.sum(axis=0)
            new, _ = controller.update(vectors[e], table, samples / speed[e])
            assert np.array_equal(new, vectors[e + 1]), (path.name, e, new, vectors[e + 1])
            checked += 1
    assert checked >= 2


def test_the_simulated_replanner_fed_a_run_s_step_times_makes_the_engine_s_decisions():
    """dbs within the epoch: the Replanner the simulator drives, started from the run's
    calibration and fed every recorded step's compute times as the engine's allreduce
    carried them (float32; the in-memory loader hands out one step at a time), announces
    the vectors the engine switched to, at the same steps. (After a change to the
    planner, record the within-epoch runs again: scripts/simulator-validation.py
    --generate, with their files removed first.)"""
    machine = Machine.load()
    checked = 0
    for path in [p for p in validation_runs() if p.stem.startswith("dbs")]:
        j, c, _, cfg, startup = replay_job(path, machine)
        if j.dbs_interval == "epoch":
            continue
        with h5py.File(path, "r") as f:
            pre, rows, epoch = f["step/pre_time"][()], f["step/batch_sizes"][()], f["step/epoch"][()]
            recorded = list(zip(f["replan/run_step"][()].tolist(), f["replan/batch_sizes"][()].tolist()))
            zeros = np.zeros(rows.shape)            # (runs recorded before probes on a rank's own time: none)
            probes = f["step/probe_samples"][()] if "step/probe_samples" in f else zeros
            probe_time = np.nan_to_num(f["step/probe_time"][()]) if "step/probe_time" in f else zeros
        fit = startup_fit(j, startup, c.size)
        coupled, first_trial = recorded_start(j, c, startup, fit)
        replanner = step_replanner(j, fit if coupled is None else coupled.model, c, first_trial, coupled)
        current, switches = startup["batch_sizes"], []
        first_of_epoch = {e: int(np.flatnonzero(epoch == e)[0]) for e in np.unique(epoch)}
        for s in range(len(rows)):
            next_step = s - first_of_epoch[epoch[s]] + 1
            announced = replanner.announce if replanner.announce is not None else np.zeros(c.size)
            replanner.announce = None
            summed = np.concatenate([pre[s], np.full(c.size, next_step), announced, probe_time[s], probes[s],
                                     [c.size]]).astype(np.float32)
            switch = replanner.incoming(summed, rows[s], current, next_step)
            if switch is not None:
                current = switch.vector
                switches.append((s + 1 - next_step + switch.first_step, switch.vector.tolist()))
        assert switches == recorded, (path.name, switches, recorded)
        checked += 1
    assert checked >= 2


def test_the_compute_a_training_step_adds_is_read_from_the_emulated_run(tmp_path):
    """compute_extra: the mean over the steps after the first epoch of pre_time / (factor x
    load) less the model's table, for the spinning rank 0 and the sleeping rank 1 (speeds
    EMULATED: its pre-collective time is 4 times its compute); load: the run's own."""
    model = linear_model()
    machine = Machine(name="t", cores=2, alpha=1e-6, beta=1e-9, sleep_wait=0.0, data_per_sample={},
                      models={"lenet5": model})
    rng = np.random.default_rng(0)
    epoch = np.repeat([0, 1, 2], 10)
    batches = np.tile([[256, 256]], (30, 1))
    extra = np.where(epoch[:, None] == 0, 0.5, [[0.003, 0.006]]) + rng.normal(0, 1e-4, (30, 2))
    factor = max(EMULATED) / np.asarray(EMULATED)
    with h5py.File(tmp_path / "emulated.h5", "w") as f:
        f["step/pre_time"] = (model.compute(batches) + extra) * factor
        f["step/batch_sizes"], f["step/epoch"] = batches, epoch
    found = compute_extra(tmp_path / "emulated.h5", machine)
    assert found["spinning"] == pytest.approx(0.003, abs=1e-4) and found["sleeping"] == pytest.approx(0.006, abs=1e-4)
    with h5py.File(tmp_path / "faster.h5", "w") as f:          # the machine 20% faster than its table then
        f["step/pre_time"] = 0.8 * (model.compute(batches) + extra) * factor
        f["step/batch_sizes"], f["step/epoch"] = batches, epoch
    moved = compute_extra(tmp_path / "faster.h5", machine, load=0.8)
    assert moved["spinning"] == pytest.approx(0.003, abs=1e-4) and moved["sleeping"] == pytest.approx(0.006, abs=1e-4)
    assert compute_extra(tmp_path / "faster.h5", machine)["spinning"] == 0.0       # unscaled: the move, not the extra


def test_the_spread_is_the_step_to_step_noise_not_the_machines_slow_moves(tmp_path):
    """_spread: a run whose compute times carry lognormal noise of sigma 0.05 on a speed
    that moves by 1.5x now and then (every rank at once) has a spread near 0.05 (the moves
    add a little), not the 0.2 of log time around its mean."""
    rng = np.random.default_rng(1)
    epoch = np.repeat(np.arange(4), 100)
    level = np.repeat([1.0, 1.0, 1.5, 1.0, 1.0, 1.5, 1.5, 1.5], 50)[:, None]
    times = 0.02 * level * np.exp(rng.normal(0, 0.05, (400, 2)))
    with h5py.File(tmp_path / "sync.h5", "w") as f:
        f["step/compute_time"], f["step/epoch"] = times, epoch
    assert np.log(times[100:]).std(axis=0).min() > 0.15
    assert _spread(tmp_path / "sync.h5") == pytest.approx(0.05, rel=0.2)


def test_a_replay_adds_the_machines_compute_extra_to_every_training_step():
    """A rank with samples computes compute_extra more in a step ("sleeping" where its
    emulated slow-down sleeps, stretched with its compute as the engine does); a rank
    without samples nothing; the calibration's steps (Compute.work) nothing."""
    extra = {"spinning": 0.003, "sleeping": 0.005}
    plain, more = job(speeds=(1.0, 0.25)), job(speeds=(1.0, 0.25), compute_extra=extra)
    c = Cluster(nodes=np.arange(2), cores=1, device=np.ones(2))
    factor, row = np.array([1.0, 4.0]), np.array([64, 0])
    before = Compute(plain, c, 0.0, None).pre(np.array([64, 64]), factor, np.zeros(2))
    after = Compute(more, c, 0.0, None).pre(np.array([64, 64]), factor, np.zeros(2))
    assert after - before == pytest.approx([0.003, 4 * 0.005])
    assert Compute(more, c, 0.0, None).pre(row, factor, np.zeros(2)) == pytest.approx(
        Compute(plain, c, 0.0, None).pre(row, factor, np.zeros(2)) + [0.003, 0.0])
    assert np.array_equal(Compute(more, c, 0.0, None).work(row), Compute(plain, c, 0.0, None).work(row))
    assert replay_job(VALIDATION / "ssgd-2r.h5", Machine.load())[0].compute_extra == {}     # the file has none


def test_a_replays_load_factor_reads_only_the_cells_its_ranks_timed():
    """A rank much slower at the tiny batch (`tiny_time`, calibration.slow) has its
    calibration times read off, not timed: the load factor leaves them out. Rank 1's
    cells a tenth of what they were would lower it; with rank 1 slow at the tiny batch
    they do not. A file without `tiny_time` reads every rank's cells, as before."""
    from dbs_mpi.tools.simulator.replaying import load_factor
    j, c, _, _, startup = replay_job(VALIDATION / "ssgd-2r.h5", Machine.load())
    assert "tiny_time" not in startup
    timed = load_factor(j, c, startup)
    rank_0 = load_factor(j, c, {**startup, "tiny_time": np.array([1e-3, 1e-2])})    # rank 1 10x: read off
    read_off = {**startup, "step_time": startup["step_time"] * np.array([[1.0], [0.1]])}
    assert load_factor(j, c, read_off) < 0.5 * min(timed, rank_0)
    assert load_factor(j, c, {**read_off, "tiny_time": np.array([1e-3, 1e-2])}) == pytest.approx(rank_0)
    assert rank_0 >= timed


def test_a_replays_load_factor_leaves_out_a_slower_ranks_time_read_off_at_the_large_batch():
    """A rank 4x slower at the small batch timed a smaller large batch (startup/timed_large)
    and had its time at the large one read off its line (calibration.large_batches,
    read_off): that cell is not a measurement, and a tenth of it does not lower the load
    factor. calibration.timed says which cells were timed; a calibration recorded without
    timed_large (before the rule) timed the large batch on every rank that was not slow."""
    from dbs_mpi.planning import calibration
    from dbs_mpi.tools.simulator.replaying import load_factor
    tiny, times = [1e-3, 2e-3, 1e-2], [[0.01, 0.04], [0.04, 0.1], [0.2, 0.5]]
    assert calibration.timed_large(tiny, times, 128, 512).tolist() == [512, 224, 0]
    done = calibration.timed(tiny, times, 128, 512, calibration.timed_large(tiny, times, 128, 512))
    assert done.tolist() == [[True, True], [True, False], [False, False]]
    assert calibration.timed(tiny, times, 128, 512).tolist() == [[True, True], [True, True], [False, False]]
    assert calibration.timed([], times[:2], 128, 512, [512, 224]).tolist() == [[True, True], [True, False]]
    j, c, _, _, startup = replay_job(VALIDATION / "ssgd-2r.h5", Machine.load())
    assert "timed_large" not in startup
    times = startup["step_time"].copy()
    times[1] = times[0] * 4                                   # rank 1: 4x slower at both batches
    small, large = (int(b) for b in startup["local_batch"])
    slower = {**startup, "step_time": times, "timed_large": np.array([large, small + (large - small) // 4])}
    low = times.copy()
    low[1, 1] *= 0.1
    assert load_factor(j, c, {**slower, "step_time": low}) == pytest.approx(load_factor(j, c, slower))
    assert load_factor(j, c, {**startup, "step_time": low}) < load_factor(j, c, {**startup, "step_time": times})


def test_a_run_resumed_on_another_number_of_ranks_is_not_replayed(tmp_path):
    """Its startup/* are the first launch's, its hosts the last one's: one clear error."""
    path = tmp_path / "resumed.h5"
    shutil.copy(VALIDATION / "ssgd-2r.h5", path)
    with h5py.File(path, "a") as f:                 # what a resume on 3 ranks writes
        f.attrs["hostnames"] = np.array(["a", "a", "a"], dtype=h5py.string_dtype())
        f.attrs["rank_cores"] = np.array(["0,1", "0,1", "0,1"], dtype=h5py.string_dtype())
    with pytest.raises(ValueError, match="timed 2 rank.*ran 3"):
        replay_job(path, Machine.load())


def test_simulated_calibration_finds_the_emulated_speeds():
    j = job("static", samples=4096, global_batch=512, speeds=(1.0, 0.5, 0.25))
    r = simulate_sync(j, cluster([1, 1, 1]), Network(1e-5, 1e-9), noise=0.0)
    v = np.asarray(r.batch_sizes[0], float)
    assert v[0] / v[1] == pytest.approx(2.0, rel=0.1) and v[0] / v[2] == pytest.approx(4.0, rel=0.15)


# --- the command -------------------------------------------------------------------------

def test_simulate_from_a_run_prints_predicted_and_measured_epochs():
    run = run_cli(["simulate", "--from", str(VALIDATION / "ssgd-2r.h5"), "--json"], timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["epoch_time_predicted"]) == len(out["epoch_time_measured"]) == 3
    assert all(t > 0 for t in out["epoch_time_predicted"])


def test_simulate_projects_a_large_job_and_compares_strategies():
    run = run_cli(["simulate", "--ranks", "64", "--strategy", "dbs", "--model", "resnet20", "--speed-spread", "4",
                   "--epochs", "2", "--compare", "ssgd", "--json"], timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ranks"] == 64 and len(out["epoch_time_predicted"]) == 2
    assert out["speedup"] > 1.2                        # a 4x spread: dbs well ahead of ssgd
    assert math.isclose(out["compute_share"] + out["comm_share"] + out["wait_share"], 1.0)


def test_an_adaptive_projection_makes_the_engines_choice_at_the_noise_scale():
    """Where a step is mostly its fixed costs (a slow network), B grows after every
    epoch (at most doubling) at a large noise scale; at a small one it falls to half the
    start (by default) or further (at most halving) where --min-global-batch lets it,
    and stays where the bound is the start. On the development machine's file: the
    projection prices the steps from a machine file, by default this host's (a host with
    none, as a CI runner may be, gets the fallback, whose costlier ResNet-20 step made a
    network of 1 ms keep B at 128)."""
    def projected(noise, *more):
        common = ["simulate", "--ranks", "16", "--model", "resnet20", "--network", "3e-4,1e-8", "--local-batch", "8",
                  "--samples", "20000", "--epochs", "3", "--json", "--machine",
                  str(ROOT / "results/machine/dev-2core.json"), *more]
        run = run_cli(common + (["--global-batch", "auto", "--noise-scale", str(noise)] if noise else []), timeout=120)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    fixed, small, large = projected(0), projected(10), projected(2000)
    assert fixed["global_batches"] == projected(10, "--min-global-batch", "128")["global_batches"] == [128, 128, 128]
    assert small["global_batches"] == [128, 64, 64]
    lower = projected(10, "--min-global-batch", "32")["global_batches"]
    assert lower[:2] == [128, 64] and lower[2] in (32, 64)
    assert large["global_batches"] == [128, 256, 512]                   # at most doubling at every decision
    assert sum(large["epoch_time_predicted"][1:]) < sum(fixed["epoch_time_predicted"][1:])


def test_a_replay_of_an_adaptive_run_follows_the_batches_it_recorded():
    """The engine's choice came from a noise scale measured on gradients: the replay runs
    each epoch at the run's recorded B (with the engine's vector for it)."""
    sized = job("dbs", samples=2048, global_batch=64, epochs=5, global_batches=(64, 256, 256, 128, 128))
    result = simulate_sync(sized, cluster([1.0, 0.5]), Network(1e-5, 1e-9))
    assert [sum(v) for v in result.batch_sizes] == [64, 256, 256, 128, 128]
    assert result.batch_sizes[1][0] > result.batch_sizes[1][1]          # the engine's uneven vector at the new B


def test_simulate_reads_speed_mixes_from_toml(tmp_path):
    mix = tmp_path / "mix.toml"
    mix.write_text('[[mix]]\nname = "new"\nspeed = 1.0\ncount = 6\n\n[[mix]]\nname = "old"\nspeed = 0.5\ncount = 2\n')
    run = run_cli(["simulate", "--speeds", str(mix), "--strategy", "static", "--model", "lenet5", "--samples",
                   "8192", "--epochs", "1", "--json"], timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    v = out["batch_sizes"][0]
    assert out["ranks"] == 8 and v[0] > v[-1] and out["speeds"]["min"] == 0.5


@pytest.mark.parametrize("args, field", [
    (["--from", "nosuch.h5"], "from"),
    (["--ranks", "8", "--model", "nosuch"], "model"),
    (["--ranks", "8", "--network", "fast"], "network"),
    (["--ranks", "8", "--network", "1e-6,x"], "network"),
    (["--ranks", "8", "--noise", "-1"], "noise"),
    (["--ranks", "8", "--speed-spread", "0.5"], "speed-spread"),
    (["--speeds", "nosuch.toml"], "speeds"),
    ([], "simulate"),
    (["--ranks", "8", "--global-batch", "many"], "global-batch"),
    (["--ranks", "8", "--global-batch", "auto"], "noise-scale"),
    (["--ranks", "8", "--global-batch", "auto", "--noise-scale", "100", "--strategy", "asgd"], "global-batch"),
    (["--ranks", "8", "--global-batch", "auto", "--noise-scale", "100", "--min-global-batch", "512"],
     "min-global-batch"),
    (["--ranks", "8", "--global-batch", "auto", "--noise-scale", "100", "--min-global-batch", "-1"],
     "global-batch-start, min-global-batch"),
    (["--ranks", "8", "--min-global-batch", "16"], "global-batch-start, min-global-batch"),
    (["--ranks", "8", "--local-batch", "0"], "simulate"),                      # (it named global_batch, exit 1)
    (["--ranks", "8", "--compare", "foo"], "argument --compare"),              # (it printed a speed-up over foo)
])
def test_simulate_bad_input_is_one_line(args, field):
    run = run_cli(["simulate", *args], timeout=60)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dbs-mpi: error: {field}"), run.stderr


@pytest.mark.parametrize("text", ['speeds = [1, "x"]\n', 'speeds = [1, -2]\n', '[[mix]]\nname = "a"\n', 'speeds = [\n'])
def test_simulate_refuses_a_bad_speeds_file(tmp_path, text):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    run = run_cli(["simulate", "--speeds", str(bad)], timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("dbs-mpi: error: speeds:"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_simulate_refuses_a_file_that_is_no_result_file(tmp_path):
    bad = tmp_path / "run.h5"
    bad.write_text("not HDF5")
    run = run_cli(["simulate", "--from", str(bad)], ranks=2, timeout=60)
    assert run.returncode == 2 and run.stderr.count("dbs-mpi: error: from:") == 1, run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_quick_calibration_writes_a_machine_file_that_the_simulator_reads(tmp_path, ranks):
    """`simulate calibrate --quick` at 2 and at 4 ranks (on 2 cores: crowded collectives
    too), end to end (~25 s on the 2-core machine): every constant of its file is there
    and sane, and a replay and a projection read it."""
    from dbs_mpi.mpi.placement import available_cores
    from dbs_mpi.tools.machine import DRIFT_LIMIT, QUICK, SHAPES
    out = tmp_path / "machine.json"
    run = run_cli(["simulate", "calibrate", "--quick", "--name", "quick test", "--out", str(out)], ranks=ranks,
                  timeout=300)
    assert run.returncode == 0 and run.stdout.startswith(f"machine constants: {out} (alpha"), run.stdout + run.stderr
    machine = Machine.load(out)
    assert machine.name == "quick test" and f"{ranks} ranks" in machine.measured and "quick" in machine.measured
    assert 0 < machine.alpha < 0.01 and 0 < machine.beta < 1e-6 and machine.sleep_wait >= 0      # < 10 ms, > 1 MB/s
    assert machine.cores == available_cores() and machine.oversubscribed_message >= 0
    assert sorted(machine.data_per_sample) == ["1,28,28", "3,32,32"] and all(
        0 < v < 1e-3 for v in machine.data_per_sample.values()), machine.data_per_sample
    assert set(machine.residual) >= {"sync", "async"} and set(machine.noise) == {"alone", "crowded"}
    assert set(machine.compute_extra) == {"spinning", "sleeping"} and machine.host == {**describe(machine.host["mpi"]),
                                                                                         "date": machine.host["date"]}
    assert all(math.isfinite(v) and v >= 0 for v in [*machine.residual.values(), *machine.noise.values(),
                                                      *machine.compute_extra.values()])
    assert set(machine.models) == set(SHAPES) and machine.models["lenet5"].numel == 61706
    assert math.isfinite(machine.drift) and f"the machine moved {machine.drift:+.1%}" in run.stdout
    assert (abs(machine.drift) > DRIFT_LIMIT) == ("calibrate again when nothing else runs" in run.stderr)
    for name, cost in machine.models.items():
        assert cost.batches == list(QUICK.batches) and len(cost.step_time) == len(cost.batches), name
        assert 0 < cost.step_time[0] <= cost.step_time[-1] < 10, (name, cost.step_time)
        assert cost.update > 0 and cost.add > 0 and cost.overhead >= 0 and cost.numel > 0, (name, cost)
    replayed = run_cli(["simulate", "--machine", str(out), "--from", str(VALIDATION / "ssgd-2r.h5"), "--json"])
    projected = run_cli(["simulate", "--machine", str(out), "--ranks", "8", "--model", "resnet20", "--epochs", "1",
                         "--json"])
    for proc in (replayed, projected):
        assert proc.returncode == 0, proc.stderr
        times = json.loads(proc.stdout)["epoch_time_predicted"]
        assert times and all(0 < t < math.inf for t in times), times


def test_the_crossover_projects_when_mixing_pays_and_the_planner_never_loses_to_every_rank():
    """One fast rank with one or seven slower ones: mixing pays at 1:0.5 (the epoch is
    shorter than the fast rank alone's), less and less as the slow ranks slow down, and
    the planner's set (auto) is never slower than every rank taking part."""
    machine = Machine.load(None)
    for slow in (1, 7):
        rows = crossover(machine, slow, [0.5, 0.1, 0.02], epochs=2, samples=20480)
        assert rows[0]["all"] < 1.0 and rows[0]["all"] < rows[1]["all"] < rows[2]["all"], rows
        assert all(r["auto"] <= r["all"] * 1.02 for r in rows), rows


def test_a_bad_crossover_is_one_line_and_exit_2():
    proc = run_cli(["simulate", "crossover", "--ratios", "0.5,fast"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "dbs-mpi: error: crossover: --ratios and --network are numbers; got '0.5,fast', 'ib-100g'"], proc.stderr


def test_a_calibration_whose_machine_moved_says_so_and_an_old_file_reads_as_steady(tmp_path):
    from dbs_mpi.tools.machine import DRIFT_LIMIT, drift_note
    assert drift_note(DRIFT_LIMIT / 2) == "" and drift_note(-DRIFT_LIMIT / 2) == ""
    assert "+52%" in drift_note(0.52) and "calibrate again" in drift_note(-0.2)
    data = json.loads((ROOT / "results/machine/dev-2core.json").read_text())
    data.pop("drift", None)                           # (files written before it was measured)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert Machine.load(old).drift == 0.0
