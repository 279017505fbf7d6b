"""The task loss and the off-mask regularizer of docs/method.md, the regularizer.

Conventions: logits ``[B, T, V]`` are already aligned with ``targets [B, T]`` (``logits[:, t]`` is
scored against ``targets[:, t]``); ``targets == -100`` marks a position that is not a target
(prompt, padding). ``mask [B, T]`` (bool) is the expert's own mask: the positions where it may
differ from the background. Off-mask positions are target positions outside the mask; the
``<eos>`` target lies outside every mask, so it is always off-mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from losses.background_cache import BackgroundTopK, topk_divergence
from losses.divergences import IGNORE_INDEX, divergence

REGIONS = ("off", "on")


def region_positions(targets: Tensor, mask: Tensor, region: str = "off") -> Tensor:
    """Boolean ``[B, T]``: target positions outside (``"off"``) or inside (``"on"``) ``mask``."""
    if region not in REGIONS:
        raise ValueError(f"unknown region {region!r}; allowed regions: {', '.join(REGIONS)}")
    if mask.shape != targets.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but targets has {tuple(targets.shape)}")
    is_target = targets != IGNORE_INDEX
    mask = mask.to(device=targets.device, dtype=torch.bool)
    return is_target & (mask if region == "on" else ~mask)


def task_nll(
    logits: Tensor, targets: Tensor, mask: Tensor | None = None, on_mask_only: bool = False
) -> Tensor:
    """Mean token negative log-likelihood over the target positions (``targets != -100``).

    Args:
        logits: ``[B, T, V]`` logits aligned with ``targets``.
        targets: ``[B, T]`` token ids, ``-100`` where a position is not scored.
        mask: ``[B, T]`` bool, the expert's mask; required when ``on_mask_only``.
        on_mask_only: score only target positions inside ``mask``.

    Returns:
        0-dim float32 tensor; ``0.0`` (still attached to ``logits``' graph) when no position is scored.
    """
    check_aligned(logits, targets)
    if on_mask_only:
        if mask is None:
            raise ValueError("task_nll(on_mask_only=True) needs a mask")
        keep = region_positions(targets, mask, "on")
    else:
        keep = targets != IGNORE_INDEX
    nll = F.cross_entropy(
        logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return nll.where(keep, 0.0).sum() / keep.sum().clamp_min(1)


def off_mask_divergence(
    expert_logits: Tensor,
    background_logits: Tensor | BackgroundTopK,
    targets: Tensor,
    mask: Tensor,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    row_weight: Tensor | None = None,
    position_weight: Tensor | None = None,
) -> Tensor:
    """The regularizer of docs/method.md, the regularizer: ``mean_{t ∉ M_i} D(p_i(·|t), p_b(·|t))``.

    The mean of :func:`losses.divergence` over the off-mask target positions (``targets != -100``
    and not in ``mask``; the ``<eos>`` target included); with ``position_weight``, each position's
    divergence counts that many times (the sum still divided by the number of positions).

    Args:
        expert_logits: ``[B, T, V]`` expert logits (gradients flow here).
        background_logits: ``[B, T, V]`` background logits or log-probs (treated as constant), or the
            background cached at the off-mask target positions only (`losses.background_cache.BackgroundTopK`,
            one entry per position of ``region_positions(targets, mask, "off")`` in row-major order): then
            the divergence is :func:`losses.background_cache.topk_divergence`.
        targets: ``[B, T]`` target ids aligned with the logits, ``-100`` where not a target.
        mask: ``[B, T]`` bool, the expert's mask.
        kind, beta, temperature: see :func:`losses.divergence`.
        row_weight: optional ``[B]`` 0/1: only rows with a nonzero weight are regularized.
        position_weight: optional ``[B, T]`` float, the weight of each position (e.g. more right after an
            interval closes: `data.tasks.text.after_close_positions`).

    Returns:
        0-dim float32 tensor; ``0.0`` (attached to the expert's graph) when there is no such position.
    """
    check_aligned(expert_logits, targets)
    keep = region_positions(targets, mask, "off")
    if row_weight is not None:
        if row_weight.shape != targets.shape[:1]:
            raise ValueError(
                f"row_weight has shape {tuple(row_weight.shape)}, expected [B] = [{targets.shape[0]}]"
            )
        rows = (row_weight.to(keep.device) != 0).unsqueeze(1)
        if isinstance(background_logits, BackgroundTopK):
            background_logits = background_logits[rows.expand_as(keep)[keep]]
        keep = keep & rows
    if isinstance(background_logits, BackgroundTopK):
        if len(background_logits) != int(keep.sum()):
            raise ValueError(f"the cached background holds {len(background_logits)} positions but the batch has "
                             f"{int(keep.sum())} off-mask target positions")
        per_position = topk_divergence(expert_logits[keep], background_logits, kind, beta=beta,
                                       temperature=temperature)
    else:
        per_position = divergence(
            expert_logits[keep], background_logits[keep], kind, beta=beta, temperature=temperature,
            written=targets[keep],
        )
    if position_weight is not None:
        if position_weight.shape != targets.shape:
            raise ValueError(f"position_weight has shape {tuple(position_weight.shape)} but targets has "
                             f"{tuple(targets.shape)}")
        per_position = per_position * position_weight.to(per_position)[keep]
    return per_position.sum() / keep.sum().clamp_min(1)


def check_aligned(logits: Tensor, targets: Tensor) -> None:
    """Raise ``ValueError`` unless ``logits`` is ``[B, T, V]`` aligned with ``targets [B, T]``."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] aligned with targets [B, T]; got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
