"""Feature space (docs/method.md, when the rule is exact): a token bijection ``D: V → F_1 × … × F_n``, the feature marginals of a
next-token distribution, and the per-feature regularizer.

A :class:`FeatureMap` holds ``D`` as a grid of token ids: ``grid[f_1, …, f_n]`` is the token whose features
are ``(f_1, …, f_n)``. Every token sits in exactly one cell and every cell holds a token, so ``D`` is a
bijection (checked on construction). The marginal of feature ``j`` is ``p^j(f) = Σ_{v: D_j(v) = f} p(v)``.

With a *factored* head (token logit ``z(v) = Σ_j a_j[D_j(v)]``) the joint is the product of its marginals,
and composing in token space (``compose_logprobs``) equals composing each feature's marginal and mapping back:
two experts may then act at the same positions on disjoint feature coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from losses.divergences import divergence
from losses.regularizer import check_aligned, region_positions


class FeatureMapError(ValueError):
    """A feature map that is not a bijection of the vocabulary onto ``F_1 × … × F_n`` (one line, naming it)."""


@dataclass(frozen=True)
class FeatureMap:
    """A token bijection ``D: V → F_1 × … × F_n``.

    Attributes:
        names: the features' names, e.g. ``("letter", "case")``.
        values: per feature, the names of its values, e.g. ``(("a", …, "z", "<pad>", …), ("lower", "upper"))``.
        grid: long tensor of shape ``(|F_1|, …, |F_n|)``: the token id of each feature tuple.
    """

    names: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    grid: Tensor

    @classmethod
    def from_tokens(cls, names: Sequence[str], values: Sequence[Sequence[str]],
                    token_features: Sequence[Sequence[int]], tokens: Sequence[str] | None = None) -> FeatureMap:
        """Build ``D`` from each token's feature indices (``token_features[v]`` = ``D(v)``, one index per feature).

        Raises:
            FeatureMapError: (one line, naming the token or the feature tuple) if a token has the wrong number
                of features or an index out of range, two tokens share a feature tuple (not injective), or a
                feature tuple has no token (not onto).
        """
        names, values = tuple(map(str, names)), tuple(tuple(map(str, v)) for v in values)
        if not names or len(values) != len(names) or any(not v for v in values) or len(set(names)) != len(names):
            raise FeatureMapError(f"feature map: give unique feature names and a non-empty value list for each, "
                                  f"got names={list(names)} with {[len(v) for v in values]} values")
        label = (lambda v: f"token {v} ({tokens[v]!r})") if tokens is not None else (lambda v: f"token {v}")
        sizes = tuple(len(v) for v in values)
        grid = torch.full(sizes, -1, dtype=torch.long)
        for v, feats in enumerate(token_features):
            feats = tuple(feats)
            if len(feats) != len(names) or any(not 0 <= f < s for f, s in zip(feats, sizes, strict=False)):
                raise FeatureMapError(f"feature map: {label(v)} has features {feats}, expected one index per "
                                      f"feature {list(names)} within sizes {list(sizes)}")
            if grid[feats] >= 0:
                raise FeatureMapError(f"feature map: {label(int(grid[feats]))} and {label(v)} both map to "
                                      f"{_describe(names, values, feats)}: not a bijection")
            grid[feats] = v
        if (grid < 0).any():
            missing = tuple(int(i) for i in (grid < 0).nonzero()[0])
            raise FeatureMapError(f"feature map: {_describe(names, values, missing)} has no token: not a bijection "
                                  f"({len(token_features)} tokens, {math.prod(sizes)} feature tuples "
                                  f"{' × '.join(map(str, sizes))})")
        return cls(names, values, grid)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.grid.shape)

    @property
    def vocab_size(self) -> int:
        return self.grid.numel()

    def token_features(self) -> Tensor:
        """``[V, n]`` long: ``D(v)`` for every token id ``v``."""
        index = torch.empty(self.vocab_size, len(self.names), dtype=torch.long)
        index[self.grid.flatten()] = torch.cartesian_prod(*(torch.arange(s) for s in self.sizes)).view(
            self.vocab_size, len(self.names))
        return index

    def index(self, feature: str) -> int:
        """Position of the feature called ``feature`` (``FeatureMapError`` naming it if unknown)."""
        if feature not in self.names:
            raise FeatureMapError(f"feature {feature!r} is not one of {list(self.names)}")
        return self.names.index(feature)


def _describe(names: Sequence[str], values: Sequence[Sequence[str]], feats: Sequence[int]) -> str:
    return "(" + ", ".join(f"{n}={values[j][f]}" for j, (n, f) in enumerate(zip(names, feats, strict=True))) + ")"


def feature_logprobs(logits: Tensor, fmap: FeatureMap) -> list[Tensor]:
    """Log-marginals of each feature: ``[..., |F_j|]`` per feature ``j`` (float32) from token logits ``[..., V]``."""
    if logits.shape[-1] != fmap.vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} tokens but the feature map covers {fmap.vocab_size}")
    joint = logits.float().log_softmax(-1)[..., fmap.grid.to(logits.device)]  # [..., |F_1|, ..., |F_n|]
    n, lead = len(fmap.names), logits.dim() - 1
    return [joint.logsumexp(dim=tuple(lead + i for i in range(n) if i != j)) if n > 1 else joint for j in range(n)]


def feature_divergence(
    expert_logits: Tensor,
    background_logits: Tensor,
    targets: Tensor,
    masks: Tensor,
    fmap: FeatureMap,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """The per-feature regularizer: ``Σ_j mean_{t ∉ M_i^j} D(p_i^j(·|t), p_b^j(·|t))``.

    Each feature's marginal is pulled onto the background's outside the expert's mask *for that feature*
    ``M_i^j``: an expert that owns only ``letter`` has an empty ``case`` mask, so its case marginal matches
    the background's at every target position, its own mask included. With a factored head, off every mask
    the sum equals the token-space ``off_mask_divergence`` (for KL: the joint is the product of the marginals).
    Marginals are those of the joint at ``temperature``.

    Args:
        expert_logits: ``[B, T, V]`` (gradients flow here).
        background_logits: ``[B, T, V]`` (treated as constant).
        targets: ``[B, T]``, ``-100`` where not a target.
        masks: ``[n, B, T]`` bool: per feature, where the expert may change that feature's marginal.
        fmap: the bijection ``D``.
        kind, beta: see :func:`losses.divergence`.

    Returns:
        0-dim float32 tensor (attached to the expert's graph).
    """
    check_aligned(expert_logits, targets)
    if masks.shape != (len(fmap.names), *targets.shape):
        raise ValueError(f"masks must be [n_features, B, T] = [{len(fmap.names)}, {', '.join(map(str, targets.shape))}]"
                         f", got {tuple(masks.shape)}")
    lp_i = feature_logprobs(expert_logits / temperature, fmap)
    lp_b = feature_logprobs(background_logits.detach() / temperature, fmap)
    total = expert_logits.new_zeros((), dtype=torch.float32)
    for j in range(len(fmap.names)):
        keep = region_positions(targets, masks[j], "off")
        total = total + divergence(lp_i[j][keep], lp_b[j][keep], kind, beta=beta).sum() / keep.sum().clamp_min(1)
    return total


def feature_masks(own_mask: Tensor, owned: Tensor) -> Tensor:
    """Per-feature masks ``[n, B, T]`` of rows whose expert owns the features ``owned [B, n]`` (bool): the row's
    token mask ``own_mask [B, T]`` on an owned feature, nothing on the others."""
    return own_mask.bool().unsqueeze(0) & owned.bool().T.unsqueeze(-1)


def owned_matrix(names: Sequence[str], owned: Mapping[str, Sequence[str]], fmap: FeatureMap) -> Tensor:
    """``[k, n]`` bool: which features each expert of ``names`` owns (``owned[name]``: feature names)."""
    out = torch.zeros(len(names), len(fmap.names), dtype=torch.bool)
    for i, name in enumerate(names):
        for feature in owned.get(name, fmap.names):
            out[i, fmap.index(feature)] = True
    return out
