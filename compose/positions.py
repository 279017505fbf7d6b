"""Position ids as Hugging Face ``generate`` computes them, and coupled positions that restart at a token.

A model whose config holds `POSITION_RESTART_KEY` couples its output positions to its input's (position coupling,
``model.position_encoding: coupled``, docs/results/length.md): the t-th token after ``<bos>`` sits at 2t,
the separator at 1 and the j-th token after it at 2j + 1. In ``<bos> x <sep> y`` the step that predicts ``y_t``
(position 2t − 1) then sits one before ``x_t`` (2t), the same offset under RoPE at every length and after any edit
of the prefix; the odd/even split leaves room to spread the input over random positions in training
(``lightning_modules.background.training_position_ids``) while that offset stays 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

POSITION_RESTART_KEY = "position_restart_token_id"


def position_restart_token(model: nn.Module) -> int | None:
    """The token id at which `model` restarts its position ids (`POSITION_RESTART_KEY` in its config), if any."""
    if hasattr(model, "get_base_model"):  # a PeftModel: the wrapped model's config
        model = model.get_base_model()
    return getattr(getattr(model, "config", None), POSITION_RESTART_KEY, None)


def position_ids(input_ids: Tensor, attention_mask: Tensor | None = None,
                 restart_token_id: int | None = None) -> Tensor:
    """Position ids `[B, T]` as Hugging Face `generate` computes them (count of attended tokens before each one,
    0 at padding); with a `restart_token_id`, coupled (`POSITION_RESTART_KEY`): `2i` before the first such token,
    `2j + 1` for the j-th token from the latest one on."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    if restart_token_id is not None:
        restart = (input_ids == restart_token_id) & (attention_mask != 0)
        since = positions - torch.where(restart, positions, 0).cummax(-1).values
        positions = torch.where(restart.cumsum(-1) > 0, 2 * since + 1, 2 * positions)
        positions = positions.masked_fill(attention_mask == 0, 0)
    return positions


def next_position_ids(last: Tensor, next_tokens: Tensor, restart_token_id: int | None = None) -> Tensor:
    """The position ids `[B, 1]` of the tokens `next_tokens` `[B]` that follow positions `last` `[B, 1]` (cached
    decoding), consistent with `position_ids`."""
    if restart_token_id is None:
        return last + 1
    return (last + 2).masked_fill(next_tokens[:, None] == restart_token_id, 1)


def model_position_ids(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """The position ids a training or scoring forward of `model` needs: None (the model's own default) unless
    its config restarts positions at a token (`position_restart_token`)."""
    restart = position_restart_token(model)
    return None if restart is None else position_ids(input_ids, attention_mask, restart)
