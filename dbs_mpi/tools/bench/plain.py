"""The plain PyTorch training loop that the ddp and overhead cases measure the framework
against: the same model, shards, optimizer and device, no dbs-mpi.
"""
from __future__ import annotations

import time

from ...mpi import devices
from ...mpi.collectives import barrier
from ...planning import allocation, sharding
from ...training import device_data
from ...training.batches import host_to
from ...training.named_optimizers import make_optimizer
from ..models import build_model


def _plain_epoch(comm, cfg, train_set, wrap=None, warmup: int = 5) -> float:
    """Seconds of one epoch of a plain PyTorch loop over this rank's batches (the same
    shards as `train` with equal local batches, the data where `train` holds it:
    cfg.data_on_device); `wrap` turns the model into e.g. DDP."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)
    device = devices.select(comm, cfg.device, cfg.devices or None, threads=False)
    model = build_model(cfg.model, train_set.sample_shape, train_set.num_classes).to(device)
    if wrap is not None:
        model = wrap(model)
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg)     # (train's: fused where torch has it)
    vector = allocation.equal(cfg.global_batch, comm.Get_size())
    shard = sharding.epoch_shard(len(train_set), 0, cfg.seed, cfg.global_batch, vector, comm.Get_rank())

    data = train_set
    if device_data.decide(cfg.data_on_device, device, [train_set], comm.Get_size(), device_data.free_memory(device)):
        data = device_data.to_device(train_set, device)      # as `train` holds it: indexed on the device

    def step(idx):
        where = host_to(idx, data.x.device)
        x, y = devices.to_device((data.x[where], data.y[where]), device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        loss.item()                     # (on a GPU: waits for the step, as dbs-mpi's loop does)
        optimizer.step()

    for idx in shard[:warmup]:
        step(idx)
    barrier(comm)
    start = time.perf_counter()
    for idx in shard:
        step(idx)
    devices.synchronize(device)
    return time.perf_counter() - start
