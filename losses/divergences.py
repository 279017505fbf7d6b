"""Per-position divergences between an expert's and the background's next-token distributions.

Every divergence here takes logits (or log-probs) ``[..., V]`` of the expert and of the background
and returns one float32 value per position ``[...]``. The background side is the reference and is
treated as a constant (detached): gradients reach the expert only.

Divergences live in the registry `DIVERGENCES` (name -> `DivergenceSpec`); `register_divergence` adds one,
so a divergence of one's own is usable by name wherever a built-in one is (config, regularizer, metrics).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""Target id of a position that is not scored (prompt, padding), as in ``F.cross_entropy``."""

LOG_RATIO_FLOOR = -1e4
"""Floor on log-probs in the ``log_ratio`` penalty, the same as ``compose_logprobs``'s ``min_logprob``."""

PLAUSIBLE_K = 16
"""``plausible_log_ratio``: at most this many of each side's most likely tokens are compared."""

PLAUSIBLE_MARGIN = 10.0
"""``plausible_log_ratio``: a token is plausible for a side when its log-prob is within this many nats of that
side's most likely token (about what the shifts of a few experts can add up to in a composition)."""

TAIL_TOKENS = 32
"""``tail_log_ratio``: this many tokens spread evenly over the vocabulary are compared beside the plausible ones."""

AMPLIFIED_COPIES = 5
"""``amplified_kl``: the number of copies of the expert composed with the background (the rule multiplies in one
ratio ``p_i / p_b`` per expert, so experts that drift alike add their drifts this many times)."""

SURE_PROB = 0.9
"""``sure_amplified_kl``: a position counts as sure when the background gives its most likely token at least this
probability."""

LogprobDivergence = Callable[..., Tensor]
"""``fn(lp_i, lp_b, *, beta) -> [...]``: a divergence from normalized log-probs ``[..., V]`` of the expert
(``lp_i``) and of the background (``lp_b``); ``beta`` is the JSD mixture weight (other divergences ignore it). A
divergence registered with ``needs_written=True`` also takes ``written`` (``[...]`` token ids: the token the
row writes at each position)."""


@dataclass(frozen=True)
class DivergenceSpec:
    """One registered divergence.

    Attributes:
        name: its name (``expert.divergence``, ``kind=`` arguments).
        fn: the divergence from log-probs (`LogprobDivergence`).
        cacheable: whether it may be computed against the background cache (`losses.background_cache`): true
            for f-divergences of the categorical distributions, whose value on the cache's bucketed
            distributions (top-k tokens plus one tail bucket) is a lower bound that grows with k; false for a
            divergence that needs the background's log-prob of every token (``log_ratio``).
        needs_written: whether ``fn`` also takes ``written``, the token each position's row writes (the target).
    """

    name: str
    fn: LogprobDivergence
    cacheable: bool
    needs_written: bool = False


DIVERGENCES: dict[str, DivergenceSpec] = {}
"""Every divergence by name, in registration order (the built-ins first)."""


def register_divergence(name: str, *, cacheable: bool,
                        needs_written: bool = False) -> Callable[[LogprobDivergence], LogprobDivergence]:
    """Decorator: register ``fn(lp_i, lp_b, *, beta)`` (`LogprobDivergence`; with ``needs_written``,
    ``fn(lp_i, lp_b, *, beta, written)``) as divergence ``name``.

    Example::

        @register_divergence("squared_hellinger", cacheable=True)
        def squared_hellinger(lp_i, lp_b, *, beta):
            return 1 - ((lp_i + lp_b) / 2).exp().sum(-1)

    Raises ``ValueError`` if ``name`` is taken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a divergence name must be a non-empty string, got {name!r}")
    if name in DIVERGENCES:
        raise ValueError(f"divergence {name!r} is already registered ({DIVERGENCES[name].fn.__qualname__})")
    if needs_written and cacheable:  # the cache keeps the background's top tokens, not the written one
        raise ValueError(f"divergence {name!r}: one that needs the written token cannot be cacheable")

    def register(fn: LogprobDivergence) -> LogprobDivergence:
        DIVERGENCES[name] = DivergenceSpec(name, fn, bool(cacheable), bool(needs_written))
        return fn

    return register


def divergence_spec(kind: str) -> DivergenceSpec:
    """The registered divergence ``kind``; ``ValueError`` naming it and the allowed ones if there is none."""
    try:
        return DIVERGENCES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown divergence kind {kind!r}; allowed kinds: {', '.join(DIVERGENCES)}") from None


def check_divergence_args(kind: str, beta: float = 0.5, temperature: float = 1.0) -> None:
    """Raise ``ValueError`` if ``kind`` is not registered, or ``beta`` or ``temperature`` is not allowed."""
    divergence_spec(kind)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] for the generalized JSD, got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def divergence(
    expert_logits: Tensor,
    background_logits: Tensor,
    kind: str = "forward_kl",
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    written: Tensor | None = None,
) -> Tensor:
    """Divergence between expert and background next-token distributions, one value per position.

    With ``lp_i = log_softmax(expert_logits / T)`` and ``lp_b = log_softmax(background_logits / T)``, ``kind``
    names a registered divergence (`DIVERGENCES`); the built-ins:

    - ``"forward_kl"``: ``KL(p_b ‖ p_i) = Σ_v p_b (lp_b − lp_i)`` (background as the reference).
    - ``"reverse_kl"``: ``KL(p_i ‖ p_b)``.
    - ``"jsd"``: generalized JSD, ``β·KL(p_b ‖ m) + (1 − β)·KL(p_i ‖ m)`` with
      ``m = β·p_b + (1 − β)·p_i`` (``log m`` by logsumexp). It lies in ``[0, H(β)]``,
      ``H(β) = −β log β − (1 − β) log(1 − β)`` (``log 2`` at ``β = 0.5``, where it is symmetric).
    - ``"log_ratio"``: ``mean_v (r − mean_v r)²`` with ``r = lp_i − lp_b``, the variance over the
      vocabulary of the log-ratio. Unlike KL it weighs every token alike, so it also controls the
      tail log-ratios that add up inside a composition (docs/method.md, prefixes the composition writes). It is invariant to adding a
      per-position constant to either side's logits. Log-probs are floored at ``LOG_RATIO_FLOOR``
      (as ``compose_logprobs`` does), so a zero-probability token gives a finite value.
    - ``"plausible_log_ratio"``: the same variance over the plausible tokens only: those among either side's
      ``PLAUSIBLE_K`` most likely within ``PLAUSIBLE_MARGIN`` nats of its top. These are the tokens a composition
      can pick once the other experts' shifts add up (a word copied from the prompt where the background writes a
      delimiter), whose odds KL barely sees and the whole-vocabulary variance dilutes among ~10⁵ others.
    - ``"written_log_ratio"``: ``plausible_log_ratio`` with the token the row writes at the position added to the
      compared tokens (it needs ``written``). Inside another expert's interval the composition writes a token
      neither the background nor this expert finds plausible (a reversed word); an expert that pulls such a
      token down pulls it down in the composition, and ``plausible_log_ratio`` does not see it. Rows whose text
      holds such tokens (random foreign spans, `data.foreign_spans`) then hold the expert to the background there.

    - ``"amplified_kl"``: ``KL(p_b ‖ p_K) / K`` with ``p_K ∝ p_b · (p_i / p_b)^K``, ``K = AMPLIFIED_COPIES``: the
      forward KL of the background to the composition of ``K`` copies of the expert, per copy. Where the background
      is sure of one token, an expert that raises another by ``δ`` nats costs next to nothing in KL, but ``K``
      experts that do alike flip the composition once ``K·δ`` passes the background's margin; this divergence sees
      that flip. For small drifts it is about ``K`` times the forward KL.
    - ``"tail_amplified_kl"``: ``tail_log_ratio`` plus ``amplified_kl``.
    - ``"flip_kl"``: ``amplified_kl / K``, i.e. ``KL(p_b ‖ p_K) / K²``: to second order the forward KL where the
      expert differs little (so it weighs no more than the KL elsewhere), and still the flip of ``K`` alike
      experts where the background is sure.
    - ``"tail_flip_kl"``: ``tail_log_ratio`` plus ``flip_kl``.
    - ``"sure_amplified_kl"``: ``amplified_kl`` where the background is sure (its top token at least ``SURE_PROB``),
      0 elsewhere: the flips of alike experts are looked for only where the background has one answer, and the
      unsure positions keep the weight the other divergence gives them.
    - ``"tail_sure_amplified_kl"``: ``tail_log_ratio`` plus ``sure_amplified_kl``.

    The result is not rescaled by ``T²``.

    Args:
        expert_logits: ``[..., V]`` logits or log-probs of the expert (gradients flow here).
        background_logits: ``[..., V]`` logits or log-probs of the background (detached).
        kind: a name in ``DIVERGENCES``.
        beta: weight of the background in the JSD mixture, in ``[0, 1]``.
        temperature: log-probs are computed from ``logits / temperature``.
        written: ``[...]`` token ids, the token written at each position (the target); needed by the divergences
            registered with ``needs_written`` (``written_log_ratio``), ignored by the others.

    Returns:
        float32 tensor ``[...]`` (the input shape without the vocabulary axis).
    """
    check_divergence_args(kind, beta, temperature)
    if expert_logits.shape != background_logits.shape:
        raise ValueError(
            f"expert_logits has shape {tuple(expert_logits.shape)} but background_logits has "
            f"{tuple(background_logits.shape)}"
        )
    lp_i = (expert_logits.float() / temperature).log_softmax(-1)
    lp_b = (background_logits.detach().float() / temperature).log_softmax(-1)
    return logprob_divergence(lp_i, lp_b, kind, beta=beta, written=written)


def logprob_divergence(lp_i: Tensor, lp_b: Tensor, kind: str = "forward_kl", *, beta: float = 0.5,
                       written: Tensor | None = None) -> Tensor:
    """:func:`divergence` from normalized log-probs ``[..., V]`` (already tempered): ``lp_i`` of the expert,
    ``lp_b`` of the background (not detached here). The categories need not be tokens: any partition of the
    vocabulary into buckets (``losses.background_cache``) gives the divergence of the bucketed distributions.
    """
    spec = divergence_spec(kind)
    if not spec.needs_written:
        return spec.fn(lp_i, lp_b, beta=beta)
    if written is None or written.shape != lp_i.shape[:-1]:
        got = None if written is None else tuple(written.shape)
        raise ValueError(f"divergence {kind!r} needs the written token of each position: written of shape "
                         f"{tuple(lp_i.shape[:-1])}, got {got}")
    return spec.fn(lp_i, lp_b, beta=beta, written=written)


def _kl(lp_p: Tensor, lp_q: Tensor) -> Tensor:
    """``KL(p ‖ q) = Σ_v p (lp_p − lp_q)`` from log-probs, with ``0 · log 0 = 0`` (no NaN, in value or grad)."""
    p = lp_p.exp()
    diff = (lp_p - lp_q).where(p > 0, 0.0)
    return (p * diff).sum(-1)


@register_divergence("forward_kl", cacheable=True)
def forward_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``KL(p_b ‖ p_i)``."""
    return _kl(lp_b, lp_i)


@register_divergence("reverse_kl", cacheable=True)
def reverse_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``KL(p_i ‖ p_b)``."""
    return _kl(lp_i, lp_b)


@register_divergence("jsd", cacheable=True)
def generalized_jsd(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``β·KL(p_b ‖ m) + (1 − β)·KL(p_i ‖ m)``, ``m = β·p_b + (1 − β)·p_i``."""
    if beta == 0.0 or beta == 1.0:  # the mixture is one side: the divergence is 0 (skip 0 · inf)
        return (lp_i - lp_i.detach()).sum(-1)
    log_m = (lp_b + math.log(beta)).logaddexp(lp_i + math.log1p(-beta))
    return beta * _kl(lp_b, log_m) + (1.0 - beta) * _kl(lp_i, log_m)


@register_divergence("log_ratio", cacheable=False)
def log_ratio_variance(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``mean_v (r − mean_v r)²``, ``r = lp_i − lp_b`` (log-probs floored at ``LOG_RATIO_FLOOR``)."""
    r = lp_i.clamp_min(LOG_RATIO_FLOOR) - lp_b.clamp_min(LOG_RATIO_FLOOR)
    return (r - r.mean(-1, keepdim=True)).pow(2).mean(-1)


def _plausible(lp_i: Tensor, lp_b: Tensor) -> Tensor:
    """Boolean ``[..., V]``: the tokens among either side's ``PLAUSIBLE_K`` most likely within ``PLAUSIBLE_MARGIN``
    nats of its top (chosen without gradient)."""
    plausible = torch.zeros(lp_b.shape, dtype=torch.bool, device=lp_b.device)
    k = min(PLAUSIBLE_K, lp_b.shape[-1])
    for lp in (lp_b.detach(), lp_i.detach()):
        top = lp.topk(k, dim=-1)
        near = top.values >= top.values[..., :1] - PLAUSIBLE_MARGIN
        plausible |= torch.zeros_like(plausible).scatter_(-1, top.indices, near)
    return plausible


def _log_ratio_variance_over(lp_i: Tensor, lp_b: Tensor, tokens: Tensor) -> Tensor:
    """``mean_S (r − mean_S r)²``, ``r = lp_i − lp_b`` (floored at ``LOG_RATIO_FLOOR``), S the ``tokens`` (bool
    ``[..., V]``, at least one per position)."""
    r = (lp_i.clamp_min(LOG_RATIO_FLOOR) - lp_b.clamp_min(LOG_RATIO_FLOOR)).where(tokens, 0.0)
    n = tokens.sum(-1, keepdim=True)
    mean = r.sum(-1, keepdim=True) / n
    return ((r - mean).where(tokens, 0.0).pow(2).sum(-1, keepdim=True) / n).squeeze(-1)


@register_divergence("plausible_log_ratio", cacheable=False)
def plausible_log_ratio_variance(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``mean_S (r − mean_S r)²``, ``r = lp_i − lp_b``, over S = the plausible tokens of either side (up to
    ``PLAUSIBLE_K`` most likely, within ``PLAUSIBLE_MARGIN`` nats of its top; chosen without gradient)."""
    return _log_ratio_variance_over(lp_i, lp_b, _plausible(lp_i, lp_b))


@register_divergence("written_log_ratio", cacheable=False, needs_written=True)
def written_log_ratio_variance(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5, written: Tensor) -> Tensor:
    """``plausible_log_ratio_variance`` over the plausible tokens and the written one."""
    tokens = _plausible(lp_i, lp_b).scatter(-1, written.unsqueeze(-1).to(lp_i.device), True)
    return _log_ratio_variance_over(lp_i, lp_b, tokens)


def _vocabulary_spread(lp_b: Tensor, n: int) -> Tensor:
    """Token ids ``[..., n]`` spread evenly over the vocabulary, from an offset that changes with the background's
    most likely token (so that positions, and steps, compare different tail tokens; no randomness)."""
    vocab = lp_b.shape[-1]
    stride = max(vocab // n, 1)
    offset = (lp_b.detach().argmax(-1, keepdim=True) * 40503) % stride  # 40503: a prime, to scatter the offsets
    return (offset + stride * torch.arange(min(n, vocab), device=lp_b.device)) % vocab


@register_divergence("tail_log_ratio", cacheable=False)
def tail_log_ratio_variance(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``plausible_log_ratio_variance`` over the plausible tokens and ``TAIL_TOKENS`` spread over the vocabulary.

    Where the background is sure of one token, the plausible set is that token alone, and an expert may raise the
    whole tail by a few nats unseen by KL and by ``plausible_log_ratio``; k such experts add their rises in a
    composition. The spread tokens stand for the tail, which then weighs as much as the plausible tokens."""
    tokens = _plausible(lp_i, lp_b).scatter_(-1, _vocabulary_spread(lp_b, TAIL_TOKENS), True)
    return _log_ratio_variance_over(lp_i, lp_b, tokens)


@register_divergence("amplified_kl", cacheable=False)
def amplified_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5, copies: float = AMPLIFIED_COPIES) -> Tensor:
    """``KL(p_b ‖ p_K) / K``, ``log p_K = log_softmax(lp_b + K·(lp_i − lp_b))``, ``K = copies`` (log-probs floored at
    ``LOG_RATIO_FLOOR``): the background against ``K`` copies of the expert composed by the product rule."""
    lp_b, lp_i = lp_b.clamp_min(LOG_RATIO_FLOOR), lp_i.clamp_min(LOG_RATIO_FLOOR)
    lp_k = (lp_b + copies * (lp_i - lp_b)).log_softmax(-1)
    return _kl(lp_b, lp_k) / copies


@register_divergence("tail_amplified_kl", cacheable=False)
def tail_amplified_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``tail_log_ratio_variance + amplified_kl``: the tail kept and the flips of ``AMPLIFIED_COPIES`` alike experts
    seen where the background is sure."""
    return tail_log_ratio_variance(lp_i, lp_b) + amplified_kl(lp_i, lp_b)


@register_divergence("flip_kl", cacheable=False)
def flip_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5, copies: float = AMPLIFIED_COPIES) -> Tensor:
    """``KL(p_b ‖ p_K) / K²`` (``amplified_kl`` per copy once more): small drifts cost their forward KL, since
    ``KL(p_b ‖ p_K) ≈ K² · KL(p_b ‖ p_i)`` to second order, while a flip by ``K`` alike experts still shows."""
    return amplified_kl(lp_i, lp_b, copies=copies) / copies


@register_divergence("tail_flip_kl", cacheable=False)
def tail_flip_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``tail_log_ratio_variance + flip_kl``."""
    return tail_log_ratio_variance(lp_i, lp_b) + flip_kl(lp_i, lp_b)


@register_divergence("sure_amplified_kl", cacheable=False)
def sure_amplified_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``amplified_kl`` at the positions where the background's top token has at least ``SURE_PROB``, else 0."""
    sure = lp_b.detach().amax(-1) >= math.log(SURE_PROB)
    return amplified_kl(lp_i, lp_b).where(sure, 0.0)


@register_divergence("tail_sure_amplified_kl", cacheable=False)
def tail_sure_amplified_kl(lp_i: Tensor, lp_b: Tensor, *, beta: float = 0.5) -> Tensor:
    """``tail_log_ratio_variance + sure_amplified_kl``."""
    return tail_log_ratio_variance(lp_i, lp_b) + sure_amplified_kl(lp_i, lp_b)
