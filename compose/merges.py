"""Parameter-space merge baselines: the same experts merged into one model instead of composed.

Task arithmetic `θ_b + Σ_i w_i (θ_i − θ_b)` is exact for LoRA with peft's `cat` combination (the sum of
the low-rank deltas); TIES and DARE use peft's SVD variants of the same delta sum. In the linear setting
(only the output layer differs, docs/method.md, when the rule is exact) task arithmetic equals the composition up to a per-position
constant; elsewhere the gap between the two is measurable (see `max_logprob_gap`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

# method -> peft add_weighted_adapter arguments
MERGE_METHODS: dict[str, dict] = {
    "task_arithmetic": {"combination_type": "cat"},
    "ties": {"combination_type": "ties_svd", "density": 0.5},
    "dare": {"combination_type": "dare_linear_svd", "density": 0.5},
}


def merge_adapters(model: PeftModel, adapter_names: Sequence[str], method: str = "task_arithmetic",
                   weights: Sequence[float] | None = None, density: float | None = None,
                   merged_name: str | None = None, seed: int = 0) -> str:
    """Add to `model` one adapter merging `adapter_names` by `method`; returns the merged adapter's name.

    Args:
        method: one of `MERGE_METHODS` (task_arithmetic, ties, dare).
        weights: per adapter (default 1, the composition's weights).
        density: fraction of delta entries kept by TIES/DARE (default 0.5).
        seed: DARE drops entries at random.
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"merge method {method!r} is not one of {', '.join(MERGE_METHODS)}")
    kwargs = dict(MERGE_METHODS[method])
    if density is not None and "density" in kwargs:
        kwargs["density"] = density
    if kwargs["combination_type"].endswith("_svd"):
        # keep the full rank of the summed deltas so the SVD itself loses nothing
        kwargs["svd_rank"] = sum(model.peft_config[n].r for n in adapter_names)
    name = merged_name or f"merged_{method}"
    weights = [1.0] * len(adapter_names) if weights is None else list(weights)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model.add_weighted_adapter(list(adapter_names), weights, name, **kwargs)
    return name


@contextmanager
def merged_adapter(model: PeftModel, adapter_names: Sequence[str], method: str = "task_arithmetic",
                   **kwargs) -> Iterator[str]:
    """`merge_adapters` for the length of a `with` block, which gets the merged adapter's name; afterwards the
    adapter active before is active again and the merge is deleted (in that order: peft warns when the active
    adapter is deleted)."""
    active = model.active_adapter
    name = merge_adapters(model, adapter_names, method, **kwargs)
    try:
        yield name
    finally:
        model.set_adapter(active)
        model.delete_adapter(name)


@torch.no_grad()
def task_arithmetic(background: PreTrainedModel, experts: Sequence[PreTrainedModel],
                    weights: Sequence[float] | None = None) -> PreTrainedModel:
    """A full model with parameters `θ_b + Σ_i w_i (θ_i − θ_b)` (experts are full models of the same shape)."""
    weights = [1.0] * len(experts) if weights is None else list(weights)
    merged = copy.deepcopy(background)
    bg = background.state_dict()
    states = [e.state_dict() for e in experts]
    new = {}
    for key, value in bg.items():
        if not torch.is_floating_point(value):
            new[key] = value
            continue
        delta = sum(w * (s[key].to(value.dtype) - value) for w, s in zip(weights, states, strict=True))
        new[key] = value + delta
    merged.load_state_dict(new)
    return merged


@torch.no_grad()
def max_logprob_gap(a_logprobs: Tensor, b_logprobs: Tensor, valid: Tensor | None = None) -> float:
    """Largest |log p_a − log p_b| over positions (`valid` [B, T]) and vocabulary, after renormalizing."""
    diff = (a_logprobs.float().log_softmax(-1) - b_logprobs.float().log_softmax(-1)).abs().amax(-1)
    return float(diff[valid].max() if valid is not None else diff.max())
