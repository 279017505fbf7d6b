"""A compact cache of the background's next-token distributions for the off-mask regularizer (docs/method.md, the regularizer).

The background is frozen, so its distribution at a position depends only on the (corrupted) prefix. A cache entry
keeps, per position, the background's ``k`` most likely tokens and their logits, plus the log of the mass of
every other token (the *tail*) at each temperature it will be used at: ``k·8 + 4·n_T`` bytes per position
instead of ``4·V`` (49 k or 256 k for real vocabularies).

The regularizer is then the divergence between the *bucketed* distributions: the ``k`` tokens, and the tail
lumped into one bucket. For forward KL:
``Σ_topk p_b (log p_b − log p_i) + r_b (log r_b − log r_i)`` with ``r = 1 − Σ_topk p``. A divergence registered
as ``cacheable`` (`losses.divergences.DIVERGENCES`: every built-in but ``log_ratio``, which weighs each tail token
on its own) is an f-divergence, so by the data-processing inequality the bucketed value never exceeds the exact
one, grows with ``k`` (a larger top-k refines the partition), and equals it when ``k`` covers the vocabulary.

No Lightning here; `lightning_modules.expert.ExpertLM` keys entries by (dataset row, corruption variant).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence, Set
from dataclasses import dataclass

import torch
from torch import Tensor

from losses.divergences import DIVERGENCES, check_divergence_args, divergence_spec, logprob_divergence


class _CacheableKinds(Set[str]):
    """The names of the registered divergences marked ``cacheable``, read from `DIVERGENCES` at each use."""

    def __contains__(self, kind: object) -> bool:
        spec = DIVERGENCES.get(kind) if isinstance(kind, str) else None
        return spec is not None and spec.cacheable

    def __iter__(self) -> Iterator[str]:
        return (name for name, spec in DIVERGENCES.items() if spec.cacheable)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"CACHE_KINDS({', '.join(self)})"


CACHE_KINDS: Set[str] = _CacheableKinds()
"""Divergences the cache serves: those registered ``cacheable`` (``log_ratio`` is not: it needs the background's
log-prob of every token)."""


@dataclass
class BackgroundTopK:
    """The background's next-token distribution at ``N`` positions, as top-k logits plus tail mass.

    Attributes:
        ids: ``[N, k]`` int32, the ``k`` most likely tokens (any order).
        logits: ``[N, k]`` float32, the background's logits at ``ids`` (any per-position shift).
        rest: ``[N, n_T]`` float32, ``logsumexp`` of ``logits / T`` over the *other* tokens, one column per
            temperature of ``temperatures`` (``-inf`` when ``k`` is the whole vocabulary).
        temperatures: the temperatures ``rest`` was computed at.
        vocab_size: ``V`` of the distribution.
    """

    ids: Tensor
    logits: Tensor
    rest: Tensor
    temperatures: tuple[float, ...]
    vocab_size: int

    @classmethod
    @torch.no_grad()
    def from_logits(cls, logits: Tensor, k: int, temperatures: Sequence[float] = (1.0,)) -> BackgroundTopK:
        """Compress background logits ``[N, V]`` to their top ``min(k, V)`` tokens and tail masses.

        Args:
            logits: ``[N, V]`` logits (or log-probs) of the background.
            k: tokens kept per position (``k >= V`` keeps every token: the divergences are then exact).
            temperatures: the temperatures the entry will be read at (`logprobs`).
        """
        if logits.dim() != 2:
            raise ValueError(f"BackgroundTopK.from_logits wants logits [N, V], got shape {tuple(logits.shape)}")
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        if not temperatures or any(not t > 0 for t in temperatures):
            raise ValueError(f"temperatures must be a non-empty list of numbers > 0, got {list(temperatures)}")
        logits = logits.detach().float()
        vocab = logits.shape[-1]
        top, ids = logits.topk(min(k, vocab), dim=-1, sorted=False)
        if ids.shape[-1] == vocab:
            rest = logits.new_full((logits.shape[0], len(temperatures)), float("-inf"))
        else:
            others = logits.scatter(-1, ids, float("-inf"))
            rest = torch.stack([(others / t).logsumexp(-1) for t in temperatures], dim=-1)
        return cls(ids.int(), top, rest, tuple(float(t) for t in temperatures), vocab)

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    def logprobs(self, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """Log-probs at ``temperature`` of the ``k`` tokens ``[N, k]`` and of the tail ``[N]`` (``-inf`` if empty)."""
        try:
            column = self.temperatures.index(float(temperature))
        except ValueError:
            raise ValueError(f"this background cache holds temperatures {list(self.temperatures)}, "
                             f"not {temperature}") from None
        scaled, rest = self.logits / temperature, self.rest[:, column]
        norm = scaled.logsumexp(-1).logaddexp(rest)
        return scaled - norm.unsqueeze(-1), rest - norm

    def __getitem__(self, index: Tensor | slice) -> BackgroundTopK:
        """The entries at ``index`` (a boolean or integer index over the ``N`` positions)."""
        return BackgroundTopK(self.ids[index], self.logits[index], self.rest[index], self.temperatures, self.vocab_size)

    def to(self, device: torch.device | str) -> BackgroundTopK:
        return BackgroundTopK(self.ids.to(device), self.logits.to(device), self.rest.to(device), self.temperatures,
                              self.vocab_size)

    def split(self, sizes: Sequence[int]) -> list[BackgroundTopK]:
        """Consecutive pieces of ``sizes`` positions each (one per row, say)."""
        parts = zip(*(t.split(list(sizes)) for t in (self.ids, self.logits, self.rest)), strict=True)
        return [BackgroundTopK(i, lg, r, self.temperatures, self.vocab_size) for i, lg, r in parts]

    @classmethod
    def cat(cls, entries: Sequence[BackgroundTopK]) -> BackgroundTopK:
        """The positions of ``entries`` one after the other (same ``k``, temperatures and vocabulary)."""
        if not entries:
            raise ValueError("BackgroundTopK.cat needs at least one entry")
        first = entries[0]
        if any((e.k, e.temperatures, e.vocab_size) != (first.k, first.temperatures, first.vocab_size) for e in entries):
            raise ValueError("BackgroundTopK.cat: entries differ in k, temperatures or vocabulary size")
        return cls(torch.cat([e.ids for e in entries]), torch.cat([e.logits for e in entries]),
                   torch.cat([e.rest for e in entries]), first.temperatures, first.vocab_size)


def topk_divergence(
    expert_logits: Tensor,
    background: BackgroundTopK,
    kind: str = "forward_kl",
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`losses.divergence` against a cached background: the divergence of the bucketed distributions
    (the background's top-k tokens, and every other token lumped into one tail bucket).

    Exact when ``background.k`` equals the vocabulary; otherwise a lower bound that grows with ``k``.

    Args:
        expert_logits: ``[N, V]`` expert logits (gradients flow here).
        background: ``N`` positions of the background (`BackgroundTopK`), holding ``temperature``.
        kind: one of ``CACHE_KINDS``.
        beta, temperature: as in :func:`losses.divergence`.

    Returns:
        float32 ``[N]``.
    """
    check_divergence_args(kind, beta, temperature)
    if not divergence_spec(kind).cacheable:
        raise ValueError(f"divergence kind {kind!r} cannot use the background cache (it is not registered "
                         f"cacheable: it needs the background's log-prob of every token); cached kinds: {', '.join(CACHE_KINDS)}")
    if expert_logits.dim() != 2 or expert_logits.shape[0] != len(background) \
            or expert_logits.shape[-1] != background.vocab_size:
        raise ValueError(f"expert_logits {tuple(expert_logits.shape)} do not match the cached background's "
                         f"[{len(background)}, {background.vocab_size}]")
    background = background.to(expert_logits.device)
    lp_i = (expert_logits.float() / temperature).log_softmax(-1)
    ids = background.ids.long()
    top_b, rest_b = background.logprobs(temperature)
    top_i = lp_i.gather(-1, ids)
    if background.k == background.vocab_size:  # no tail: the same categories, permuted
        return logprob_divergence(top_i, top_b, kind, beta=beta)
    rest_i = lp_i.scatter(-1, ids, float("-inf")).logsumexp(-1)
    buckets_i = torch.cat([top_i, rest_i.unsqueeze(-1)], dim=-1)
    buckets_b = torch.cat([top_b, rest_b.unsqueeze(-1)], dim=-1)
    return logprob_divergence(buckets_i, buckets_b, kind, beta=beta)


class BackgroundCache:
    """Cached background distributions, one `BackgroundTopK` per key (a dataset row and its corruption variant).

    Entries live on the CPU (their positions in the row's order); `gather` returns a batch's on any device.

    Args:
        top_k: tokens kept per position.
        temperatures: the temperatures entries are read at (the regularizer's, and 1 for logged KLs).
    """

    def __init__(self, top_k: int, temperatures: Sequence[float] = (1.0,)) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"background cache top_k must be an integer >= 1, got {top_k!r}")
        self.top_k = top_k
        self.temperatures = tuple(dict.fromkeys(float(t) for t in temperatures))
        self._entries: dict[Hashable, BackgroundTopK] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def missing(self, keys: Sequence[Hashable]) -> list[int]:
        """Indices of ``keys`` that have no entry yet."""
        return [i for i, key in enumerate(keys) if key not in self._entries]

    def add(self, keys: Sequence[Hashable], logits: Tensor, counts: Sequence[int]) -> None:
        """Store the background ``logits [sum(counts), V]``: ``counts[i]`` consecutive positions for ``keys[i]``."""
        if len(keys) != len(counts) or logits.shape[0] != sum(counts):
            raise ValueError(f"BackgroundCache.add: {len(keys)} keys, {len(counts)} counts and {logits.shape[0]} "
                             "positions do not match")
        entries = BackgroundTopK.from_logits(logits, self.top_k, self.temperatures).to("cpu").split(counts)
        self._entries.update(zip(keys, entries, strict=True))

    def gather(self, keys: Sequence[Hashable], device: torch.device | str = "cpu") -> BackgroundTopK:
        """The entries of ``keys``, one after the other, on ``device``."""
        missing = self.missing(keys)
        if missing:
            raise KeyError(f"background cache has no entry for {keys[missing[0]]!r}")
        return BackgroundTopK.cat([self._entries[key] for key in keys]).to(device)

    def nbytes(self) -> int:
        """Bytes held by the entries."""
        return sum(t.numel() * t.element_size() for e in self._entries.values() for t in (e.ids, e.logits, e.rest))
