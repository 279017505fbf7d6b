"""The task NLL and the off-mask regularizer computed block by block of positions (`expert.loss_chunk_size`).

`task_nll` and `off_mask_divergence` take `[B, T, V]` logits of the expert and of the background: at a large
vocabulary and long rows those, their float32 log-softmaxes and their gradient are the peak of a training step.
Here the models' bodies run once (the inputs of their output heads, `[B, T, d]`); each block of `chunk` positions
then runs the heads and sums its positions' losses under `torch.utils.checkpoint`, so that backward recomputes a
block's logits instead of keeping them: at most ~`B·chunk·V` logits (and their temporaries) exist at a time.

Sums are kept per row (`[terms, B]`): a loss is a sum over rows divided by a count of positions, as the plain
functions normalise, and per-expert metrics are sums over that expert's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from losses.divergences import divergence

Head = Callable[[Tensor], Tensor]  # an output head: hidden states [B, c, d] -> logits [B, c, V]


@dataclass(frozen=True)
class RowSum:
    """One quantity summed per row over `positions` (`[B, T]` bool): the expert's NLL of `targets` (when
    `divergence` is None), else `losses.divergence(kind=divergence, beta, temperature)` against the background
    (`targets`, when given, its `written` tokens);
    each position's value times `weight` (`[B, T]`) when given. `grad=False`: a metric only (computed without a
    graph)."""

    positions: Tensor
    targets: Tensor | None = None
    weight: Tensor | None = None
    divergence: str | None = None
    beta: float = 0.5
    temperature: float = 1.0
    grad: bool = True

    def part(self, rows: Tensor | None = None, block: slice | None = None) -> RowSum:
        """The term restricted to `rows` (an index tensor) and to the positions of `block`."""
        def pick(t: Tensor | None) -> Tensor | None:
            if t is not None and rows is not None:
                t = t[rows]
            return t if t is None or block is None else t[:, block]

        return replace(self, positions=pick(self.positions), targets=pick(self.targets), weight=pick(self.weight))


def row_sums(expert_logits: Tensor, background_logits: Tensor | None, terms: Sequence[RowSum]) -> Tensor:
    """float32 `[len(terms), B]`: each term summed over its positions in each row (`expert_logits [B, c, V]`,
    `background_logits` alike or None when no term is a divergence; the terms' tensors `[B, c]`)."""
    sums = []
    for term in terms:
        with torch.set_grad_enabled(term.grad and torch.is_grad_enabled()):
            keep = term.positions
            if term.divergence is None:  # as `task_nll`: float32 cross-entropy
                values = F.cross_entropy(expert_logits[keep].float(), term.targets[keep], reduction="none")
            else:  # as `off_mask_divergence`
                values = divergence(expert_logits[keep], background_logits[keep], term.divergence,
                                    beta=term.beta, temperature=term.temperature,
                                    written=None if term.targets is None else term.targets[keep])
            if term.weight is not None:
                values = values * term.weight[keep].to(values)
            row = keep.nonzero(as_tuple=True)[0]
            sums.append(values.new_zeros(keep.shape[0]).index_add(0, row, values))
    return torch.stack(sums)


def chunked_row_sums(expert_head: Head, expert_hidden: Tensor, background_head: Head | None,
                     background_hidden: Tensor | None, terms: Sequence[RowSum], chunk: int) -> Tensor:
    """`row_sums` of the logits `expert_head(expert_hidden)` (and the background's), block by block of `chunk`
    positions, each block under a non-reentrant checkpoint (backward runs its heads again).

    Args:
        expert_head, expert_hidden: the expert's output head and its input `[B, T, d]` (gradients flow to both).
        background_head, background_hidden: the background's (run without a graph), or None when no term is a
            divergence.
        terms: the quantities to sum, their tensors `[B, T]`.
        chunk: positions per block (>= 1).

    Returns:
        float32 `[len(terms), B]`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    length = expert_hidden.shape[1]
    used = torch.stack([t.positions for t in terms]).any(0).any(0).tolist()  # [T]: any term counts here
    blocks = [slice(s, min(s + chunk, length)) for s in range(0, length, chunk)]
    # A block with no counted position adds nothing: skip it, but keep one so that the sums stay attached to the
    # graph (zero gradients, as the plain losses' zeros give) when no position counts at all.
    blocks = [b for b in blocks if any(used[b])] or blocks[:1]
    total = None
    for block in blocks:
        background = None if background_hidden is None else background_hidden[:, block]
        sums = checkpoint(_block_row_sums, expert_head, background_head, expert_hidden[:, block], background,
                          [t.part(block=block) for t in terms], use_reentrant=False)
        total = sums if total is None else total + sums
    return total


def _block_row_sums(expert_head: Head, background_head: Head | None, expert_hidden: Tensor,
                    background_hidden: Tensor | None, terms: Sequence[RowSum]) -> Tensor:
    """One block's `row_sums`, from the heads' inputs (what the checkpoint runs, and runs again in backward)."""
    background = None
    if background_hidden is not None:
        with torch.no_grad():  # the background is a constant of the loss
            background = background_head(background_hidden)
    return row_sums(expert_head(expert_hidden), background, terms)
