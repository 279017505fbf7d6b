"""Batching task rows: padding, and prefix corruption (docs/method.md, prefixes the composition writes). No Lightning here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from losses import IGNORE_INDEX

# Columns with one integer per token besides input_ids/targets/masks (padded with 0 to [B, T]).
PER_TOKEN_COLUMNS = ("after_close", "inside_foreign", "at_open")
CorruptionRate = float | Sequence[float]  # a rate, or (low, high): a rate per row drawn uniformly in that range


def corruption_range(rate: CorruptionRate) -> tuple[float, float]:
    """`(low, high)` of a corruption rate (`Collator`): a number `p` is `(p, p)`. Raises `ValueError` unless it is a
    number in [0, 1] or a pair with 0 <= low <= high <= 1 (a config's `[low, high]` list included)."""
    number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)  # noqa: E731
    pair = (rate, rate) if number(rate) else tuple(rate) if isinstance(rate, Sequence) and not isinstance(rate, str) else ()
    if len(pair) != 2 or not all(map(number, pair)) or not 0.0 <= pair[0] <= pair[1] <= 1.0:
        raise ValueError(f"corruption_prob must be in [0, 1] (a rate, or [low, high] with low <= high), got {rate}")
    return float(pair[0]), float(pair[1])


class Collator:
    """Pad task rows (`data.tasks.base`) into a batch, optionally corrupting teacher-forced outputs.

    Output (`B` rows, `T` = longest row, right padding): `input_ids` `[B, T]` (pad id), `attention_mask`
    `[B, T]`, `targets` `[B, T]` (`-100` on padding), `masks` bool `[B, k, T]` (False on padding), each column
    of `PER_TOKEN_COLUMNS` (one integer per token: `after_close`) as `[B, T]` (0 on padding), and every other
    numeric column (`expert_index`, `is_task`, `output_start`, ...) as a `[B]` tensor. String columns are dropped.

    Prefix corruption: each token of a row's output span (`output_start .. output_start + output_len - 1`)
    is replaced with probability `corruption_prob` by a uniformly drawn *different* token of
    `corruption_ids` (a token outside that set by any token of it), so for outputs drawn from the set
    `corruption_prob` is exactly the expected fraction of changed tokens. A pair `(low, high)` draws each
    row's rate uniformly in `[low, high]`: light and heavy edit rates in one batch, as a k-way composition
    writes them (docs/results/separate.md). `targets` stay clean. Draws come
    from `generator` (default: torch's global RNG, which Lightning's `seed_everything` seeds and DataLoader
    workers reseed per worker); a list of generators, one per row, draws each row's corruption from its own
    (`data.sampler.SeededCollate` with `variants`): a row is then corrupted the same way in any batch.

    Args:
        pad_token_id: the id padding `input_ids`.
        corruption_ids: the tokens corruption draws from (letters, or a tokenizer's non-special tokens).
        corruption_prob: a rate in [0, 1] (0 disables corruption), or `(low, high)` with 0 <= low <= high <= 1:
            a rate per row, uniform in that range.
        generator: an explicit `torch.Generator` for the draws, or one per row of the next batch.
    """

    def __init__(self, pad_token_id: int, corruption_ids: Sequence[int] = (), corruption_prob: CorruptionRate = 0.0,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None) -> None:
        self.low, self.high = corruption_range(corruption_prob)
        if self.high > 0 and not corruption_ids:
            raise ValueError("prefix corruption needs corruption_ids (the tokens it may write)")
        self.pad_token_id = int(pad_token_id)
        self.generator = generator
        self.corruption_ids = torch.tensor(list(corruption_ids), dtype=torch.long)
        size = int(self.corruption_ids.max()) + 1 if len(self.corruption_ids) else 0
        self._index = torch.full((size,), -1, dtype=torch.long)
        self._index[self.corruption_ids] = torch.arange(len(self.corruption_ids))

    @property
    def corruption_prob(self) -> CorruptionRate:
        """The rate, or `(low, high)` when rows draw their own."""
        return self.low if self.low == self.high else (self.low, self.high)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        if not rows:
            raise ValueError("Collator got an empty list of rows")
        lengths = [len(row["input_ids"]) for row in rows]
        bsz, width = len(rows), max(lengths)
        k = len(rows[0]["masks"])
        input_ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, width), dtype=torch.long)
        targets = torch.full((bsz, width), IGNORE_INDEX, dtype=torch.long)
        masks = torch.zeros((bsz, k, width), dtype=torch.bool)
        for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            if len(row["masks"]) != k:
                raise ValueError(f"rows in one batch have different numbers of masks: row 0 has k={k}, "
                                 f"row {b} has k={len(row['masks'])} (do not mix datasets of different experts)")
            if len(row["targets"]) != n:
                raise ValueError(f"row {b}: targets length {len(row['targets'])} != input_ids length {n}")
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[b, :n] = 1
            targets[b, :n] = torch.as_tensor(row["targets"], dtype=torch.long)
            if k:
                masks[b, :, :n] = torch.as_tensor(row["masks"]).reshape(k, n).bool()
        batch: dict[str, Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask,
                                    "targets": targets, "masks": masks}
        for key, value in rows[0].items():
            if key in batch or isinstance(value, str):
                continue
            if key in PER_TOKEN_COLUMNS:
                batch[key] = self._pad_per_token(rows, key, lengths, width)
                continue
            if isinstance(value, Tensor) and value.dim() == 0:
                value = value.item()
            if not isinstance(value, int | float):
                raise ValueError(f"column {key!r} is neither a sequence column nor a scalar: {value!r}")
            try:
                values = [row[key] for row in rows]
            except KeyError as err:
                raise ValueError(f"column {key!r} is missing from some rows of the batch") from err
            batch[key] = torch.as_tensor(values, dtype=torch.float32 if isinstance(value, float) else torch.long)
        if self.high > 0.0:
            self._corrupt(batch)
        return batch

    @staticmethod
    def _pad_per_token(rows: list[dict[str, Any]], key: str, lengths: list[int], width: int) -> Tensor:
        """A column with one integer per token (as `after_close`), right-padded with 0 to `[B, T]`."""
        out = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            if key not in row or len(row[key]) != n:
                raise ValueError(f"row {b}: column {key!r} needs one value per token ({n})")
            out[b, :n] = torch.as_tensor(row[key], dtype=torch.long)
        return out

    def _corrupt(self, batch: dict[str, Tensor]) -> None:
        if "output_start" not in batch or "output_len" not in batch:
            raise ValueError("prefix corruption needs the output_start and output_len columns")
        input_ids = batch["input_ids"]
        if isinstance(self.generator, Sequence):
            self._corrupt_rows(input_ids, batch["output_start"], batch["output_len"], self.generator)
            return
        pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
        start = batch["output_start"].unsqueeze(1)
        in_output = (pos >= start) & (pos < start + batch["output_len"].unsqueeze(1))
        rate = self.low
        if self.high > self.low:  # one rate per row
            rate = self.low + (self.high - self.low) * torch.rand((input_ids.shape[0], 1), generator=self.generator)
        chosen = in_output & (torch.rand(input_ids.shape, generator=self.generator) < rate)
        input_ids[chosen] = self._replace(input_ids[chosen], self.generator)

    def _corrupt_rows(self, input_ids: Tensor, starts: Tensor, lengths: Tensor,
                      generators: Sequence[torch.Generator]) -> None:
        """Corrupt each row's output span from its own generator (the draws do not depend on the batch)."""
        if len(generators) != input_ids.shape[0]:
            raise ValueError(f"{len(generators)} generators for a batch of {input_ids.shape[0]} rows")
        for b, (start, n, generator) in enumerate(zip(starts.tolist(), lengths.tolist(), generators, strict=True)):
            rate = self.low
            if self.high > self.low:
                rate = self.low + (self.high - self.low) * float(torch.rand((), generator=generator))
            span = input_ids[b, start:start + n]
            chosen = torch.rand(span.shape, generator=generator) < rate
            if chosen.any():
                span[chosen] = self._replace(span[chosen], generator)

    def _replace(self, ids: Tensor, generator: torch.Generator | None) -> Tensor:
        """New tokens for `ids`: a uniformly drawn *different* token of the set, any token of it for one outside."""
        known = ids < len(self._index)
        current = torch.full_like(ids, -1)
        current[known] = self._index[ids[known]]
        n = len(self.corruption_ids)
        new = ids.clone()
        if n > 1:  # a token of the set: a uniformly drawn *different* one
            shift = torch.randint(1, n, current.shape, generator=generator)
            new = self.corruption_ids[(current + shift) % n]
        outside = current < 0
        if outside.any():  # a token outside the set: any token of it (drawn only when there are such tokens)
            new[outside] = self.corruption_ids[torch.randint(0, n, (int(outside.sum()),), generator=generator)]
        return new
