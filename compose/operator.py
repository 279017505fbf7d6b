"""The composition rule of docs/method.md, the composition rule, as one pure tensor function."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def compose_logprobs(
    background: Tensor,
    experts: Tensor | Sequence[Tensor],
    weights: Sequence[float] | Tensor | None = None,
    masks: Tensor | None = None,
    min_logprob: float = -1e4,
) -> Tensor:
    """Compose a background with experts in probability space.

    ``log p̂ = log_softmax(lp_b + Σ_i w_i · m_i · (lp_i − lp_b))``

    Args:
        background: logits or log-probs ``[..., V]`` of the background model.
        experts: a sequence of ``k`` tensors shaped like ``background``, or one stacked ``[k, ..., V]``.
        weights: ``k`` floats (default: all 1, the paper's rule).
        masks: optional boolean ``[k, ...]`` (no vocabulary axis). Where False, that expert's
            factor ``p_i / p_b`` is 1 at that position (gated composition).
        min_logprob: floor on the log-probs, so a token given zero probability (``-inf``) yields a
            finite ratio instead of NaN (the authors' code clamps ``lp_b`` at −1e4). Experts are
            floored too, so a negative weight on a zero-probability token stays finite.

    Returns:
        Normalized float32 log-probs ``[..., V]``.
    """
    stacked = _stack_experts(background, experts)
    k, vocab = stacked.shape[0], background.shape[-1]
    lp_b = background.float().log_softmax(-1).clamp_min(min_logprob)
    if k == 0:
        return lp_b.log_softmax(-1)
    log_ratio = stacked.float().log_softmax(-1).clamp_min(min_logprob) - lp_b  # [k, ..., V]

    if weights is not None:
        w = torch.as_tensor(weights, dtype=torch.float32).flatten()
        if w.numel() != k:
            raise ValueError(f"weights has {w.numel()} entries but there are {k} experts")
        log_ratio = log_ratio * w.to(log_ratio.device).view(k, *([1] * (log_ratio.dim() - 1)))

    if masks is not None:
        if tuple(masks.shape) != tuple(stacked.shape[:-1]):
            raise ValueError(
                f"masks has shape {tuple(masks.shape)}, expected {tuple(stacked.shape[:-1])} "
                f"([k, ...] without the vocabulary axis of size {vocab})"
            )
        log_ratio = torch.where(masks.to(log_ratio.device, torch.bool).unsqueeze(-1), log_ratio, 0.0)
    return (lp_b + log_ratio.sum(0)).log_softmax(-1)


def _stack_experts(background: Tensor, experts: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(experts, Tensor):
        stacked = experts
        if stacked.dim() != background.dim() + 1:
            raise ValueError(
                f"stacked experts must be [k, ...] with one more axis than the background "
                f"{tuple(background.shape)}, got {tuple(stacked.shape)}"
            )
    else:
        experts = list(experts)
        for i, e in enumerate(experts):
            if e.shape[-1] != background.shape[-1]:
                raise ValueError(
                    f"expert {i} has vocabulary size {e.shape[-1]}, background has {background.shape[-1]}"
                )
        if not experts:
            return background.new_empty((0, *background.shape))
        stacked = torch.stack([e.to(background.device) for e in experts])
    if stacked.shape[-1] != background.shape[-1]:
        raise ValueError(
            f"experts have vocabulary size {stacked.shape[-1]}, background has {background.shape[-1]}"
        )
    if tuple(stacked.shape[1:]) != tuple(background.shape):
        raise ValueError(
            f"experts have shape {tuple(stacked.shape[1:])}, background has {tuple(background.shape)}"
        )
    return stacked
