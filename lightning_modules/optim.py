"""AdamW with linear warm-up and cosine decay, stepped per optimizer step (shared by every module)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import get_cosine_schedule_with_warmup


def adamw_with_schedule(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                        warmup_ratio: float, max_steps: int) -> dict:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(warmup_ratio * max_steps), max_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
