#!/usr/bin/env python
"""How long a job outlives the failure of one rank: the last rank raises in the middle
of training or is killed with SIGKILL; we time from that moment to the exit of
mpirun. Median of --repeats.
  sync   the ranks of a gradient allreduce loop (the others wait in the allreduce);
  async  a real `dbs-mpi train --strategy asgd` run: the last worker fails after its
         20th gradient (the server waits polling, the other workers compute or wait).

    .venv/bin/python scripts/failure-exit-time.py --ranks 2 4 --repeats 5 --kinds sync async
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

CRASH = textwrap.dedent("""
    import sys, time
    from mpi4py import MPI
    from dbs_mpi.mpi.comm import abort_on_uncaught
    from dbs_mpi.training.exchange import GradientExchange
    from dbs_mpi.tools.models import LeNet5
    import torch, torch.nn.functional as F
    comm = MPI.COMM_WORLD
    abort_on_uncaught(comm)
    model = LeNet5()
    exchange = GradientExchange(comm, model.parameters(), timeout=60)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    for step in range(100000):
        exchange.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if comm.Get_rank() == comm.Get_size() - 1 and step == 20:
            if sys.argv[1] == "kill":
                print(f"FAIL_AT {time.time():.6f}", flush=True)
                import os, signal; os.kill(os.getpid(), signal.SIGKILL)
            print(f"FAIL_AT {time.time():.6f}", flush=True)
            raise RuntimeError("injected failure")
        exchange.allreduce(1.0, 0.0)
""")


ASYNC_CRASH = textwrap.dedent("""
    import os, signal, sys, time
    from mpi4py import MPI
    from dbs_mpi.planning import heterogeneity
    from dbs_mpi.tools import cli
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == comm.Get_size() - 1:
        stretch, calls = heterogeneity.Emulator.stretch, [0]
        def failing_stretch(self, *args):
            calls[0] += 1
            if calls[0] == 20:
                print(f"FAIL_AT {time.time():.6f}", flush=True)
                if sys.argv[1] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure")
            stretch(self, *args)
        heterogeneity.Emulator.stretch = failing_stretch
    out = sys.argv[2]
    sys.exit(cli.main(["train", "--strategy", "asgd", "--dataset", "synthetic", "--synthetic-samples", "6000",
                       "--test-subset", "200", "--epochs", "50", "--global-batch", "60", "--out", out]))
""")


def once(mpirun, ranks, mode, script):
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run([mpirun, "-n", str(ranks), sys.executable, script, mode, f"{folder}/run.h5"],
                              capture_output=True, text=True, timeout=120)
        end = time.time()
    fail_at = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAIL_AT")))
    return end - fail_at, proc.returncode


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpirun"))
    p.add_argument("--kinds", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    args = p.parse_args()
    scripts = {}
    for kind, text in (("sync", CRASH), ("async", ASYNC_CRASH)):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(text)
        scripts[kind] = f.name
    print(f"{'kind':<5} {'ranks':>5} {'failure':<10} {'exit after failure, s (median)':>31}  all repeats   exit codes")
    for kind in args.kinds:
        for ranks in args.ranks:
            for mode in ("exception", "kill"):
                runs = [once(args.mpirun, ranks, mode, scripts[kind]) for _ in range(args.repeats)]
                times = [t for t, _ in runs]
                print(f"{kind:<5} {ranks:>5} {mode:<10} {statistics.median(times):>31.3f}  "
                      f"{' '.join(f'{t:.3f}' for t in times)}   {sorted({c for _, c in runs})}", flush=True)
    for name in scripts.values():
        os.unlink(name)


if __name__ == "__main__":
    main()
