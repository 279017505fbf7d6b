"""The background model: plain next-token NLL on the background's (general) data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from compose.positions import model_position_ids
from lightning_modules.optim import adamw_with_schedule
from losses import IGNORE_INDEX, task_nll


class BackgroundLM(pl.LightningModule):
    """Trains a causal LM with next-token NLL on batches of `input_ids`, `attention_mask`, shifted `targets`.

    Args:
        model: the HF causal LM (from scratch or pretrained).
        lr, weight_decay, warmup_ratio: AdamW and its warm-up/cosine schedule.
        max_steps: length of the schedule (the Trainer's `max_steps`).
        position_jump: 0, or the largest random jump of each training row's position ids
            (`training_position_ids`; docs/results/length.md). Validation uses the model's own positions.

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
        if position_ids is None:  # the model's own (`compose.positions.model_position_ids`)
            position_ids = model_position_ids(self.model, input_ids, attention_mask)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        positions = training_position_ids(self.model, batch, self.hparams.position_jump)
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


def training_position_ids(model: torch.nn.Module, batch: dict[str, Tensor], max_jump: int) -> Tensor | None:
    """Position ids of a training batch: the model's own (`compose.positions.model_position_ids`; None: its default),
    randomized when `max_jump > 0`.

    Plain positions jump by a random `d` in `[0, max_jump]` from the separator on (`jumped_position_ids`): the
    distance from an input token to the output that copies it varies. Coupled positions (`coupled_position_ids`)
    spread the input over random slots of `[1, len(x) + 1 + max_jump]`, the output following: the step that predicts
    `y_t` stays one position before `x_t`, while every other distance (to `<bos>`, to the separator, between input
    tokens) varies, so none of them can stand in for the length.
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    positions = model_position_ids(model, ids, attn)
    if not max_jump:
        return positions
    if positions is None:
        plain = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return jumped_position_ids(batch["output_start"] - 1, plain, max_jump).to(ids.device)
    return coupled_position_ids(batch["output_start"], ids.shape[1], max_jump).to(ids.device)


def coupled_position_ids(output_start: Tensor, width: int, max_jump: int,
                         generator: torch.Generator | None = None) -> Tensor:
    """Coupled position ids `[B, width]` of rows `<bos> x <sep> y ...` (right-padded) with random slots: per row,
    `L + 1` sorted distinct slots `s_1 < ... < s_{L+1}` drawn from `[1, L + 1 + max_jump]` (`L = len(x)`); `<bos>` at
    0, `x_t` at `2 s_t`, the separator and `y_j` (the steps that predict `y_{j+1}`) at `2 s_{j+1} - 1`, and the tokens
    after `y_L` 2 apart from there. `max_jump = 0` gives `compose.positions.position_ids` (`s_t = t`).

    Args:
        output_start: `[B]` index of each row's first output token (`L = output_start - 2`).
        width: the batch's padded length `T`.
        max_jump: the room for gaps (>= 0).
        generator: the RNG of the draws (default: torch's global one, which Lightning seeds).
    """
    rows = []
    for start in output_start.tolist():
        n = start - 1  # L + 1 slots: x_1..x_L, then one past x_L (the step that predicts <eos>)
        slots = torch.randperm(n + max_jump, generator=generator)[:n].sort().values + 1
        input_side = torch.cat([torch.zeros(1, dtype=torch.long), 2 * slots[:-1]])
        output_side = 2 * slots - 1
        tail = output_side[-1] + 2 * torch.arange(1, max(width - 2 * n, 0) + 1)
        rows.append(torch.cat([input_side, output_side, tail])[:width])
    return torch.stack(rows)


def jumped_position_ids(jump_from: Tensor, positions: Tensor, max_jump: int,
                        generator: torch.Generator | None = None) -> Tensor:
    """`positions` `[B, T]` plus a jump `d` drawn uniformly in `[0, max_jump]` per row, from index `jump_from[b]`
    of each row on (training rows are right-padded, so an index is a position in the row); decoding sees `d = 0`.

    Args:
        jump_from: `[B]` the first index of each row that jumps.
        positions: `[B, T]` the position ids before the jump.
        max_jump: the largest jump (>= 0).
        generator: the RNG of the draws (default: torch's global one, which Lightning seeds).
    """
    if max_jump < 0:
        raise ValueError(f"max_jump must be >= 0, got {max_jump}")
    jump = torch.randint(0, max_jump + 1, (positions.shape[0], 1), generator=generator).to(positions.device)
    index = torch.arange(positions.shape[1], device=positions.device)
    return positions + jump * (index >= jump_from.to(positions.device).unsqueeze(1))
