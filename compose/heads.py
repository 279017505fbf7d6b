"""Running a causal LM's output head apart from its trunk: logits a block of positions at a time, and one head call on
the mixed hidden states of a composition (:class:`OneHead`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from compose.modules import eval_mode


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


def decoder_of(model: nn.Module) -> nn.Module | None:
    """The trunk of a Hugging Face causal LM (``model.get_decoder()``): it returns the final, normalized hidden
    states that the output head takes."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


class OneHead:
    """The output head every component shares, run once on the mixed hidden states (the one-head identity).

    With one linear head ``z = W h + b`` for every component, ``lp_b + Σ w_i (lp_i − lp_b)`` is
    ``W h̄ + b`` minus a constant per position, where ``h̄ = h_b + Σ w_i m_i (h_i − h_b)`` (an affine combination,
    so a shared bias stays ``b``): ``compose_logprobs`` of the components' logits equals ``log_softmax(W h̄ + b)``
    as long as no log-prob reaches the floor ``min_logprob``. :meth:`floor_free` bounds that from the hidden
    states: ``max z − min z ≤ 2·max_v‖W_v‖·‖h‖ + (max b − min b)``, and ``lp ≥ −(max z − min z) − log V``.
    """

    def __init__(self, head: nn.Linear) -> None:
        self.head = head
        weight = head.weight.detach()
        self.row_norm = float(weight.float().norm(dim=-1).max())
        bias = head.bias
        self.bias_range = 0.0 if bias is None else float(bias.detach().max() - bias.detach().min())
        self.log_vocab = math.log(head.out_features)
        self.dtype = weight.dtype  # kept: inside ComposedLM.packed_weights the dense weight is an empty tensor

    def floor_free(self, hidden: Tensor, min_logprob: float) -> bool:
        """No component's log-prob can reach ``min_logprob`` at any row of ``hidden [..., d]``."""
        norm = float(hidden.float().norm(dim=-1).max()) if hidden.numel() else 0.0
        return 2 * self.row_norm * norm + self.bias_range + self.log_vocab < -min_logprob

    def __call__(self, hidden: Tensor) -> Tensor:
        """Float32 logits of ``hidden [..., d]``."""
        return self.head(hidden.to(self.dtype)).float()


def mix_hidden(hidden: Tensor, weights: Sequence[float], masks: Tensor | None = None) -> Tensor:
    """``h̄ = h_b + Σ_i w_i m_i (h_i − h_b)`` in float32 from ``hidden [1+k, ..., d]`` (background first), ``masks``
    bool ``[k, ...]`` (where False that expert's factor is 1)."""
    h = hidden.float()
    k = h.shape[0] - 1
    if k == 0:
        return h[0]
    w = torch.as_tensor(list(weights), dtype=torch.float32, device=h.device).view(k, *([1] * (h.dim() - 1)))
    if masks is not None:
        w = w * masks.to(h.device, torch.float32).unsqueeze(-1)
    return h[0] + (w * (h[1:] - h[0])).sum(0)


def one_head_check(models: Sequence[tuple[str, nn.Module]], head: nn.Module | None = None) -> tuple[OneHead | None, str]:
    """``(OneHead, why)`` when every model's logits are one plain linear head (the same weights for all) applied to
    its decoder's output, else ``(None, why not)`` in words. Runs one two-token forward per model. ``head``: the
    module to use as the (first) model's head instead of its ``get_output_embeddings()``."""
    first = None
    for label, model in models:
        if head is None or first is not None:
            head = getattr(model, "get_output_embeddings", lambda: None)()
        decoder = decoder_of(model)
        if head is None or decoder is None:
            return None, f"the {label} has no output head apart from its decoder"
        if type(head) is not nn.Linear:
            return None, f"the {label}'s output head is a {type(head).__name__}, not a plain linear layer"
        if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
            return None, f"the {label} soft-caps its final logits (final_logit_softcapping)"
        if first is None:
            first = head
        elif head is not first and not (_same(head.weight, first.weight) and _same(head.bias, first.bias)):
            return None, f"the {label} has output head weights of its own"
        if not _head_reproduces(model, decoder, head):
            return None, f"the {label}'s logits are not its output head applied to its decoder's output"
    if first is None:
        return None, "no model"
    return OneHead(first), "every component shares one output head"


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and (a.data_ptr() == b.data_ptr() or torch.equal(a.detach(), b.detach()))


@torch.no_grad()
def _head_reproduces(model: nn.Module, decoder: nn.Module, head: nn.Linear) -> bool:
    """The model's logits of a two-token input equal ``head(decoder(...))`` (catches a logit scale or cap)."""
    ids = torch.tensor([[0, 1]], device=head.weight.device)
    with eval_mode(model):
        logits = model(input_ids=ids, use_cache=False).logits.float()
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    return torch.allclose(head(hidden).float(), logits, rtol=1e-4, atol=1e-4)
