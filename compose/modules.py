"""Two facts about a torch module a forward relies on: eval mode for a block, and the arguments its forward takes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Put `module` in eval mode (peft needs it for per-row `adapter_names`) and restore every submodule's
    mode afterwards. Our adapters and models run without dropout, so gradients still flow unchanged."""
    modes = [(m, m.training) for m in module.modules()]
    # A big PeftModel has thousands of modules: skip eval()'s walk when they already are in eval mode (only the
    # root, e.g. a fresh wrapper, may not be), and restore only what changed.
    if any(training for _, training in modes[1:]):
        module.eval()
    else:
        module.training = False
    try:
        yield
    finally:
        for m, training in modes:
            if m.training != training:
                m.training = training


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes ``name`` (cached per class: ``inspect.signature`` costs ~40 µs a step)."""
    if "forward" in vars(model):  # an instance-level forward (e.g. accelerate's hooks): ask it directly
        return _takes(model.forward, name)
    return name in _forward_parameters(type(model))


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
