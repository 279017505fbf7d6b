"""A training row order that a resumed run can rejoin exactly. No Lightning here (`data.datamodule` uses it).

A training stage's data is a pure function of the seed and of how many batches were consumed: epoch `e` visits
the rows in the order `randperm(n)` drawn from `derive_seed(seed, rows, "shuffle", e)`, and the prefix
corruption of each batch draws from a generator seeded with `derive_seed(seed, rows, "corrupt", e, position)`
(the position in that order of the batch's first row), not from the global RNG. A run resumed after `g`
batches therefore starts at batch `g` and sees the batches, corruption included, that the uninterrupted run
saw from there on, whatever else drew random numbers in between and however many worker processes collate.
`ResumableLoader` puts the three together and tells Lightning where to start again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from data.splits import derive_seed

Key = tuple[int, int, int]  # (epoch, position in the epoch's order, row index)


class ResumableSampler(DistributedSampler):
    """Row keys `(epoch, position, row)` of a training stage, starting at a given epoch and position.

    Each epoch is a fresh permutation (seeded by the epoch number alone); one iteration yields the rest of the
    current epoch, and the next iteration starts the next epoch once the epoch's last row has been handed out
    (an iteration that never started changes nothing). The epoch is the sampler's own count: `set_epoch` is a
    no-op (Lightning calls it after the first `iter` of a resumed fit, with its own epoch number).

    Ranks: with `num_replicas = W`, the epoch's order is padded (cyclically, as `DistributedSampler` does) to a
    multiple of `W` and rank `r` takes positions `r, r + W, ...`. It is a `DistributedSampler` so that
    Lightning leaves it in place under DDP rather than wrapping it in another one.

    Args:
        n_rows: rows in the dataset.
        seed: the run's seed.
        label: names the row set (`background`, `experts`); enters the seeds.
        num_replicas, rank: the data-parallel world (1 and 0 in a single process).
    """

    def __init__(self, n_rows: int, seed: int, label: str = "", num_replicas: int = 1, rank: int = 0) -> None:
        if n_rows < 1:
            raise ValueError(f"ResumableSampler needs at least one row, got n_rows={n_rows}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside the world of {num_replicas} replica(s)")
        # (DistributedSampler.__init__ wants the dataset itself; these are the attributes it would set.)
        self.n_rows, self.seed, self.label = n_rows, seed, label
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = math.ceil(n_rows / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle, self.drop_last = True, False
        self.epoch, self.start = 0, 0

    def resume(self, epoch: int, start: int) -> None:
        """Continue at this rank's `start`-th row of `epoch` (0 <= start <= len(self))."""
        if epoch < 0 or not 0 <= start <= self.num_samples:
            raise ValueError(f"cannot resume at epoch {epoch}, row {start} of {self.num_samples}")
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> list[int]:
        """Row indices of `epoch`, padded to `total_size` (every rank's positions)."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.label, "shuffle", epoch))
        order = torch.randperm(self.n_rows, generator=generator).tolist()
        while len(order) < self.total_size:
            order += order[: self.total_size - len(order)]
        return order

    def __iter__(self) -> Iterator[Key]:
        epoch, start = self.epoch, self.start
        order = self.order(epoch)
        for j in range(start, self.num_samples):
            if j == self.num_samples - 1:  # the epoch's last row is handed out: the next iteration is a new epoch
                self.epoch, self.start = epoch + 1, 0
            position = j * self.num_replicas + self.rank
            yield epoch, position, order[position]

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        pass


class KeyedRows(Dataset):
    """`dataset` indexed by the sampler's keys: `rows[(epoch, position, i)]` is `(key, dataset[i])`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> tuple[Key, dict]:
        return key, self.dataset[key[2]]

    def __getitems__(self, keys: Sequence[Key]) -> list[tuple[Key, dict]]:
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems([k[2] for k in keys]) if getitems else [self.dataset[k[2]] for k in keys]
        return list(zip(keys, rows, strict=True))


class SeededCollate:
    """Collate keyed rows with `collator`, its corruption drawn from a generator seeded by the batch's first
    key: the same batch is corrupted the same way in any process, at any time.

    With `variants = n`, each row is corrupted from its own generator, seeded by (row, epoch mod n): a row has
    `n` corrupted versions, whatever batch it lands in, and the batch says which one it holds in two extra
    columns, `row_index` (the row's index in the dataset) and `corruption_variant` (0 when the collator does not
    corrupt). That pair is a key for what depends only on the corrupted input (the background's cached
    distributions, `losses.background_cache`).

    Args:
        collator: a task's collator (`data.collate.Collator` or one holding one as `.corrupting`): its
            `generator` attribute is set for each batch.
        seed: the run's seed.
        label: names the row set; enters the seed.
        variants: corrupted versions per row (None: one generator per batch, a fresh corruption every epoch).
    """

    def __init__(self, collator: Callable[[list[dict]], dict], seed: int, label: str = "",
                 variants: int | None = None) -> None:
        if variants is not None and (not isinstance(variants, int) or isinstance(variants, bool) or variants < 1):
            raise ValueError(f"corruption variants must be an integer >= 1 or None, got {variants!r}")
        self.collator, self.seed, self.label, self.variants = collator, seed, label, variants
        self._targets = [c for c in (collator, getattr(collator, "corrupting", None)) if hasattr(c, "generator")]
        if not self._targets:
            raise ValueError(f"{type(collator).__name__} has no `generator` to seed")
        self._corrupts = any(getattr(c, "high", 0.0) > 0.0 for c in self._targets)

    def __call__(self, items: list[tuple[Key, dict]]) -> dict:
        keys, rows = zip(*items, strict=True)
        if self.variants is not None:
            return self._per_row(keys, list(rows))
        epoch, position, _ = keys[0]
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.label, "corrupt", epoch, position))
        for target in self._targets:
            target.generator = generator
        return self.collator(list(rows))

    def _per_row(self, keys: Sequence[Key], rows: list[dict]) -> dict:
        variants = [epoch % self.variants if self._corrupts else 0 for epoch, _, _ in keys]
        if self._corrupts:
            generators = [torch.Generator().manual_seed(derive_seed(self.seed, self.label, "corrupt-row", row, v))
                          for (_, _, row), v in zip(keys, variants, strict=True)]
            for target in self._targets:
                target.generator = generators
        batch = self.collator(rows)
        batch["row_index"] = torch.tensor([row for _, _, row in keys], dtype=torch.long)
        batch["corruption_variant"] = torch.tensor(variants, dtype=torch.long)
        return batch


class ResumableLoader(DataLoader):
    """The training loader of a stage: `ResumableSampler` order, `SeededCollate` corruption, resumable.

    It follows Lightning's stateful-loader protocol: `state_dict()` is saved with every checkpoint and
    `load_state_dict()` is called when a fit resumes, before the loader is iterated. The state is the number of
    batches consumed so far, asked of `consumed` (the trainer's optimizer steps, one batch each), not counted
    here: loaders fetch ahead of what training has consumed.

    Args:
        dataset: the training rows.
        collator: the task's collator, with its corruption.
        batch_size: rows per batch (per rank).
        seed, label: seed the order and the corruption.
        num_replicas, rank: the data-parallel world.
        consumed: returns how many batches training has consumed (None: 0).
        num_workers: DataLoader workers.
        corruption_variants: corrupted versions per row (`SeededCollate`; None: a fresh corruption every epoch).
    """

    def __init__(self, dataset: Any, collator: Callable[[list[dict]], dict], batch_size: int, seed: int,
                 label: str = "", num_replicas: int = 1, rank: int = 0, consumed: Callable[[], int] | None = None,
                 num_workers: int = 0, corruption_variants: int | None = None) -> None:
        super().__init__(KeyedRows(dataset), batch_size=batch_size,
                         sampler=ResumableSampler(len(dataset), seed, label, num_replicas, rank),
                         collate_fn=SeededCollate(collator, seed, label, corruption_variants), num_workers=num_workers,
                         persistent_workers=num_workers > 0)
        self.consumed = consumed

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(self.consumed()) if self.consumed is not None else 0}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.resume(int(state_dict["batches"]))

    def resume(self, batches: int) -> None:
        """Start at the stage's batch `batches` (0-based: the first one not yet trained on)."""
        epoch, batch = divmod(batches, len(self))
        self.sampler.resume(epoch, batch * self.batch_size)
