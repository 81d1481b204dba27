"""How a waiting rank polls (dbs_mpi.mpi.waits.next_pause): short waits stay responsive,
long ones sleep longer so that they leave the core to the ranks that compute."""
import pytest

from dbs_mpi.mpi.waits import POLL_LONG_SHARE, POLL_SLEEP_LONG, POLL_SLEEP_MAX, POLL_SLEEP_MIN, next_pause


def pauses(waited_at, max_pause=POLL_SLEEP_MAX):
    pause, out = POLL_SLEEP_MIN, []
    for waited in waited_at:
        pause = next_pause(pause, waited, max_pause)
        out.append(pause)
    return out


def test_a_short_wait_doubles_up_to_the_short_limit():
    assert pauses([1e-4, 2e-4, 4e-4, 1e-3, 2e-3]) == pytest.approx([4e-5, 8e-5, 1e-4, 1e-4, 1e-4])


def test_a_long_wait_sleeps_a_share_of_what_it_waited_up_to_the_long_limit():
    assert next_pause(POLL_SLEEP_MAX, 0.02) == pytest.approx(2 * POLL_SLEEP_MAX)      # doubling still
    assert next_pause(1e-3, 0.03) == pytest.approx(0.03 * POLL_LONG_SHARE)             # 2% of the wait
    assert next_pause(POLL_SLEEP_LONG, 5.0) == POLL_SLEEP_LONG                         # never longer


def test_no_sleep_where_the_caller_asked_for_none_and_a_longer_limit_is_kept():
    assert pauses([0.001, 1.0, 10.0], max_pause=0.0) == [0.0, 0.0, 0.0]
    assert next_pause(0.01, 10.0, max_pause=0.01) == 0.01          # (bench: a rank that sits a case out)


LIBRARY = "MPICH Version: 5.0.2"


@pytest.mark.parametrize("environ, says", [
    ({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, "torchrun"),
    ({"WORLD_SIZE": "4"}, "mpirun -n 4"),
    ({"SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3"}, "srun --mpi=pmi2"),
    ({"PMI_SIZE": "8"}, "mpirun started 8 processes, but the MPI library mpi4py loaded (MPICH"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpirun started 2 processes"),
    ({"PMI_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "3"}, "sees 1, not the launcher's OMPI_COMM_WORLD_SIZE=3: launch"),
])
def test_a_launch_that_mpi_does_not_see_is_named(environ, says):
    from dbs_mpi.mpi.comm import launch_mismatch
    assert says in launch_mismatch(environ, 1, LIBRARY)


@pytest.mark.parametrize("environ", [{}, {"WORLD_SIZE": "1"}, {"SLURM_NTASKS": "4"}, {"SLURM_STEP_NUM_TASKS": "1"},
                                     {"PMI_SIZE": "1"}, {"WORLD_SIZE": "rubbish"}])
def test_a_single_process_on_purpose_keeps_working(environ):
    from dbs_mpi.mpi.comm import launch_mismatch
    assert launch_mismatch(environ, 1, LIBRARY) is None                  # (sbatch's own script: SLURM_NTASKS only)


def test_a_world_of_several_is_never_questioned():
    from dbs_mpi.mpi.comm import launch_mismatch
    assert launch_mismatch({"WORLD_SIZE": "2", "PMI_SIZE": "4"}, 4, LIBRARY) is None
