"""The LightningDataModule over a task's rows (the only Lightning code under `data/`)."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from data.collate import CorruptionRate
from data.sampler import ResumableLoader
from data.tasks.base import Task


class TaskDataModule(pl.LightningDataModule):
    """Loaders over `task.background_dataset` (`rows="background"`) or `task.expert_dataset` (`"experts"`).

    Args:
        task: the task supplying rows and the collator.
        rows: which rows: `background` or `experts`.
        batch_size: rows per batch (all loaders).
        corruption_prob: prefix corruption of training batches, a rate or `(low, high)` (`data.collate.Collator`;
            validation and test batches are clean).
        num_workers: DataLoader workers.
        seed: seeds the training order and its corruption (`data.sampler`).
        corruption_variants: None (default): training batches are corrupted afresh every epoch; `n`: each row has
            `n` corrupted versions (seeded by row and epoch mod n) and training batches carry `row_index` and
            `corruption_variant` (`data.sampler.SeededCollate`), the key of the background cache.

    Resuming: training batch `n` of a stage is a pure function of (seed, n), and the training loader
    (`data.sampler.ResumableLoader`) saves in every checkpoint how many batches the trainer has consumed (its
    optimizer steps: one batch each, no gradient accumulation), so a resumed fit starts at the next batch.
    """

    def __init__(self, task: Task, rows: str, batch_size: int = 64, corruption_prob: CorruptionRate = 0.0,
                 num_workers: int = 0, seed: int = 0, corruption_variants: int | None = None) -> None:
        super().__init__()
        if rows not in ("background", "experts"):
            raise ValueError(f"rows must be 'background' or 'experts', got {rows!r}")
        self.task, self.rows = task, rows
        self.batch_size, self.corruption_prob, self.num_workers, self.seed = batch_size, corruption_prob, num_workers, seed
        self.corruption_variants = corruption_variants

    def dataset(self, split: str):
        return self.task.background_dataset(split) if self.rows == "background" else self.task.expert_dataset(split)

    def _loader(self, split: str) -> DataLoader:
        return DataLoader(
            self.dataset(split), batch_size=self.batch_size, collate_fn=self.task.collator(0.0),
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> ResumableLoader:
        """Shuffled training batches with prefix corruption; a resumed fit continues where it stopped."""
        trainer = self.trainer
        return ResumableLoader(
            self.dataset("train"), self.task.collator(self.corruption_prob), self.batch_size, self.seed, self.rows,
            num_replicas=trainer.world_size if trainer is not None else 1,
            rank=trainer.global_rank if trainer is not None else 0,
            consumed=(lambda: trainer.global_step) if trainer is not None else None, num_workers=self.num_workers,
            corruption_variants=self.corruption_variants,
        )

    def val_dataloader(self) -> DataLoader:
        """Clean validation batches, in order."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Clean test batches, in order."""
        return self._loader("test")
