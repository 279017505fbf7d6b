"""Metrics of factorizability, projectivity and composed accuracy, as torchmetrics ``Metric``s.

Every state is a count or a sum reduced with ``dist_reduce_fx="sum"`` (``TargetMargin``'s minimum with
``"min"``), so the metrics reduce correctly under DDP. Tensor conventions follow ``losses``: logits ``[B, T, V]`` aligned with
``targets [B, T]`` (``-100`` = not a target), masks ``[B, T]`` bool. Inputs are detached.

Empty denominators: ``MaskedDivergence``, ``ProjectivityError``, ``SequenceNLL``, ``ExactMatch``,
``SkillAccuracy`` and ``FailureTypes`` return ``0.0`` when nothing was counted;
``ActiveSetPrecisionRecall`` returns ``1.0`` (nothing was claimed / nothing was missed);
``ActiveSetOverlap`` returns IoU ``0.0`` for two empty active sets (``1.0`` on the diagonal).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from losses import IGNORE_INDEX, check_divergence_args, divergence, region_positions


def _ratio(num: Tensor, den: Tensor, empty: float) -> Tensor:
    num, den = num.float(), den.float()
    return torch.where(den > 0, num / den.clamp_min(1e-12), torch.full_like(num, empty))


def _check_shapes(logits: Tensor, other: Tensor, targets: Tensor, what: str = "background_logits") -> None:
    if logits.shape != other.shape:
        raise ValueError(f"expert_logits has shape {tuple(logits.shape)} but {what} has {tuple(other.shape)}")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] aligned with targets [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )


class MaskedDivergence(Metric):
    """Mean per-position divergence of an expert from the background, off or on its mask.

    ``update(expert_logits, background_logits, targets, mask)`` accumulates ``losses.divergence``
    over the target positions outside (``region="off"``) or inside (``region="on"``) ``mask``.
    ``compute()`` returns the mean over all positions seen (``0.0`` if none).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, region: str = "off", kind: str = "forward_kl", **kwargs) -> None:
        super().__init__(**kwargs)
        if region not in ("off", "on"):
            raise ValueError(f"unknown region {region!r}; allowed regions: off, on")
        check_divergence_args(kind)
        self.region, self.kind = region, kind
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, expert_logits: Tensor, background_logits: Tensor, targets: Tensor, mask: Tensor) -> None:
        _check_shapes(expert_logits, background_logits, targets)
        keep = region_positions(targets, mask, self.region)
        div = divergence(expert_logits.detach()[keep], background_logits[keep], self.kind)
        self.total += div.sum()
        self.count += keep.sum()

    def compute(self) -> Tensor:
        return _ratio(self.total, self.count, 0.0)


class ActiveSetPrecisionRecall(Metric):
    """How well an expert's active set matches its mask.

    A target position is *active* when ``divergence(expert, background) > threshold``.
    ``compute()`` returns ``{"precision": |active ∩ mask| / |active|, "recall": |active ∩ mask| / |mask|}``
    over target positions, with ``1.0`` when a denominator is 0 (an expert active nowhere claims
    nothing wrongly; an empty mask misses nothing).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, threshold: float = 0.01, kind: str = "forward_kl", **kwargs) -> None:
        super().__init__(**kwargs)
        check_divergence_args(kind)
        self.threshold, self.kind = threshold, kind
        for name in ("active_in_mask", "active", "in_mask"):
            self.add_state(name, default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, expert_logits: Tensor, background_logits: Tensor, targets: Tensor, mask: Tensor) -> None:
        _check_shapes(expert_logits, background_logits, targets)
        is_target = targets != IGNORE_INDEX
        in_mask = region_positions(targets, mask, "on")
        active = (
            divergence(expert_logits.detach(), background_logits, self.kind) > self.threshold
        ) & is_target
        self.active_in_mask += (active & in_mask).sum()
        self.active += active.sum()
        self.in_mask += in_mask.sum()

    def compute(self) -> dict[str, Tensor]:
        return {
            "precision": _ratio(self.active_in_mask, self.active, 1.0),
            "recall": _ratio(self.active_in_mask, self.in_mask, 1.0),
        }


class ActiveSetOverlap(Metric):
    """Pairwise intersection-over-union of the experts' active sets (docs/method.md, when the rule is exact, combined factorizability).

    ``update(experts_logits [k, B, T, V], background_logits [B, T, V], targets [B, T])``: expert
    ``i`` is active at a target position when its divergence from the background exceeds
    ``threshold``. ``compute()`` returns the ``[k, k]`` IoU matrix: 1 on the diagonal, 0 where
    both sets are empty. Composition is exact when every off-diagonal entry is 0.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, num_experts: int, threshold: float = 0.01, kind: str = "forward_kl", **kwargs) -> None:
        super().__init__(**kwargs)
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        check_divergence_args(kind)
        self.num_experts, self.threshold, self.kind = num_experts, threshold, kind
        k = num_experts
        self.add_state("intersection", default=torch.zeros(k, k, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("size", default=torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, experts_logits: Tensor, background_logits: Tensor, targets: Tensor) -> None:
        k = self.num_experts
        if experts_logits.dim() != 4 or experts_logits.shape[0] != k:
            raise ValueError(f"experts_logits must be [k={k}, B, T, V], got {tuple(experts_logits.shape)}")
        _check_shapes(experts_logits[0], background_logits, targets)
        is_target = targets != IGNORE_INDEX
        div = divergence(experts_logits.detach(), background_logits.expand_as(experts_logits), self.kind)
        active = ((div > self.threshold) & is_target).flatten(1)  # [k, B*T]
        self.intersection += (active.unsqueeze(1) & active.unsqueeze(0)).sum(-1)
        self.size += active.sum(-1)

    def compute(self) -> Tensor:
        union = self.size.unsqueeze(0) + self.size.unsqueeze(1) - self.intersection
        iou = _ratio(self.intersection, union, 0.0)
        return iou.fill_diagonal_(1.0)


class ExactMatch(Metric):
    """Fraction of generations equal to their reference.

    ``update(preds, refs, ended_with_eos=None)``: when ``ended_with_eos`` is given, a prediction
    that did not end with EOS counts as wrong even if its text matches.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(
        self, preds: Sequence[str], refs: Sequence[str], ended_with_eos: Sequence[bool] | None = None
    ) -> None:
        if len(preds) != len(refs):
            raise ValueError(f"preds has {len(preds)} items but refs has {len(refs)}")
        ended = [True] * len(preds) if ended_with_eos is None else list(ended_with_eos)
        if len(ended) != len(preds):
            raise ValueError(f"ended_with_eos has {len(ended)} items but preds has {len(preds)}")
        self.correct += sum(bool(e) and p == r for p, r, e in zip(preds, refs, ended, strict=True))
        self.total += len(preds)

    def compute(self) -> Tensor:
        return _ratio(self.correct, self.total, 0.0)


class SkillAccuracy(Metric):
    """Fraction of mask positions where the composed prediction equals the target.

    ``update(pred_ids [B, T], target_ids [B, T], mask [B, T])``: whether the composed output applied
    the expert's rule where it should. Positions whose target is ``-100`` are ignored.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, pred_ids: Tensor, target_ids: Tensor, mask: Tensor) -> None:
        if pred_ids.shape != target_ids.shape:
            raise ValueError(
                f"pred_ids has shape {tuple(pred_ids.shape)} but target_ids has {tuple(target_ids.shape)}"
            )
        keep = region_positions(target_ids, mask, "on")
        self.correct += ((pred_ids == target_ids) & keep).sum()
        self.total += keep.sum()

    def compute(self) -> Tensor:
        return _ratio(self.correct, self.total, 0.0)


class SequenceNLL(Metric):
    """Mean over sequences of the joint target NLL ``−Σ_t log p̂(target_t)`` (sum over target positions).

    ``update(composed_logprobs [B, T, V], targets [B, T])``. The input is renormalized with
    ``log_softmax`` (a no-op on normalized log-probs, so raw logits are accepted too). Rows without
    any target position are not counted.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("sequences", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, composed_logprobs: Tensor, targets: Tensor) -> None:
        if composed_logprobs.dim() != 3 or targets.shape != composed_logprobs.shape[:2]:
            raise ValueError(
                f"composed_logprobs must be [B, T, V] aligned with targets [B, T]; got "
                f"{tuple(composed_logprobs.shape)} and {tuple(targets.shape)}"
            )
        lp = composed_logprobs.detach().float().log_softmax(-1)
        is_target = targets != IGNORE_INDEX
        token_lp = lp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        self.total -= token_lp.where(is_target, 0.0).sum()
        self.sequences += is_target.any(-1).sum()

    def compute(self) -> Tensor:
        return _ratio(self.total, self.sequences, 0.0)


class ProjectivityError(Metric):
    """How far the composition is from projective (docs/method.md, when the rule is exact).

    At a target position held by expert ``i``'s mask the projective composition equals ``p_i``;
    outside all masks it equals ``p_b``. ``update(composed_logprobs [B, T, V],
    background_logprobs [B, T, V], experts_logprobs [k, B, T, V], targets [B, T], masks [B, k, T])``
    accumulates ``D(reference ‖ p̂)`` (``losses.divergence`` with the reference in the background
    slot: ``kind="forward_kl"`` is ``KL(p_i ‖ p̂)`` / ``KL(p_b ‖ p̂)``). A position held by several
    masks (overlapping masks) scores the mean over its holders. ``compute()`` is the mean over
    target positions.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, kind: str = "forward_kl", **kwargs) -> None:
        super().__init__(**kwargs)
        check_divergence_args(kind)
        self.kind = kind
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(
        self,
        composed_logprobs: Tensor,
        background_logprobs: Tensor,
        experts_logprobs: Tensor,
        targets: Tensor,
        masks: Tensor,
    ) -> None:
        _check_shapes(composed_logprobs, background_logprobs, targets)
        k = experts_logprobs.shape[0]
        if experts_logprobs.shape[1:] != composed_logprobs.shape:
            raise ValueError(
                f"experts_logprobs must be [k, B, T, V] = [k, {', '.join(map(str, composed_logprobs.shape))}], "
                f"got {tuple(experts_logprobs.shape)}"
            )
        batch, steps = targets.shape
        if masks.shape != (batch, k, steps):
            raise ValueError(f"masks must be [B, k, T] = [{batch}, {k}, {steps}], got {tuple(masks.shape)}")
        composed = composed_logprobs.detach()
        is_target = targets != IGNORE_INDEX
        held = masks.to(device=targets.device, dtype=torch.bool).transpose(0, 1) & is_target  # [k, B, T]
        holders = held.sum(0)

        off = divergence(composed, background_logprobs, self.kind)
        on = divergence(composed.expand_as(experts_logprobs), experts_logprobs, self.kind)
        on = on.where(held, 0.0).sum(0) / holders.clamp_min(1)
        per_position = on.where(holders > 0, off)
        self.total += per_position.where(is_target, 0.0).sum()
        self.count += is_target.sum()

    def compute(self) -> Tensor:
        return _ratio(self.total, self.count, 0.0)


class TargetMargin(Metric):
    """How close the composition is to a wrong greedy choice, teacher-forced on the ideal targets.

    The margin at a target position is ``lp(target) − max_{v ≠ target} lp(v)`` in nats: greedy decoding
    keeps the target iff it is positive. Near an exact match of 1 the margins show what exact match hides,
    how many positions are close to flipping (with k experts the composition adds k − 1 off-mask
    log-ratios to each expert's own margin). ``update(composed_logprobs [B, T, V], targets [B, T],
    positions [B, T] bool | None)`` scores the target positions (within ``positions`` if given).
    ``compute()`` returns ``{"min": smallest margin, "below_<m>": fraction of positions with margin < m}``
    for each ``m`` in ``thresholds`` (``min`` is ``0.0`` when nothing was counted).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, thresholds: Sequence[float] = (0.0, 2.0), **kwargs) -> None:
        super().__init__(**kwargs)
        self.thresholds = tuple(float(m) for m in thresholds)
        self.add_state("below", default=torch.zeros(len(self.thresholds), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("minimum", default=torch.tensor(float("inf")), dist_reduce_fx="min")

    def update(self, composed_logprobs: Tensor, targets: Tensor, positions: Tensor | None = None) -> None:
        if composed_logprobs.dim() != 3 or targets.shape != composed_logprobs.shape[:2]:
            raise ValueError(
                f"composed_logprobs must be [B, T, V] aligned with targets [B, T]; got "
                f"{tuple(composed_logprobs.shape)} and {tuple(targets.shape)}"
            )
        lp = composed_logprobs.detach().float()
        keep = targets != IGNORE_INDEX
        if positions is not None:
            keep = keep & positions.to(device=targets.device, dtype=torch.bool)
        index = targets.clamp_min(0).unsqueeze(-1)
        target_lp = lp.gather(-1, index).squeeze(-1)
        rival_lp = lp.scatter(-1, index, float("-inf")).amax(-1)
        margin = (target_lp - rival_lp)[keep]
        if margin.numel():
            self.minimum = torch.minimum(self.minimum, margin.min())
        self.count += margin.numel()
        if self.thresholds:
            self.below += torch.stack([(margin < m).sum() for m in self.thresholds])

    def compute(self) -> dict[str, Tensor]:
        out = {"min": torch.where(self.count > 0, self.minimum, torch.zeros_like(self.minimum))}
        for m, below in zip(self.thresholds, self.below, strict=True):
            out[f"below_{m:g}"] = _ratio(below, self.count, 0.0)
        return out


def margin_decomposition(background_logprobs: Tensor, experts_logprobs: Tensor, targets: Tensor, rivals: Tensor,
                         masks: Tensor) -> dict[str, Tensor]:
    """Split the composed margin of ``target`` over ``rival`` at each position held by exactly one mask.

    With unit weights the composed log-odds of the two tokens is ``d_b + Σ_j (d_j − d_b)`` where ``d = lp[target]
    − lp[rival]``; at a position held by expert ``i`` that is ``owner + others`` with ``owner = d_i`` (the
    expert alone) and ``others = Σ_{j≠i} (d_j − d_b)`` (what the rest shift it by, zero for experts exactly on
    the background). Inputs: log-probs ``[B, T, V]`` and ``[k, B, T, V]``, token ids ``targets`` and
    ``rivals`` ``[B, T]`` (e.g. the rule's letter and the copied source), ``masks [B, k, T]``. Returns 1-D
    tensors ``owner``, ``others`` and ``background`` (``d_b``) over those positions, in row-major order.
    """
    held = masks.to(dtype=torch.bool).transpose(0, 1) & (targets != IGNORE_INDEX)  # [k, B, T]
    one_owner = held.sum(0) == 1
    t, r = targets.clamp_min(0).unsqueeze(-1), rivals.clamp_min(0).unsqueeze(-1)
    d_b = (background_logprobs.gather(-1, t) - background_logprobs.gather(-1, r)).squeeze(-1)  # [B, T]
    k = experts_logprobs.shape[0]
    d_e = (experts_logprobs.gather(-1, t.expand(k, *t.shape)) - experts_logprobs.gather(-1, r.expand(k, *r.shape))
           ).squeeze(-1)  # [k, B, T]
    owner = (d_e * held).sum(0)
    others = (d_e - d_b).sum(0) - (owner - d_b)
    return {"owner": owner[one_owner], "others": others[one_owner], "background": d_b[one_owner]}


FAILURE_TYPES = ("correct", "rule_not_applied", "wrong_letter_elsewhere", "length_or_eos")


def classify_failure(pred: str, ref: str, ended: bool, mask_positions: set[int]) -> str:
    """Classify one position-aligned generation against its reference (first matching rule wins).

    - ``"correct"``: ``pred == ref`` and the generation ended with EOS.
    - ``"length_or_eos"``: no EOS, or the length differs from the reference.
    - ``"rule_not_applied"``: some position in ``mask_positions`` is wrong (the rule should have
      fired there; the output kept the source letter or wrote another one).
    - ``"wrong_letter_elsewhere"``: every error lies at a position in no mask.
    """
    if ended and pred == ref:
        return "correct"
    if not ended or len(pred) != len(ref):
        return "length_or_eos"
    errors = {t for t, (p, r) in enumerate(zip(pred, ref, strict=True)) if p != r}
    return "rule_not_applied" if errors & set(mask_positions) else "wrong_letter_elsewhere"


class FailureTypes(Metric):
    """Fractions of composed generations per failure type (``FAILURE_TYPES``; they sum to 1).

    ``update(preds, refs, xs=None, ended=None, mask_positions=None)`` with position-aligned strings
    (character ``t`` of ``pred``, ``ref`` and ``x`` is output position ``t``). ``mask_positions[j]``
    is the set of output positions of sample ``j`` in any expert's mask (where some rule fires);
    when omitted it is derived from the sources as the positions where ``x`` and ``ref`` differ.
    ``ended`` defaults to all True. See :func:`classify_failure` for the rules.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "counts", default=torch.zeros(len(FAILURE_TYPES), dtype=torch.long), dist_reduce_fx="sum"
        )

    def update(
        self,
        preds: Sequence[str],
        refs: Sequence[str],
        xs: Sequence[str] | None = None,
        ended: Sequence[bool] | None = None,
        mask_positions: Sequence[set[int]] | None = None,
    ) -> None:
        n = len(preds)
        if mask_positions is None:
            if xs is None:
                raise ValueError("FailureTypes.update needs mask_positions or xs (to derive the masks)")
            if len(xs) != len(refs):
                raise ValueError(f"xs has {len(xs)} items but refs has {len(refs)}")
            mask_positions = [
                {t for t, (a, b) in enumerate(zip(x, r, strict=False)) if a != b}
                for x, r in zip(xs, refs, strict=True)
            ]
        ended = [True] * n if ended is None else list(ended)
        for name, seq in (("refs", refs), ("ended", ended), ("mask_positions", mask_positions)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} items but preds has {n}")
        new = torch.zeros_like(self.counts)
        for p, r, e, m in zip(preds, refs, ended, mask_positions, strict=True):
            new[FAILURE_TYPES.index(classify_failure(p, r, bool(e), m))] += 1
        self.counts += new

    def compute(self) -> dict[str, Tensor]:
        fractions = _ratio(self.counts, self.counts.sum().expand_as(self.counts), 0.0)
        return dict(zip(FAILURE_TYPES, fractions, strict=True))
