"""Factorizability in feature space (docs/method.md, when the rule is exact): how a composition behaves on the marginals of a token
bijection ``D: V → F_1 × … × F_n`` (`losses.features.FeatureMap`).

`feature_metrics` scores a composed model teacher-forced on compositional rows, per feature: each expert's
divergence from the background on the features it does not own (and on the ones it owns, off its mask), the
composition's projectivity error on that feature's marginal, and how far each component's joint is from the
product of its marginals (0 for a factored head).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from compose.composed_lm import ComposedLM
from compose.operator import compose_logprobs
from losses import IGNORE_INDEX, divergence
from losses.features import FeatureMap, feature_logprobs, owned_matrix


def factorization_gap(logprobs: Tensor, fmap: FeatureMap) -> Tensor:
    """``KL(p ‖ Π_j p^j)`` per position ``[...]``: how far a next-token distribution ``[..., V]`` (log-probs)
    is from the product of its feature marginals (0 when it factorizes)."""
    marginals = feature_logprobs(logprobs, fmap)
    n = len(marginals)
    product = sum(m.view(*m.shape[:-1], *(m.shape[-1] if i == j else 1 for i in range(n)))
                  for j, m in enumerate(marginals))
    joint = logprobs.float().log_softmax(-1)[..., fmap.grid.to(logprobs.device)]
    return (joint.exp() * (joint - product)).flatten(-n).sum(-1).clamp_min(0.0)  # >= 0 (rounding aside)


@torch.no_grad()
def feature_metrics(model: ComposedLM, rows, collate: Callable, fmap: FeatureMap,
                    owned: Mapping[str, Sequence[str]], batch_size: int = 250) -> dict[str, float]:
    """Feature-space metrics of `model` teacher-forced on `rows` (with `targets` and one mask per expert).

    Returns (means over target positions):
        `features/<expert>/<feature>_kl`: ``KL(p_b^j ‖ p_i^j)`` where expert ``i`` may not change feature ``j``
            (every position for a feature it does not own, off its mask for one it owns);
        `features/<feature>/projectivity_error`: ``KL(p_ref^j ‖ p̂^j)`` with ``p_ref^j`` the marginal of the
            expert owning feature ``j`` at that position (mean over several), else the background's;
        `features/factorization_gap/<component>`: ``KL(p ‖ Π_j p^j)`` of the background, each expert and the
            composition.
    Every process scores every row (no sharding): the values are the same on every rank.
    """
    names = list(model.names)
    owns = owned_matrix(names, owned, fmap).to(model.device)  # [k, n]
    sums: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}

    def add(key: str, values: Tensor, where: Tensor) -> None:
        sums[key] = sums.get(key, 0.0) + values[where].sum()
        counts[key] = counts.get(key, 0) + where.sum()

    for start in range(0, len(rows), batch_size):
        batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
        targets, masks = batch["targets"].to(model.device), batch["masks"].to(model.device).bool()  # masks [B, k, T]
        lp_b, lp_e = model.component_logprobs(batch["input_ids"], batch["attention_mask"])
        composed = compose_logprobs(lp_b, lp_e, weights=model.weights, min_logprob=model.min_logprob)
        is_target = targets != IGNORE_INDEX
        mb, me, mc = feature_logprobs(lp_b, fmap), feature_logprobs(lp_e, fmap), feature_logprobs(composed, fmap)
        for j, feature in enumerate(fmap.names):
            held = masks.transpose(0, 1) & owns[:, j, None, None] & is_target  # [k, B, T]: owner i acts on j here
            for i, name in enumerate(names):
                add(f"features/{name}/{feature}_kl", divergence(me[j][i], mb[j]), is_target & ~held[i])
            ref = torch.where(held.any(0, keepdim=True).unsqueeze(-1), me[j], mb[j].unsqueeze(0))  # [k, B, T, F]
            weight = torch.where(held.any(0), held.float(), 1.0)  # [k, B, T]: the mean over holders, or over all
            per_ref = divergence(mc[j].unsqueeze(0).expand_as(ref), ref, "forward_kl")  # KL(p_ref ‖ p̂)
            add(f"features/{feature}/projectivity_error", (per_ref * weight).sum(0) / weight.sum(0), is_target)
        for component, lp in (("background", lp_b), *zip(names, lp_e, strict=True), ("composed", composed)):
            add(f"features/factorization_gap/{component}", factorization_gap(lp, fmap), is_target)
    return {key: float(sums[key] / counts[key]) if counts[key] > 0 else 0.0 for key in sums}
