"""The `dbs-mpi` command: train, info, bench, data. The only place that picks COMM_WORLD.

    mpirun -n 4 dbs-mpi train --config jobs/main.toml --speeds 1,0.5,0.25,0.25
    dbs-mpi train --dataset synthetic --epochs 1          # one rank, no mpirun needed
    mpirun -n 2 dbs-mpi info
    mpirun -n 2 dbs-mpi bench hetero
    dbs-mpi data fetch cifar10                            # download and verify; no MPI

A user's mistake (bad option, missing file, unwritable output) gives one line
`dbs-mpi: error: <field>: <what is wrong>` from one rank and exit status 2 on every
rank; an unexpected exception on any rank aborts the whole job (status 1).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from ..about import __version__
from ..options import UserError
from ..planning import schedule
from . import config as config_mod
from .config import ArgumentParser


def _train_parser(prog="dbs-mpi train") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Train on all MPI ranks; every option may also be given "
                                       "in the --config TOML file (same name, underscores).", allow_abbrev=False)
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (command-line options override it)")
    p.add_argument("--resume", metavar="RESULT.h5", help="continue the stopped run whose result file this is, "
                   "from its checkpoint (RESULT.h5.ckpt), with its configuration; options given here "
                   f"may change only: {', '.join(RESUME_MAY_CHANGE)}")
    for name, default, comment in config_mod.describe():
        flag = "--" + name.replace("_", "-")
        meta = "A,B,..." if isinstance(default, tuple) else "true|false" if isinstance(default, bool) else name.upper()
        # default=None: only the options given override the --config file (one default shown)
        # a boolean flag alone means true (--sync-bn), or takes its value (--progress false)
        boolean = dict(nargs="?", const="true") if isinstance(default, bool) else {}
        p.add_argument(flag, metavar=meta, default=None, **boolean,
                       help=f"{comment} (default: {format_default(default)})".replace("%", "%%"))
    return p


def format_default(value) -> str:
    """A configuration default as one writes it on the command line."""
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


# Fields a resumed run may set differently from the checkpoint's configuration.
RESUME_MAY_CHANGE = ("epochs", "data_dir", "comm_timeout", "startup_timeout", "wait_policy", "threads", "progress",
                     "checkpoint_every", "out", "checkpoint", "loader_workers", "device", "devices", "exchange",
                     "speeds", "couple")


def parse_train_args(argv) -> config_mod.Config:
    args = vars(_train_parser().parse_args(argv))
    if args.pop("resume"):
        raise UserError("--resume: use load_train_config, which reads the checkpoint")
    config_file = args.pop("config")
    return config_mod.load(config_file, args)


def nothing_left(cfg, state) -> bool:
    """A resumed run whose checkpoint is already at its last epoch."""
    return state is not None and state["epoch"] >= cfg.epochs and not state.get("step")


def load_train_config(argv, rank: int):
    """(config, checkpoint state or None, result path or None). With --resume, rank 0
    reads the checkpoint (the caller broadcasts it); the configuration is the
    checkpoint's, and options given may change only RESUME_MAY_CHANGE."""
    args = vars(_train_parser().parse_args(argv))
    resume, config_file = args.pop("resume"), args.pop("config")
    if not resume:
        return config_mod.load(config_file, args), None, None
    from ..training import checkpoint
    from ..training.results import checkpoint_path
    given = config_mod.load_toml(config_file) if config_file else {}
    given.update({k: v for k, v in args.items() if v is not None})
    ckpt_path = given.get("checkpoint") or str(checkpoint_path(resume))
    if rank != 0:
        return None, None, resume
    _check_resumed_file(resume, args.get("out"))                  # (the command line's: a config file's is the run's)
    state = checkpoint.load(ckpt_path)
    stored = config_mod.stored({**config_mod.LEGACY, **state["config"]})   # (what older versions recorded and did)
    base = config_mod.from_dict(stored)
    cfg = config_mod.from_dict({**stored, **given})
    for name in config_mod.FIELDS:
        if name not in RESUME_MAY_CHANGE and getattr(cfg, name) != getattr(base, name):
            raise UserError(f"{name}: {getattr(cfg, name)!r} differs from the checkpoint's "
                            f"{getattr(base, name)!r}; a resumed run keeps its configuration")
    if cfg.epochs < state["epoch"]:
        raise UserError(f"epochs: {cfg.epochs} is fewer than the {state['epoch']} epochs already done")
    problem = schedule.check_length(cfg.lr_schedule, cfg.warmup_epochs, base.epochs, cfg.epochs)
    if problem:
        raise UserError(problem)
    return cfg, state, resume


def _check_resumed_file(resume: str, out) -> None:
    """A resumed run continues in its result file: it must exist (else a new file would
    hold the epochs after the checkpoint only, marked complete), and --out, if given,
    must name it (the job scripts pass both)."""
    if not Path(resume).is_file():
        raise UserError(f"resume: no result file {resume}; --resume names the stopped run's result file (its "
                        f"checkpoint is {resume}.ckpt unless --checkpoint says otherwise)")
    if out and Path(out).resolve() != Path(resume).resolve():
        raise UserError(f"out: a resumed run continues in its result file {resume}, not {out}; to keep the "
                        f"original, copy it (and its checkpoint) and resume the copy")


def collect_from_here() -> None:
    """The start-up's imports are over: the cyclic garbage collector, off since main()
    began, starts again, and leaves out of its passes every object that exists now
    (gc.freeze). Those are torch's modules and the like, about 260,000 objects
    that live as long as the process; each full pass walked them all. With the collector
    running as usual, a 1-rank run of 8 steps took 2.0 CPU-s, 1.4 without these passes
    (docs/api.md, "Start-up")."""
    gc.freeze()
    gc.enable()


def start_torch(comm) -> None:
    """init's last step, once the input is known to be good: import torch, and give this
    rank its share of the node's cores as torch threads."""
    from ..mpi import host_memory, startup
    from ..mpi.placement import set_torch_threads, threads_per_rank
    host_memory.keep()                       # before torch allocates: steps keep their memory
    startup.phase("torch", backstop=True)
    set_torch_threads(threads_per_rank(comm, timeout=startup.limit()))


def check_before_torch(argv, world_size: int, rank: int = 0) -> None:
    """The checks of a new run's command line that need no torch (the configuration, the
    number of ranks, an existing --out or checkpoint, and on rank 0, which writes them,
    their directories): bad input answered in a fraction of a second. A resumed run's
    configuration is the checkpoint's, checked once it is read."""
    from ..training.results import check_new_checkpoint, check_new_file, check_writable, checkpoint_path
    args = vars(_train_parser().parse_args(argv))
    if args.pop("resume"):
        return
    cfg = config_mod.load(args.pop("config"), args)
    config_mod.check_world(cfg, world_size)
    if cfg.out:
        check_new_file(cfg.out)
    if cfg.out and rank == 0:                # (rank 0 writes both: another node's disk may be another disk)
        check_writable(cfg.out, "out")
    if cfg.checkpoint or cfg.out:
        check_new_checkpoint(cfg.checkpoint or checkpoint_path(cfg.out), cfg.out, writable=rank == 0)


def cmd_train(comm, argv) -> int:
    from ..mpi import startup
    from ..mpi.agreement import agree
    from ..mpi.collectives import bcast_object

    startup.keep_stop_requests()             # a warning before the time limit during the start-up is kept
    startup.phase("config", backstop=True)
    limit = startup.limit()                  # before the configuration is known: the command line's
    agree(comm, check_before_torch, argv, comm.Get_size(), comm.Get_rank(), timeout=limit)
    start_torch(comm)
    from .train import format_summary, train
    collect_from_here()

    startup.phase("config", backstop=True)
    cfg, state, resume = agree(comm, load_train_config, argv, comm.Get_rank(), timeout=limit)
    if resume:
        cfg, state = bcast_object(comm, (cfg, state), timeout=limit, what="broadcasting the checkpoint")
        agree(comm, _check_world_size, state, comm.Get_size(), timeout=limit)
        if nothing_left(cfg, state):
            startup.done()
            if comm.Get_rank() == 0:
                print(f"dbs-mpi: nothing to do: {resume} has all its {cfg.epochs} epochs; to train longer, resume "
                      f"with --epochs N (N > {cfg.epochs})", flush=True)
            return 0
    startup.set_limits(cfg.startup_timeout, cfg.comm_timeout)
    summary = train(comm, cfg, out=resume, checkpoint_state=state)
    if comm.Get_rank() == 0:
        print(format_summary(summary, cfg, comm.Get_size()), flush=True)
    return 0


def _check_world_size(state, world_size):
    """Any number of ranks, except into or out of rounds (hardsync), whose updates take
    every worker's gradient: the position in the data would not be a round's."""
    from ..parameter_server.groups import in_rounds
    cfg = state["config"]
    before, now = (in_rounds(cfg["strategy"], cfg.get("softsync_wait"), cfg.get("softsync_n", 1), world - 1)
                   for world in (state["world_size"], world_size))
    if before != now:
        was, would = state["world_size"] - 1, world_size - 1
        change = (f"updates in rounds of all its {was} worker(s) (hardsync), which {would} worker(s) would not"
                  if before else f"on {was} worker(s) would update in rounds (hardsync) on {would}")
        raise UserError(f"resume: this nsoftsync run {change}; resume it with mpirun -n {state['world_size']}")


def cmd_info(comm, argv) -> int:
    import os
    import platform
    import socket

    import mpi4py
    import torch
    from mpi4py import MPI

    from ..mpi import devices
    from ..mpi.agreement import agree
    from ..mpi.collectives import allgather_object
    from ..mpi.placement import available_cores, mpi_library, placement, thread_limit
    from ..training.results import versions

    parser = ArgumentParser(prog="dbs-mpi info", description="Print the MPI, PyTorch and device environment of every rank: "
                     "the device each rank would train on with the same --device/--devices.")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    parser.add_argument("--devices", default="", metavar="A,B,...", help="per-rank devices (overrides --device)")
    args = agree(comm, parser.parse_args, argv)
    per_rank = [d for d in args.devices.replace(" ", "").split(",") if d]
    device = devices.select(comm, args.device, per_rank or None)
    described = devices.all_devices(comm, device)
    places = placement(comm)
    threads = devices.cpu_threads(places, [d["device"] for d in described], comm.Get_rank(), thread_limit())
    aware = devices.mpi_cuda_aware()
    rows = allgather_object(comm, (comm.Get_rank(), socket.gethostname(), os.getpid(), available_cores(),
                                   threads, devices.cuda_versions(), aware))
    if comm.Get_rank() == 0:
        v = versions(mpi_library())
        print(f"MPI library:   {v['mpi_library']}")
        print(f"MPI standard:  {'.'.join(map(str, MPI.Get_version()))}   mpi4py {mpi4py.__version__}")
        print(f"CUDA-aware MPI: {_cuda_aware_text(aware)}")
        cuda = rows[0][5]
        print(f"CUDA {cuda['cuda'] or 'none (CPU-only torch build)'}, cuDNN {cuda['cudnn'] or 'none'}, NCCL "
              f"{'yes' if torch.distributed.is_available() and torch.distributed.is_nccl_available() else 'no'}")
        print(f"ranks:         {comm.Get_size()}")
        print(f"python {v['python']}, torch {v['torch']} ({torch.__config__.parallel_info().splitlines()[0]}), "
              f"numpy {v['numpy']}, h5py {v['h5py']}, dbs_mpi {v['dbs_mpi']}, {platform.machine()}")
        print(f"{'rank':>4}  {'host':<16} {'pid':>8} {'cores':>5} {'threads':>7}  {'device':<7} {'GPUs':>4} "
              f"{'memory':>10}  name")
        for (r, host, pid, cores, t, cuda, _), d in zip(rows, described):
            print(f"{r:>4}  {host:<16} {pid:>8} {cores:>5} {t:>7}  {d['device']:<7} {cuda['gpus']:>4} "
                  f"{d['memory_gib']:>6.1f} GiB  {d['name']}")
    return 0


def _cuda_aware_text(aware) -> str:
    if aware is None:
        return "unknown (the MPI library has no MPIX_Query_cuda_support)"
    return "yes" if aware else "no (MPIX_Query_cuda_support() = 0: GPU ranks stage gradients through host memory)"


def cmd_bench(comm, argv) -> int:
    from .bench import main as bench_main
    return bench_main(comm, argv)


def cmd_simulate(comm, argv) -> int:
    from .simulator import main as simulate_main
    return simulate_main(comm, argv)


def cmd_data(comm, argv) -> int:
    from .data import data_main
    return data_main(argv)


def cmd_close(comm, argv) -> int:
    from ..mpi.agreement import agree
    parser = ArgumentParser(
        prog="dbs-mpi close",
        description="After a launch that ended with every rank killed (a lost node, SIGKILL): mark its result "
                    "file, still `running`, `failed` (attribute `crashed`: when and how). A file in any other "
                    "state is left as it is; so is one still open by a live run. One process, without mpirun.")
    parser.add_argument("result", metavar="RESULT.h5")
    parser.add_argument("--exit-status", type=int, help="the launcher's exit status, recorded in `crashed`")
    args = agree(comm, parser.parse_args, argv)
    before, after = agree(comm, _close_alone, comm, args)
    print(f"dbs-mpi close: {args.result}: " + (f"{before} -> {after}" if after != before else f"{before}, left as it is"))
    return 0


def _close_alone(comm, args):
    from ..training.results import close_crashed
    if comm.Get_size() != 1:
        raise UserError(f"close: run it as one process, not on {comm.Get_size()} ranks")
    return close_crashed(args.result, args.exit_status)


def cmd_job(comm, argv) -> int:
    from .job import main as job_main
    if comm.Get_size() != 1:
        raise UserError(f"job: run it as one process, not on {comm.Get_size()} ranks")
    return job_main(argv)


COMMANDS = {"train": cmd_train, "info": cmd_info, "bench": cmd_bench, "data": cmd_data, "simulate": cmd_simulate,
            "close": cmd_close, "job": cmd_job}
# The commands that compute with torch, whose threads are shared out before they run (and
# whose import of torch the start-up watchdog bounds). train starts torch itself once its
# input is checked; simulate (but its machine calibration), data and close are planning
# and files, which answer at once without torch (a login node imports it slowly).
TORCH_COMMANDS = (("info",), ("bench",), ("simulate", "calibrate"))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"dbs-mpi {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = ("usage: dbs-mpi {train,info,bench,data,simulate,close,job} [options]   (dbs-mpi COMMAND --help for details; "
                 "dbs-mpi --version)")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"dbs-mpi: error: unknown command {argv[0]!r}; {usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0 if argv else 2

    gc.disable()                             # until the imports are over: collect_from_here()
    try:
        return run_command(argv[0], argv[1:])
    finally:
        gc.enable()                          # a command that ended before (main() may run in-process)


def run_command(name: str, argv) -> int:
    """Command `name` with its options `argv`, on COMM_WORLD, from the start of MPI on."""
    from ..mpi import startup
    startup.arm(argv)                        # bounds the launch: imports, MPI_Init, the first collectives
    startup.phase("mpi")
    from mpi4py import MPI
    startup.phase("imports")
    from ..mpi.agreement import AgreedError
    from ..mpi.comm import start
    from ..mpi.supervisor import write_stderr
    startup.phase("init", backstop=True)
    comm = start(MPI.COMM_WORLD, timeout=startup.limit())  # fail together; the watchdog
    if name != "train":                      # train checks its input first, and ends the start-up at its first step
        if any([name, *argv][:len(command)] == list(command) for command in TORCH_COMMANDS):
            start_torch(comm)
        startup.done()
        collect_from_here()
    try:
        return COMMANDS[name](comm, argv)
    except AgreedError as exc:  # a mistake every rank knows about: one line, every rank exits
        if exc.local:
            write_stderr(exc.report())
        return 2
    except SystemExit as exc:  # from agree(): every rank exits together, cleanly
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    raise SystemExit(main())
