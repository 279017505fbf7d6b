"""Teacher-forced metrics of a composed model on rows with targets and per-expert masks (any task).

The task decodes (exact match, skill accuracy); this module scores the *ideal* composed targets, i.e. the
prefixes the composition should produce: NLL, projectivity error, the composed margin on and off the masks,
each expert's off/on-mask KL, largest off-mask centered log-ratio and active-set precision/recall against its
mask, and pairwise active-set IoU. Shared by the validation callback and the final test stage.

Under a process group of W > 1 ranks (every rank calling it in step), rank `r` scores rows `r, r + W, ...` and the
metrics reduce across the ranks (torchmetrics; the largest log-ratio by an all-reduce): the same values as one
process scoring every row (`compose.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from compose.composed_lm import ComposedLM
from compose.distributed import all_reduce_max, rank_and_world
from compose.metrics import (
    ActiveSetOverlap,
    ActiveSetPrecisionRecall,
    MaskedDivergence,
    ProjectivityError,
    SequenceNLL,
    TargetMargin,
)
from compose.operator import compose_logprobs
from losses import IGNORE_INDEX


@torch.no_grad()
def teacher_forced_metrics(model: ComposedLM, rows, collate: Callable, batch_size: int = 250,
                           active_threshold: float = 0.01) -> dict[str, float]:
    """Metrics of `model` (background + experts, in `rows`' mask order) teacher-forced on `rows`.

    Args:
        model: the composed model; `model.names[i]` owns `masks[i]` of every row.
        rows: a `datasets.Dataset` (or list of dicts) with `input_ids`, `targets`, `masks` (k per row).
        collate: turns a list of rows into tensors (`data.collate.Collator`).

    Returns:
        `nll`, `projectivity_error`, `margin_{on,off}_mask_*`, and per expert `<name>/off_mask_kl`,
        `on_mask_kl`, `max_off_mask_log_ratio`, `active_precision`, `active_recall`; pairwise
        `overlap/<a>__<b>` (active-set IoU) when k > 1.
    """
    names, k, device = list(model.names), model.num_experts, model.device
    nll, proj = SequenceNLL().to(device), ProjectivityError().to(device)
    margins = {region: TargetMargin().to(device) for region in ("on_mask", "off_mask")}
    off = [MaskedDivergence(region="off").to(device) for _ in range(k)]
    on = [MaskedDivergence(region="on").to(device) for _ in range(k)]
    active = [ActiveSetPrecisionRecall(threshold=active_threshold).to(device) for _ in range(k)]
    overlap = ActiveSetOverlap(num_experts=k, threshold=active_threshold).to(device) if k > 1 else None
    max_ratio = torch.zeros(k)
    rank, world = rank_and_world()
    rows = [rows[i] for i in range(rank, len(rows), world)]  # every row in a single process
    for start in range(0, len(rows), batch_size):
        batch = {key: v.to(device) if isinstance(v, Tensor) else v
                 for key, v in collate(rows[start:start + batch_size]).items()}
        targets, masks = batch["targets"], batch["masks"]  # masks [B, k, T]
        lp_b, lp_e = model.component_logprobs(batch["input_ids"], batch["attention_mask"])
        composed = compose_logprobs(lp_b, lp_e, weights=model.weights, min_logprob=model.min_logprob)
        nll.update(composed, targets)
        proj.update(composed, lp_b, lp_e, targets, masks)
        in_a_mask = masks.any(1)
        margins["on_mask"].update(composed, targets, in_a_mask)
        margins["off_mask"].update(composed, targets, ~in_a_mask)
        if overlap is not None:
            overlap.update(lp_e, lp_b, targets)
        for i in range(k):
            args = (lp_e[i], lp_b, targets, masks[:, i])
            off[i].update(*args)
            on[i].update(*args)
            active[i].update(*args)
            max_ratio[i] = max(max_ratio[i], _max_off_mask_log_ratio(lp_e[i], lp_b, targets, masks[:, i]))
    max_ratio = all_reduce_max(max_ratio.to(device)).cpu()
    results = {"nll": float(nll.compute()), "projectivity_error": float(proj.compute())}
    for region, metric in margins.items():
        for key, value in metric.compute().items():
            results[f"margin_{region}_{key}"] = float(value)
    for i, name in enumerate(names):
        pr = active[i].compute()
        results |= {f"{name}/off_mask_kl": float(off[i].compute()), f"{name}/on_mask_kl": float(on[i].compute()),
                    f"{name}/max_off_mask_log_ratio": float(max_ratio[i]),
                    f"{name}/active_precision": float(pr["precision"]), f"{name}/active_recall": float(pr["recall"])}
    if overlap is not None:
        iou = overlap.compute()
        for a in range(k):
            for b in range(a + 1, k):
                results[f"overlap/{names[a]}__{names[b]}"] = float(iou[a, b])
    return results


def _max_off_mask_log_ratio(lp_e: Tensor, lp_b: Tensor, targets: Tensor, mask: Tensor) -> float:
    """Largest |lp_e − lp_b| (centered over the vocabulary) at target positions off `mask`."""
    ratio = lp_e - lp_b
    ratio = ratio - ratio.mean(-1, keepdim=True)
    off_pos = (targets != IGNORE_INDEX) & ~mask
    return ratio[off_pos].abs().max().item() if off_pos.any() else 0.0
