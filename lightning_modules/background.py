"""The background model: plain next-token NLL on the background's (general) data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
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
        position_jump: 0, or the largest random jump of the position ids at each training row's output
            (`jumped_position_ids`): a random position offset of the output, so that no fixed distance between an
            input and its output can be learned (README, "Length generalization"). Validation uses plain positions.

    Validation logs `val/nll` (mean over target tokens) and `val/teacher_forced_exact_match` (fraction of rows
    whose every target is the argmax), torchmetrics that reduce across the ranks of a distributed run.
    """

    def __init__(self, model: PreTrainedModel, lr: float = 3e-3, weight_decay: float = 0.0,
                 warmup_ratio: float = 0.1, max_steps: int = 1000, position_jump: int = 0) -> None:
        super().__init__()
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        self.val_nll, self.val_exact_match = MeanMetric(), MeanMetric()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        positions = None
        if self.hparams.position_jump:
            positions = jumped_position_ids(batch["output_start"], batch["input_ids"].shape[1],
                                            self.hparams.position_jump).to(batch["input_ids"].device)
        loss = task_nll(self(batch["input_ids"], batch["attention_mask"], positions), batch["targets"])
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


def jumped_position_ids(output_start: Tensor, width: int, max_jump: int,
                        generator: torch.Generator | None = None) -> Tensor:
    """Position ids `[B, width]` that jump at each row's output: `0, 1, ..., width - 1`, plus a jump `d` drawn
    uniformly in `[0, max_jump]` per row from the token before the output on (`output_start - 1`, the separator of
    the letter task's `<bos> x <sep> y <eos>`), so the distance from an input token to the output that copies it is
    random in training, while decoding sees `d = 0`.

    Args:
        output_start: `[B]` index of each row's first output token (task rows, `data.tasks.base`).
        width: the batch's padded length `T`.
        max_jump: the largest jump (>= 0).
        generator: the RNG of the draws (default: torch's global one, which Lightning seeds).
    """
    if max_jump < 0:
        raise ValueError(f"max_jump must be >= 0, got {max_jump}")
    jump = torch.randint(0, max_jump + 1, (output_start.shape[0], 1), generator=generator)
    positions = torch.arange(width).expand(output_start.shape[0], width)
    return positions + jump * (positions >= output_start.cpu().unsqueeze(1) - 1)
