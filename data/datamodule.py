"""The LightningDataModule over a task's rows (the only Lightning code under `data/`)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from data.splits import derive_seed
from data.tasks.base import Task


class TaskDataModule(pl.LightningDataModule):
    """Loaders over `task.background_dataset` (`rows="background"`) or `task.expert_dataset` (`"experts"`).

    Args:
        task: the task supplying rows and the collator.
        rows: which rows: `background` or `experts`.
        batch_size: rows per batch (all loaders).
        corruption_prob: prefix corruption of training batches (validation and test batches are clean).
        num_workers: DataLoader workers.
        seed: seeds the training shuffle.
    """

    def __init__(self, task: Task, rows: str, batch_size: int = 64, corruption_prob: float = 0.0,
                 num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if rows not in ("background", "experts"):
            raise ValueError(f"rows must be 'background' or 'experts', got {rows!r}")
        self.task, self.rows = task, rows
        self.batch_size, self.corruption_prob, self.num_workers, self.seed = batch_size, corruption_prob, num_workers, seed

    def dataset(self, split: str):
        return self.task.background_dataset(split) if self.rows == "background" else self.task.expert_dataset(split)

    def _loader(self, split: str) -> DataLoader:
        train = split == "train"
        return DataLoader(
            self.dataset(split), batch_size=self.batch_size, shuffle=train,
            collate_fn=self.task.collator(self.corruption_prob if train else 0.0),
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(derive_seed(self.seed, "shuffle")) if train else None,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches with prefix corruption."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """Clean validation batches, in order."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Clean test batches, in order."""
        return self._loader("test")
