"""The background model: plain next-token NLL on the background's (general) data."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lightning_modules.optim import adamw_with_schedule
from losses import IGNORE_INDEX, task_nll


class BackgroundLM(pl.LightningModule):
    """Trains a causal LM with next-token NLL on batches of `input_ids`, `attention_mask`, shifted `targets`.

    Args:
        model: the HF causal LM (from scratch or pretrained).
        lr, weight_decay, warmup_ratio: AdamW and its warm-up/cosine schedule.
        max_steps: length of the schedule (the Trainer's `max_steps`).

    Validation logs `val/nll` (mean over target tokens) and `val/teacher_forced_exact_match` (fraction of rows
    whose every target is the argmax), torchmetrics that reduce across the ranks of a distributed run.
    """

    def __init__(self, model: PreTrainedModel, lr: float = 3e-3, weight_decay: float = 0.0,
                 warmup_ratio: float = 0.1, max_steps: int = 1000) -> None:
        super().__init__()
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        self.val_nll, self.val_exact_match = MeanMetric(), MeanMetric()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = task_nll(self(batch["input_ids"], batch["attention_mask"]), batch["targets"])
        self.log("train/nll", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"])
        targets = batch["targets"]
        valid = targets != IGNORE_INDEX
        self.val_nll.update(task_nll(logits, targets), weight=valid.sum())  # token-weighted
        self.val_exact_match.update(((logits.argmax(-1) == targets) | ~valid).all(-1).float())
        self.log("val/nll", self.val_nll, prog_bar=True)
        self.log("val/teacher_forced_exact_match", self.val_exact_match)

    def configure_optimizers(self) -> dict:
        h = self.hparams
        return adamw_with_schedule(self.model.parameters(), h.lr, h.weight_decay, h.warmup_ratio, h.max_steps)
