"""The network: alpha-beta, per gradient bucket (the DDP layout of exchange.bucket_layout):
ring 2 (p-1) alpha + 2 (p-1)/p m beta, tree (binomial reduce, then broadcast)
2 ceil(log2 p) (alpha + m beta), "auto" the cheaper; a sleeping wait adds a constant; a
parameter server's message costs alpha + m beta.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Named networks (alpha: seconds per message, beta: seconds per byte).
NETWORKS = {"ib-100g": (2e-6, 1 / 12.5e9),      # InfiniBand HDR 100 Gb/s
            "eth-25g": (15e-6, 1 / 3.125e9),     # 25 Gb/s Ethernet
            "eth-10g": (25e-6, 1 / 1.25e9)}      # 10 Gb/s Ethernet


@dataclass
class Network:
    alpha: float                     # seconds per message
    beta: float                      # seconds per byte
    algorithm: str = "auto"          # ring | tree | auto (the cheaper, as MPI libraries choose)
    sleep_wait: float = 0.0          # seconds a sleeping wait adds to a collective
    crowded: float = 0.0             # seconds every message adds where ranks outnumber cores

    def allreduce(self, ranks: int, nbytes: float, alpha: float | None = None) -> float:
        if ranks <= 1:
            return 0.0
        alpha = self.alpha if alpha is None else alpha
        ring = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * self.beta
        tree = 2 * math.ceil(math.log2(ranks)) * (alpha + nbytes * self.beta)
        return {"ring": ring, "tree": tree}.get(self.algorithm, min(ring, tree))

    def exchange(self, ranks: int, buckets, sleeping: bool = False, crowded: bool = False) -> float:
        """One step's gradient exchange: the buckets one after the other (bytes each). Where
        a node runs more ranks than it has cores, every message waits for its peer to be
        scheduled: alpha grows by the machine's `crowded` cost."""
        if ranks <= 1:
            return 0.0
        alpha = self.alpha + (self.crowded if crowded else 0.0)
        return sum(self.allreduce(ranks, b, alpha) for b in buckets) + (self.sleep_wait if sleeping else 0.0)

    def message(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


def buckets(numel: int, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, extra: int = 0) -> list[float]:
    """Bytes of every gradient bucket of a model with `numel` parameters (DDP's caps; the
    loss slot and `extra` telemetry slots in the last): one bucket per cap-sized run of
    the flat buffer."""
    total, first, cap = 4.0 * (numel + 1 + extra), first_bucket_mb * 2 ** 20, bucket_mb * 2 ** 20
    if not cap or total <= (first or total):
        return [total]
    out, left = [first], total - first
    while left > cap:
        out.append(cap)
        left -= cap
    return out + [left] if left > 0 else out
