"""The MPI layer: the ranks, the machine and the wire; nothing here knows about training.

startup.py (the watchdog that bounds a launch), waits.py (bounded, non-spinning waits),
collectives.py (bounded collectives built on them), supervisor.py (failing together),
agreement.py (set-up steps that fail on every rank together), placement.py (hosts, cores,
threads), comm.py (init(): the communicator), devices.py (each rank's device and thread
share), process_group.py (torch.distributed over an MPI communicator) and transport.py
(how a bucket is summed: host-staged MPI, CUDA-aware MPI, NCCL, gloo).

Importing this package loads no MPI: each module does, when it is imported (startup.py
never does: it must run before MPI_Init).
"""
