"""Running a causal LM's output head apart from its trunk, so logits can be made a block of positions at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def hidden_and_head(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
) -> tuple[Callable[[Tensor], Tensor], Tensor] | None:
    """One teacher-forced forward of ``model`` that stops short of its output head: ``(head, hidden [B, T, d])``.

    A pre-hook on ``model.get_output_embeddings()`` keeps the head's input at every position and lets the model
    compute only the last position's logits; ``head(hidden[:, -1:])`` must reproduce those (an
    architecture that post-processes its logits other than by ``final_logit_softcapping`` fails that check).
    None when the model has no such head, never calls it, or the check fails.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head_module = get_head() if callable(get_head) else None
    if head_module is None:
        return None
    captured: list[Tensor] = []

    def keep_last(module: nn.Module, args: tuple) -> tuple | None:
        if captured or not args or args[0].dim() != 3:
            return None
        captured.append(args[0])
        return (args[0][:, -1:], *args[1:])

    handle = head_module.register_forward_pre_hook(keep_last)
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    if not captured or out.logits.shape[1] != 1:
        return None
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def head(hidden: Tensor) -> Tensor:
        logits = head_module(hidden)
        return logits if not softcap else torch.tanh(logits / softcap) * softcap

    if not torch.allclose(head(captured[0][:, -1:]).float(), out.logits.float(), rtol=1e-5, atol=1e-5):
        return None
    return head, captured[0]
