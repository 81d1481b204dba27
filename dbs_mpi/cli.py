"""The `dbs-mpi` command: train, info, bench. The only place that picks COMM_WORLD.

    mpirun -n 4 dbs-mpi train --config jobs/main.toml --speeds 1,0.5,0.25,0.25
    dbs-mpi train --dataset synthetic --epochs 1          # one rank, no mpirun needed
    mpirun -n 2 dbs-mpi info
    mpirun -n 2 dbs-mpi bench hetero

A user's mistake (bad option, missing file, unwritable output) gives one line
`dbs-mpi: error: <field>: <what is wrong>` from one rank and exit status 2 on every
rank; an unexpected exception on any rank aborts the whole job (status 1).
"""
from __future__ import annotations

import argparse
import sys

from . import config as config_mod
from .config import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block; raised so that ranks agree
        raise UserError(message)


def _train_parser(prog="dbs-mpi train") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Train on all MPI ranks; every option may also be given "
                                       "in the --config TOML file (same name, underscores).",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (command-line options override it)")
    for name, default, comment in config_mod.describe():
        flag = "--" + name.replace("_", "-")
        meta = name.upper()
        if isinstance(default, tuple):
            p.add_argument(flag, metavar="A,B,...", help=comment, default=None)
        elif isinstance(default, bool):
            p.add_argument(flag, metavar="true|false", help=comment, default=None)
        else:
            p.add_argument(flag, metavar=meta, help=f"{comment} (default: {default!r})", default=None)
    return p


def parse_train_args(argv) -> config_mod.Config:
    args = vars(_train_parser().parse_args(argv))
    config_file = args.pop("config")
    return config_mod.load(config_file, args)


def cmd_train(comm, argv) -> int:
    from . import comm as mpi
    from .results import STATUS_FAILED
    from .train import format_summary, train

    cfg = mpi.agree(comm, parse_train_args, argv)
    summary = train(comm, cfg)
    if comm.Get_rank() == 0:
        print(format_summary(summary, cfg, comm.Get_size()), flush=True)
    return 0


def cmd_info(comm, argv) -> int:
    import os
    import platform
    import socket

    import mpi4py
    import torch
    from mpi4py import MPI

    from . import comm as mpi
    from .results import versions

    _Parser(prog="dbs-mpi info", description="Print the MPI and PyTorch environment of every rank.").parse_args(argv)
    threads = mpi.available_cores() // mpi.local_size(comm) or 1
    rows = comm.gather((comm.Get_rank(), socket.gethostname(), os.getpid(), mpi.available_cores(), threads), root=0)
    if comm.Get_rank() == 0:
        v = versions(mpi.mpi_library())
        print(f"MPI library:   {v['mpi_library']}")
        print(f"MPI standard:  {'.'.join(map(str, MPI.Get_version()))}   mpi4py {mpi4py.__version__}")
        print(f"ranks:         {comm.Get_size()}")
        print(f"python {v['python']}, torch {v['torch']} ({torch.__config__.parallel_info().splitlines()[0]}), "
              f"numpy {v['numpy']}, h5py {v['h5py']}, dbs_mpi {v['dbs_mpi']}, {platform.machine()}")
        print(f"{'rank':>4}  {'host':<20} {'pid':>8} {'cores':>5} {'torch threads':>13}")
        for r, host, pid, cores, t in rows:
            print(f"{r:>4}  {host:<20} {pid:>8} {cores:>5} {t:>13}")
    return 0


def cmd_bench(comm, argv) -> int:
    from .bench import main as bench_main
    return bench_main(comm, argv)


COMMANDS = {"train": cmd_train, "info": cmd_info, "bench": cmd_bench}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "usage: dbs-mpi {train,info,bench} [options]   (dbs-mpi COMMAND --help for details)"
        if argv and argv[0] not in ("-h", "--help"):
            print(f"dbs-mpi: error: unknown command {argv[0]!r}; {usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0 if argv else 2

    from mpi4py import MPI

    from . import comm as mpi
    comm = MPI.COMM_WORLD
    mpi.abort_on_uncaught(comm)
    try:
        return COMMANDS[argv[0]](comm, argv[1:])
    except SystemExit as exc:  # from agree(): every rank exits together, cleanly
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    raise SystemExit(main())
