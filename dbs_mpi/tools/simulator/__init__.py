"""Simulation: what a dbs-mpi run would do, in seconds, without running it.

A discrete-event model of a run, step by step, built from the engine's own parts: the
allocation and the DBS controller (allocation.py, dynamic/), the epoch's table of
local batches (sharding.step_batch_sizes), the calibration's batches and fit
(allocation.py), the emulator's slow-downs and random sleeps (heterogeneity.Emulator),
and for the parameter server its Cursor and group rule (parameter_server/work.py,
groups.py). None of them needs torch, and neither does the simulator: a projection
answers at once, on a login node too. What it models instead of running is in the
files' docstrings (docs/simulator.md has the formulas and what limits them). One idea a
file:

    network.py           the alpha-beta network: Network, buckets, NETWORKS
    cluster.py           the cluster and the compute model: Cluster, processor_sharing,
                         free_running_rate, Compute, emulators
    job.py               the run to simulate and what it did: Job, Result, SYNC, ASYNC
    sync.py              the synchronous strategies: simulate_sync, the start-up calibration,
                         the DBS controller and Replanner
    adaptive.py          the global batch of every epoch where it adapts: next_batch, resized
    parameter_server.py  the asynchronous strategies: ServerSim, simulate_async
    replaying.py         replaying a recorded run: replay, replay_job, read_inputs
    projecting.py        a run at scale: projection, project, speeds_from; when mixing pays:
                         crossover (`dbs-mpi simulate crossover`)
    calibration.py       the machine's residuals (`dbs-mpi simulate calibrate`)
    command.py           `dbs-mpi simulate`: its options, their checks, its output
"""
from .calibration import _calibrate, _residual, _spread, measure_residuals, mpi_bcast_tmp, residual_runs
from .cluster import DEFAULT_NOISE, Cluster, Compute, emulators, free_running_rate, processor_sharing
from .command import _check_values, _parser, _print, _setup, main
from .job import ASYNC, SYNC, Job, Result
from .network import NETWORKS, Network, buckets
from .parameter_server import ServerSim, _AsyncLoop, simulate_async
from .projecting import _crossover, _speeds_file, crossover, project, projection, speeds_from
from .replaying import (LEGACY, _measured_note, inputs_status, job_from_config, load_factor, machine_noise,
                        measured_epochs, placement_of, read_inputs, replay, replay_job)
from .sync import (_SyncClock, calibration_step, calibration_times, dbs_controller, first_vector, recorded_start,
                   simulate_sync, simulated_calibration, startup_fit, step_replanner)
