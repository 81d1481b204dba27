"""Loss scaling (fp16 mixed precision) with the sample-weighted exchange.

fp16's narrow range underflows small gradients, so torch.amp.GradScaler multiplies the
loss by a factor S before backward, divides the gradients by S before the update, and
skips a step whose gradients overflowed (inf/NaN), halving S; after enough clean steps
it doubles S. Under data parallelism every rank must take the same decision, or the
replicas part and the ranks' factors drift apart.

DistributedOptimizer therefore unscales and checks **after** the exchange: every rank
scales by the same S, so the sum the exchange computes is

    sum_i (b_i / B) (S g_i) = S g            (the sample-weighted gradient, times S)

and dividing by S gives g exactly (S is a power of two); and the reduced gradient is the
same on every rank, so every rank finds the same overflow: one rank's overflow reaches
every rank through the sum (inf or NaN), and all skip the step together. The scaler's
update() then sees the same finding on every rank, which keeps S equal everywhere.
"""
from __future__ import annotations

import torch


def skip_update(optimizer, scaler, exchange) -> bool:
    """After the exchange: True if the update is to be skipped (`scaler`, the GradScaler
    that called optimizer.step, found inf/NaN in `exchange`'s gradients; None: no scaler,
    never)."""
    if scaler is None:
        if getattr(optimizer, "found_inf", None) is not None:     # a GradScaler of another contract
            raise RuntimeError("DistributedOptimizer: GradScaler did not pass itself to step(); its inf/NaN check "
                               "would see this rank's gradient alone, which ranks disagree on")
        return False
    return unscale_after_exchange(scaler, optimizer, exchange.flat[:exchange.numel])


def unscale_after_exchange(scaler, optimizer, grads: torch.Tensor) -> bool:
    """The exchanged gradients (`grads`: all of them, one flat tensor) unscaled through
    `scaler` (unless the loop did it with scaler.unscale_(optimizer)) and checked for
    inf/NaN; True: found, so the update is to be skipped (on every rank alike).

    A loop that unscaled before the exchange (to clip its own gradient, say) had the
    scaler check its own gradient alone: the reduced gradient is checked again and the
    finding joins the scaler's, so that the ranks still agree. The decision is read on
    the host, as GradScaler's own step does."""
    from torch.amp.grad_scaler import OptState
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    else:
        found = (~torch.isfinite(grads)).any().float()
        for value in state["found_inf_per_device"].values():
            torch.maximum(value, found.to(value.device), out=value)
    return bool(sum(float(v.item()) for v in state["found_inf_per_device"].values()))
