"""A worker of the parameter server (ranks 1..n-1): wait for work, compute the gradient
of the samples it names, push it, repeat until STOP (protocol.py has the messages)."""
from __future__ import annotations

import time

import numpy as np
import torch

from ..mpi.waits import wait
from ..mpi.devices import model_device, to_device
from ..planning import sharding
from ..training.batches import augment, fetch_batch
from .protocol import (
    CMD_STOP, G_COMPUTE, G_COUNT, G_LOSS, G_SIGNAL, G_VERSION, TAG_GRAD, TAG_WORK, W_COMMAND, W_COUNT, W_EPOCH, W_HELD,
    W_START, W_VERSION, Message, bind_gradients, bind_parameters)
from .records import C_COMM, C_COMPUTE, C_DATA, C_GRADIENTS, C_SAMPLES, C_WAIT, S_VECTOR


class Worker:
    """Ranks 1..n-1: wait for work, compute the gradient, push it, repeat until STOP."""

    separate_buffers = False    # True: a GPU worker's copies between messages and model on the CPU too (tests)

    def __init__(self, pcomm, cfg, model, train_set, emulator, stop=None, loss_fn=None):
        self.comm, self.cfg, self.model, self.train_set, self.emulator = pcomm, cfg, model, train_set, emulator
        self.loss_fn = loss_fn
        self.stop = stop
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.device = model_device(model)
        cuda = self.device.type == "cuda"
        self.weights = Message(self.numel, pinned=cuda)    # TAG_WORK lands here
        self.grad = Message(self.numel, pinned=cuda)       # pushed as it is
        # On the CPU the parameters and their gradients are views of the messages' bodies
        # (no copies); on a GPU they are views of device buffers that the bodies are
        # copied to (weights, after every receive) and from (gradients, before every push).
        if cuda or self.separate_buffers:
            self.device_weights = torch.zeros(self.numel, device=self.device)
            self.device_grad = torch.zeros(self.numel, device=self.device)
        else:
            self.device_weights, self.device_grad = self.weights.body, self.grad.body
        bind_parameters(params, self.device_weights)
        bind_gradients(params, self.device_grad)
        self.stats = np.zeros((cfg.epochs, S_VECTOR + pcomm.Get_size() - 1))
        self.steps_per_epoch = sharding.steps_per_epoch(len(train_set), cfg.global_batch, cfg.drop_last)
        self.max_messages = cfg.epochs * (len(train_set) + (pcomm.Get_size() - 1) * self.steps_per_epoch) + 1
        self.perm, self.perm_epoch, self.epoch = None, -1, 0

    def state_dict(self) -> dict:
        return {"stats": self.stats, "perm_epoch": self.perm_epoch, "epoch": self.epoch}

    def load_state(self, state: dict) -> None:
        stats = np.zeros_like(self.stats)            # cfg.epochs (and the workers) may have changed
        saved = np.asarray(state["stats"])
        columns = min(saved.shape[1], stats.shape[1])
        stats[:len(saved), :columns] = saved[:len(stats), :columns]
        self.stats, self.perm_epoch, self.epoch = stats, state["perm_epoch"], state["epoch"]
        if self.perm_epoch >= 0:
            self.perm = torch.from_numpy(sharding.epoch_permutation(len(self.train_set), self.perm_epoch,
                                                                    self.cfg.seed))

    def resume_emulator(self) -> None:
        """Resumed with another number of workers (the emulators start afresh): its step and
        time windows at this worker's gradients and training seconds so far (its stats), and
        the epoch it is in set up (slow_epochs, the random sleeps)."""
        self.emulator.resume_at(int(self.stats[:, C_GRADIENTS].sum()), float(self.stats[:, :C_SAMPLES].sum()))
        if self.perm_epoch >= 0:
            self.emulator.start_epoch(self.perm_epoch, self.steps_per_epoch)

    def run(self) -> None:
        """One segment: compute until the server says STOP (the end, or a checkpoint)."""
        perm, perm_epoch, epoch = self.perm, self.perm_epoch, self.epoch
        recv = self.comm.Irecv(self.weights.whole, 0, TAG_WORK)
        header = self.weights.header
        t_push, first = time.perf_counter(), True
        # Bounded: one pass per WORK message, and the server sends at most max_messages.
        for _ in range(self.max_messages):
            wait(recv, self.timeout, "waiting for the parameter server")
            exchange = time.perf_counter() - t_push
            held = exchange if first else min(float(header[W_HELD]), exchange)   # the start: all waiting
            first = False
            self.stats[epoch, C_WAIT] += held
            self.stats[epoch, C_COMM] += exchange - held
            if header[W_COMMAND] == CMD_STOP:
                self.perm, self.perm_epoch, self.epoch = perm, perm_epoch, epoch
                return
            version, epoch = header[W_VERSION], int(header[W_EPOCH])
            start, count = int(header[W_START]), int(header[W_COUNT])
            t0 = time.perf_counter()
            if epoch != perm_epoch:
                perm = torch.from_numpy(sharding.epoch_permutation(len(self.train_set), epoch, self.cfg.seed))
                perm_epoch = epoch
                # Disturbances follow the epoch of the samples; the per-step share of an
                # epoch's extra sleep assumes the synchronous step count (an approximation:
                # a fast asgd worker computes more gradients per epoch).
                self.emulator.start_epoch(epoch, self.steps_per_epoch)
            idx = perm[start:start + count]
            self.pull()
            if count:
                x, y = to_device(fetch_batch(self.train_set, idx), self.device)
                x = augment(x, idx.numpy(), epoch, self.cfg.seed) if self.cfg.augment else x
            t1, cpu = time.perf_counter(), time.process_time()
            self.device_grad.zero_()
            loss_value = 0.0
            if count:
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                loss_value = loss.item()       # on a GPU: waits for backward (a true compute time)
                self.emulator.stretch(time.perf_counter() - t1, time.process_time() - cpu)
            self.push_copy()
            t2 = time.perf_counter()
            h = self.grad.header
            h[:] = 0.0
            h[G_VERSION], h[G_COUNT], h[G_LOSS], h[G_COMPUTE] = version, count, loss_value, t2 - t1
            h[G_SIGNAL] = self.stop.requested if self.stop is not None else 0   # the server drains
            s = self.stats[epoch]
            s[C_DATA] += t1 - t0
            s[C_COMPUTE] += t2 - t1
            s[C_SAMPLES] += count
            s[C_GRADIENTS] += 1
            self.emulator.step_done(self.stats[:, :C_SAMPLES].sum())     # its run steps: gradients; its seconds
            # The weights are not needed any more: post the receive for the reply into
            # them, then push (the server answers every push with WORK or STOP).
            t_push = time.perf_counter()
            recv = self.comm.Irecv(self.weights.whole, 0, TAG_WORK)
            wait(self.comm.Isend(self.grad.whole, 0, TAG_GRAD), self.timeout, "pushing a gradient")
        raise RuntimeError(f"worker {self.comm.Get_rank()}: more than {self.max_messages} work messages")

    def pull(self) -> None:
        """The received weights into the model (a GPU worker's device copy; nothing on the CPU)."""
        if self.device_weights is not self.weights.body:
            self.device_weights.copy_(self.weights.body, non_blocking=True)

    def push_copy(self) -> None:
        """The computed gradient into the message that is pushed (a GPU worker's host copy)."""
        if self.device_grad is not self.grad.body:
            self.grad.body.copy_(self.device_grad)
