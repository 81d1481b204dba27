"""Planning: what every rank should do, computed from numbers alone. No MPI, no device.

allocation.py (batch-size vectors from measured speed), participation.py (which ranks
take part), coupling.py (ranks of one host that slow each other, seen by the
calibration), dynamic/ (the DBS controller and its step-time estimator), noise_scale.py
and goodput.py (the gradient noise scale, and the global batch it favours), sharding.py
(uneven shards with equal step counts, the sampler), heterogeneity.py (emulated speeds)
and schedule.py (learning-rate schedules over the run's steps). The training layer and
the simulator call the same functions, so a simulated run plans exactly as a real one.
"""
