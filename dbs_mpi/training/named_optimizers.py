"""The command line's optimizers, by name: torch's SGD, Adam and AdamW without the
wrappers that import torch._dynamo.

torch.optim's methods carry wrappers that keep a compiler from tracing into them, and
these import torch._dynamo when first called (Optimizer.__init__ already calls one):
about 1.3 s of CPU and 820 more modules on every rank (40% of a short run's CPU), for a
compiler that dbs-mpi never calls. The command line's optimizers are torch's own classes
with those wrappers taken off: the same code updates the parameters, so every step is
torch's to the bit (tests/test_optimizer.py). A user's own optimizer is left as it is.
"""
from __future__ import annotations

import torch

def _dynamo_wrapper_codes() -> frozenset:
    """The code objects of torch.optim's wrappers that import torch._dynamo (and of the
    profiling hook that Optimizer.__init__ puts around a class's step, which a subclass gets
    anew); empty where this torch has other names, which leaves the methods as they are."""
    try:
        from torch._compile import _disable_dynamo
        from torch.optim.optimizer import _use_grad_for_differentiable
        probes = (_disable_dynamo(lambda: None), _use_grad_for_differentiable(lambda: None),
                  torch.optim.Optimizer.profile_hook_step(lambda: None))
    except (ImportError, AttributeError, TypeError):
        return frozenset()
    return frozenset(probe.__code__ for probe in probes)


_WRAPPERS = _dynamo_wrapper_codes()


def _unwrapped(fn):
    while getattr(fn, "__wrapped__", None) is not None and getattr(fn, "__code__", None) in _WRAPPERS:
        fn = fn.__wrapped__
    return fn


def without_dynamo(cls: type) -> type:
    """A subclass of the torch.optim class `cls` whose methods run torch's code without
    the wrappers that import torch._dynamo. step() keeps what its wrapper does outside a
    compiler: gradients off (unless the optimizer is `differentiable`)."""
    methods = {}
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        bare = _unwrapped(getattr(cls, name))
        if bare is not getattr(cls, name):
            methods[name] = bare
    bare_step = _unwrapped(cls.step)
    if bare_step is not cls.step:
        def step(self, *args, **kwargs):
            with torch.set_grad_enabled(self.defaults["differentiable"]):
                return bare_step(self, *args, **kwargs)
        step.__doc__ = bare_step.__doc__
        methods["step"] = step
    doc = f"torch.optim.{cls.__name__}, without the wrappers that import torch._dynamo (named_optimizers.py)."
    return type(cls.__name__, (cls,), {"__module__": __name__, "__qualname__": cls.__name__, "__doc__": doc,
                                       **methods})


SGD = without_dynamo(torch.optim.SGD)
Adam = without_dynamo(torch.optim.Adam)
AdamW = without_dynamo(torch.optim.AdamW)


def make_optimizer(name: str, params, cfg) -> torch.optim.Optimizer:
    """The command line's optimizers: sgd (lr, momentum, weight_decay), adam and adamw
    (lr, weight_decay; torch's default betas and eps), each fused where torch has it."""
    if name == "sgd":
        return fused(SGD, params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "adam":
        return fused(Adam, params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if name == "adamw":
        return fused(AdamW, params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer: must be sgd, adam or adamw; got {name!r}")


def fused(cls: type, params, **options) -> torch.optim.Optimizer:
    """cls(params, fused=True, **options): torch's one-kernel update, where this torch (2.4
    and later: CUDA and the CPU) has it for the class; else cls as torch defaults it (per
    tensor on a CPU, foreach on a GPU). On one CPU rank the update took a third of the
    time (scripts/optimizer-update.py): LeNet-5's SGD step 33.7 us against 94.5, ResNet-20's
    220 against 591, its AdamW's 427 against 1,604. Not where a parameter is in another
    memory order (channels-last: in_default_order). Which update runs is this rank's, not a
    loaded state's (_OwnUpdate): a rank without the fused kernel can load a fused rank's
    state (a resume on other hardware, a rank catching up)."""
    params, optimizer = list(params), None
    if HAS_FUSED and in_default_order(params):
        try:
            optimizer = cls(params, fused=True, **options)
        except (TypeError, RuntimeError):     # (no fused kernel for this class in this torch)
            optimizer = None
    optimizer = optimizer or cls(params, **options)
    if hasattr(optimizer, "register_load_state_dict_pre_hook"):
        optimizer.register_load_state_dict_pre_hook(_OwnUpdate())
    return optimizer


FUSED_FROM = (2, 4)       # the first torch with fused SGD, Adam and AdamW on the CPU as on CUDA
HAS_FUSED = torch.__version__ >= FUSED_FROM      # (torch's TorchVersion compares with a tuple)


def in_default_order(params) -> bool:
    """Every parameter (tensors, or param groups of them) in the default memory order: only
    then may a fused update run beside this package's gradients. torch's fused kernel pairs
    a parameter's elements with its gradient's by memory position, and the gradients are
    views of the exchange's flat buffer, in the default order: a channels-last weight was
    updated wrongly (SGD, torch 2.13 on the CPU: errors of 1.7 after two steps, where the
    per-tensor and foreach updates were exact). DistributedOptimizer refuses a fused
    optimizer where this is false (optimizer._check_fused_order)."""
    return all(in_default_order(p["params"]) if isinstance(p, dict) else p.is_contiguous() for p in params)


class _OwnUpdate:
    """A load_state_dict pre-hook: the loaded groups keep this optimizer's implementation
    (fused, foreach), so that the state is placed for it (a fused update keeps its step
    counts on the device) and its steps run the kernels this rank has."""

    KEYS = ("fused", "foreach")

    def __call__(self, optimizer, state_dict):
        own = [{key: group[key] for key in self.KEYS if key in group} for group in optimizer.param_groups]
        groups = [{**saved, **own[i]} if i < len(own) else saved for i, saved in enumerate(state_dict["param_groups"])]
        return {**state_dict, "param_groups": groups}
