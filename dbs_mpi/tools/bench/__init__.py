"""Benchmarks: `dbs-mpi bench CASE` (command.py's docstring: the cases, their targets, how
they run). One idea a file:

    command.py    `dbs-mpi bench`: its options and their checks, the cases in turn, the summary
    report.py     a check against its target, the final table, the HDF5 result file
    harness.py    a case on the first k ranks (the others sleep), a training run, a timed call,
                  the models timed at their usual inputs
    plain.py      the plain PyTorch loop that ddp and overhead measure against
    exchange.py, ddp.py, hetero.py, overhead.py, scaling.py, overlap.py, wait.py, batchnorm.py,
    tracking.py   one case each (tracking's scenarios and metrics: ../bench_tracking.py)
"""
from ..train import load_data, train   # as bench.py had them: scripts read them here
from .batchnorm import BATCHNORM_VARIANTS, _batchnorm, _buffer_broadcast, case_batchnorm, format_batchnorm
from .command import (ALL_DEFAULTS, CASES, FORMATTERS, RUNNERS, _check_tracking, _parser, _setup, main,
                      required_ranks)
from .ddp import _ddp, _free_port, case_ddp, format_ddp
from .exchange import _alternating, _exchange, _exchange_variants, case_exchange, format_exchange
from .harness import (IDLE_POLL, SAMPLE_SHAPES, _bench_model, _config, _on_first, _oversubscribed, _sub, _timed,
                      _train_epoch, train_samples)
from .hetero import _hetero, case_hetero, format_hetero, ideal_epoch_time
from .overhead import _overhead, case_overhead, format_overhead
from .overlap import CHUNK, OVERLAP_BUDGET, _lean_steps, _overlap, case_overlap, format_overlap
from .plain import _plain_epoch
from .report import _flag, _med, _reps, _write_arrays, check, format_table, write_report
from .scaling import _scaling_run, case_scaling, format_scaling
from .tracking import _steady_checks, _steps, _tracking, _tracking_checks, case_tracking, format_tracking
from .wait import _wait, case_wait, format_wait
