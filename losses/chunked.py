"""The task NLL and the off-mask regularizer computed block by block of positions (`expert.loss_chunk_size`).

`task_nll` and `off_mask_divergence` take `[B, T, V]` logits of the expert and of the background: at a large
vocabulary and long rows those, their float32 log-softmaxes and their gradient are the peak of a training step.
Here the models' bodies run once (the inputs of their output heads, `[B, T, d]`); the positions some loss counts
are gathered (a prompt's positions never reach a head), and each block of `B·chunk` of them runs the heads and sums
its positions' losses under `torch.utils.checkpoint`, so that backward recomputes a block's logits instead of
keeping them: at most ~`B·chunk·V` logits (and their temporaries) exist at a time.

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

Head = Callable[[Tensor, Tensor], Tensor]
"""An output head: `head(hidden [n, c, d], rows [n])` -> logits `[n, c, V]`; `rows` says which row of the batch
each of the `n` came from (a head that differs per row, a LoRA-wrapped one under mixed adapters, needs it)."""


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

    def part(self, rows: Tensor) -> RowSum:
        """The term restricted to `rows` (an index tensor)."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

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
    """`row_sums` of the logits `expert_head(expert_hidden)` (and the background's), computed only at the positions
    some term counts, `B·chunk` of them at a time, each block under a non-reentrant checkpoint (backward runs its
    heads again).

    The heads see only the counted positions: the prompt's positions and the padding (most of a row whose answer
    is one line) never reach them. Gathered, each position is a row of one position to `row_sums`, and its sums go
    back to its row.

    Args:
        expert_head, expert_hidden: the expert's output head and its input `[B, T, d]` (gradients flow to both).
        background_head, background_hidden: the background's (run without a graph), or None when no term is a
            divergence.
        terms: the quantities to sum, their tensors `[B, T]`.
        chunk: positions per row per block (>= 1): a block holds the logits of `B·chunk` positions.

    Returns:
        float32 `[len(terms), B]`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    batch = expert_hidden.shape[0]
    rows, cols = torch.stack([t.positions for t in terms]).any(0).nonzero(as_tuple=True)
    if rows.numel() == 0:  # nothing counts: one position keeps the sums attached to the graph (zero gradients)
        rows = cols = rows.new_zeros(1)
    total = expert_hidden.new_zeros(len(terms), batch, dtype=torch.float32)
    step = batch * chunk
    for s in range(0, rows.numel(), step):
        r, c = rows[s:s + step], cols[s:s + step]
        background = None if background_hidden is None else background_hidden[r, c].unsqueeze(1)
        sums = checkpoint(_block_row_sums, expert_head, background_head, expert_hidden[r, c].unsqueeze(1),
                          background, r, [_gathered(t, r, c) for t in terms], use_reentrant=False)
        total = total.index_add(1, r, sums)
    return total


def _gathered(term: RowSum, rows: Tensor, cols: Tensor) -> RowSum:
    """`term` at the positions `(rows[j], cols[j])`, each one a row of one position (`[n, 1]` tensors)."""
    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[rows, cols].unsqueeze(1)

    return replace(term, positions=pick(term.positions), targets=pick(term.targets), weight=pick(term.weight))


def _block_row_sums(expert_head: Head, background_head: Head | None, expert_hidden: Tensor,
                    background_hidden: Tensor | None, rows: Tensor, terms: Sequence[RowSum]) -> Tensor:
    """One block's `row_sums`, from the heads' inputs (what the checkpoint runs, and runs again in backward)."""
    background = None
    if background_hidden is not None:
        with torch.no_grad():  # the background is a constant of the loss
            background = background_head(background_hidden, rows)
    return row_sums(expert_head(expert_hidden, rows), background, terms)
