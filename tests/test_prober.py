"""training/prober.py without MPI: the sizes a rank that sits out probes itself at, and
what a probe's result does to the next one (the MPI tests run it in whole jobs)."""
from types import SimpleNamespace

import torch

from dbs_mpi.planning import dynamic
from dbs_mpi.training.prober import Prober


def prober(samples: int = 128) -> Prober:
    """A prober of a tiny model for rank 1 of 2 at B = 512 (small 2, large 128); its own
    time is not stretched."""
    balancer = SimpleNamespace(world_size=2, rank=1, min_local=1, global_batch=512, max_local=None,
                               stretch=lambda wall, cpu: 0.0)
    p = Prober(torch.nn.Linear(4, 2), balancer, "cpu", timeout=10.0)
    p.inputs, p.samples = ((torch.randn(samples, 4),), {}), samples
    return p


def test_a_rank_that_sped_up_probes_its_slope_once_at_the_size_its_small_probe_says_fits():
    """After a small probe twice as fast as the one before, the next is large, cut to what
    the small one says takes at most LARGE_WITHIN steps (dynamic.own_probe_size); after it,
    small ones again, and a large one every LARGE_EVERY-th."""
    p = prober()
    p.last_small, p.step_time = 1.0, 0.047
    p._probe(p.inputs, p.samples, 2)               # far faster than 1 s: it sped up
    assert p.sped_up and p.last_small < 0.5
    p.last_small = 4.1e-3                           # (2 samples of LeNet-5 on this VM)
    assert p._next_size() == 64 and p.since_large == 0
    p._probe(p.inputs, p.samples, 64)
    assert not p.sped_up and p.last_small == 4.1e-3 and p.result[0] == 64
    assert [p._next_size() for _ in range(dynamic.LARGE_EVERY)] == [2] * (dynamic.LARGE_EVERY - 1) + [64]
    p.samples = 12                                  # the rank kept fewer samples than `large`: all of them
    p.since_large = dynamic.LARGE_EVERY
    assert p._next_size() == 12
    p.stop()


def test_a_rank_taken_back_forgets_its_last_small_probe_and_an_epochs_end_does_not():
    """A rank taken back and out again may run at another speed: its first probe then is
    small, whatever the last spell measured. Within a spell, and across the end of an
    epoch (no step planned: None), the last small probe is kept, so that a slow-down
    ending with the epoch is found by the probes on either side of it."""
    p = prober()
    p.failed = RuntimeError("no thread in this test")      # (between_steps starts none)
    p.warned = True
    p.last_small, p.sped_up = 4e-3, True
    for local in (0, None, 0):                     # out, the epoch's end, out in the next epoch
        p.between_steps(local)
        assert p.last_small == 4e-3 and p.sped_up, local
    p.between_steps(5)                              # taken back
    p.between_steps(0)                              # out again
    assert p.last_small is None and not p.sped_up
    p.step_time, p.since_large = 0.047, dynamic.LARGE_EVERY
    assert p._next_size() == 2


def test_a_probe_computes_as_training_does_under_autocast_and_in_channels_last_order():
    """The probe's thread does not inherit autocast: it runs under the dtype training's
    forwards ran in (remember(), called from the training forward), else the
    calibration's (balancer.sample_autocast); the calibration's inputs take the model's
    memory order (channels-last with --channels-last), as training's do."""
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    conv(torch.randn(1, 3, 8, 8))
    conv = conv.to(memory_format=torch.channels_last)
    seen = []
    balancer = SimpleNamespace(world_size=2, rank=1, min_local=1, global_batch=512, max_local=None,
                               stretch=lambda wall, cpu: 0.0, sample_inputs=torch.randn(16, 3, 8, 8),
                               sample_autocast=torch.bfloat16)
    p = Prober(conv, balancer, "cpu", timeout=10.0)
    args, kwargs = p._inputs()
    assert args[0].is_contiguous(memory_format=torch.channels_last) and not args[0].is_contiguous()
    p._probe(p.inputs, p.samples, 2)
    p.copy.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    p._probe(p.inputs, p.samples, 2)
    assert seen == [torch.bfloat16] * 2, seen             # (a warm-up pass, then the timed one)
    p.remember((torch.randn(16, 3, 8, 8),), {}, 16)         # a training forward without autocast
    p._probe(p.inputs, p.samples, 2)
    assert seen[-1] == torch.float32 and p.failed is None
    p.stop()
