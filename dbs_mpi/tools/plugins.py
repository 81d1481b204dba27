"""Plug-ins: the user's own model, dataset and loss on the command line.

A spec is MODULE:CALLABLE (MODULE importable from PYTHONPATH, CALLABLE a name in it,
dots allowed) or path/to/file.py:CALLABLE (the file's folder is put on sys.path and the
file imported as a module of its name, as `python path/to/file.py` would, so that a
DataLoader's worker processes can import it too). The built-in names (lenet5, mnist,
...) are not specs: a spec always has a colon.

Contracts (docs/api.md, "Plug-ins"):
  --model SPEC    a factory (a function, or an nn.Module class) called with those of the
                  keywords sample_shape (tuple: one input's shape) and num_classes (int)
                  that it names (all of them if it takes **kwargs); returns an nn.Module.
  --dataset SPEC  a factory called with the split, "train" or "test"; returns a map-style
                  dataset (__len__, __getitem__) whose items are (input tensor, int label).
                  The number of classes is --num-classes, else the dataset's num_classes
                  or len(classes) attribute.
  --loss SPEC     loss(output, target) -> the mean loss over the batch (a scalar tensor),
                  or a class (torch.nn:CrossEntropyLoss) instantiated without arguments.
                  It must be a mean: the sample weighting b_i/B assumes one (checked).
Every failure is a UserError naming the option and the spec: the CLI prints it as one
line on one rank and every rank exits with status 2.
"""
from __future__ import annotations

import importlib
import inspect
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..options import UserError
from . import models


def is_spec(text: str) -> bool:
    return ":" in text


def _import(module_part: str):
    """The module of a spec: a dotted name, or a path to a .py file."""
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {module_part}")
        loaded = sys.modules.get(path.stem)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise ImportError(f"a module named {path.stem!r} is already imported from elsewhere; rename the file")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        return importlib.import_module(path.stem)
    return importlib.import_module(module_part)


def load_callable(spec: str, option: str):
    """The callable that spec names; UserError '<option>: <spec>: <what is wrong>' otherwise."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise UserError(f"{option}: {spec!r} is not MODULE:CALLABLE or path/to/file.py:CALLABLE")
    try:
        obj = _import(module_part)
    except Exception as exc:  # the user's module may raise anything while importing
        raise UserError(f"{option}: {spec}: cannot import {module_part} ({type(exc).__name__}: {exc})") from None
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise UserError(f"{option}: {spec}: {module_part} has no attribute {attr!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise UserError(f"{option}: {spec}: {attr} is not callable (type {type(obj).__name__})")
    return obj


def _call(factory, spec: str, option: str, *args, **kwargs):
    try:
        return factory(*args, **kwargs)
    except Exception as exc:  # the user's code: report it as the option's failure
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise UserError(f"{option}: {spec}({shown}) failed ({type(exc).__name__}: {exc})") from None


def _offered(factory, offered: dict, spec: str) -> dict:
    """The keywords of `offered` that factory takes (all with **kwargs); UserError if it
    requires another argument."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):     # a builtin without a signature: call it bare
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    taken = {k: v for k, v in offered.items() if k in params}
    required = [name for name, p in params.items() if p.default is p.empty and name not in taken
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
    if required:
        raise UserError(f"model: {spec} requires {', '.join(required)}; a model factory may take only "
                        f"sample_shape and num_classes (by those names)")
    return taken


def build_model(spec: str, sample_shape, num_classes: int, norm: str = "group") -> nn.Module:
    """A built-in model by name, or the model of a plug-in factory."""
    if not is_spec(spec):
        try:
            return models.build_model(spec, sample_shape, num_classes, norm=norm)
        except ValueError as exc:
            raise UserError(f"model: {exc}") from None
    factory = load_callable(spec, "model")
    kwargs = _offered(factory, {"sample_shape": tuple(sample_shape), "num_classes": int(num_classes)}, spec)
    model = _call(factory, spec, "model", **kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: {spec} returned type {type(model).__name__}, not a torch.nn.Module")
    return model


def _is_label(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex()
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def load_dataset(spec: str, split: str):
    """The `split` ("train" or "test") of a plug-in dataset factory, checked."""
    dataset = _call(load_callable(spec, "dataset"), spec, "dataset", split)
    where = f"dataset: {spec}({split!r})"
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(f"{where} returned type {type(dataset).__name__}, not a map-style Dataset (with "
                        f"__len__ and __getitem__)")
    if len(dataset) == 0:
        raise UserError(f"{where} is empty")
    try:
        item = dataset[0]
    except Exception as exc:
        raise UserError(f"{where}[0] failed ({type(exc).__name__}: {exc})") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)
            and _is_label(item[1])):
        shown = type(item).__name__ if not isinstance(item, (tuple, list)) else \
            "(" + ", ".join(type(v).__name__ for v in item) + ")"
        raise UserError(f"{where}[0] is of type {shown}, not (input tensor, int label)")
    return dataset


def build_loss(spec: str):
    """The loss function: cross-entropy when spec is empty, else the plug-in's."""
    if not spec:
        return F.cross_entropy
    if not is_spec(spec):
        raise UserError(f"loss: {spec!r} is not MODULE:CALLABLE or path/to/file.py:CALLABLE (empty: cross-entropy)")
    obj = load_callable(spec, "loss")
    return _call(obj, spec, "loss") if isinstance(obj, type) else obj


def check_loss(loss_fn, model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: str) -> None:
    """The loss must be a scalar and the mean over the batch: on one sample and on that
    sample twice it must give the same value (a sum would double it)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            one = loss_fn(model(x[:1]), y[:1])
            two = loss_fn(model(torch.cat([x[:1], x[:1]])), torch.cat([y[:1], y[:1]]))
    except Exception as exc:
        raise UserError(f"loss: {spec or 'cross-entropy'} failed on the model's output ({type(exc).__name__}: "
                        f"{exc})") from None
    finally:
        model.train(was_training)
    if not (isinstance(one, torch.Tensor) and one.dim() == 0 and one.is_floating_point()):
        raise UserError(f"loss: {spec} returned {type(one).__name__} {getattr(one, 'shape', '')}, not a scalar "
                        f"tensor (use reduction='mean')")
    if not math.isclose(float(one), float(two), rel_tol=1e-4, abs_tol=1e-6):
        raise UserError(f"loss: {spec} is not the mean over the batch (one sample: {float(one):.6g}, the same "
                        f"sample twice: {float(two):.6g}); the sample-weighted gradient needs reduction='mean'")
