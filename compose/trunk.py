"""Shared-trunk experts: LoRA adapters on the top layers only share the background's lower layers.

An expert whose adapters sit only on decoder layers ``s .. N-1`` (peft's ``layers_to_transform``) computes exactly
the background's hidden states, and keys and values, in layers ``0 .. s-1``. So the adapters backend's row blocks
``[background | expert 1 | … | expert k]`` need those layers on the background's ``B`` rows only: inside
:func:`shared_trunk` every layer below ``s`` (the *trunk*) runs on the first row block, and the last trunk layer hands
its output to the ``(k+1)·B`` rows of the layers above (the *top*). The KV cache's trunk layers then hold ``B`` rows,
its top layers ``(k+1)·B``; per token a step costs about ``s + (k+1)·(N-s)`` layer-rows instead of ``(k+1)·N``.

Experts that adapt different layer sets compose: the trunk ends at the lowest layer any of them adapts
(:func:`trunk_start`). Lazy decoding (``compose.decoding.LazySteps``) keeps the trunk's outputs so that a skipped
expert catches up by running its top layers alone on them (:attr:`TrunkState.replay`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a Hugging Face causal LM (``model.get_decoder().layers``), or None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def trunk_start(peft_model: nn.Module, names: Sequence[str]) -> tuple[int, str]:
    """``(s, why)``: the lowest decoder layer any of the adapters ``names`` adapts (``N`` when they adapt no decoder
    layer), or 0 when the trunk cannot be shared, with the reason in words.

    Anything the adapters change outside the decoder layers other than the output head (an embedding, a
    ``modules_to_save`` copy) changes every layer's input, so the trunk is then empty.
    """
    base = peft_model.get_base_model()
    layers = decoder_layers(base)
    if layers is None:
        return 0, "the model has no decoder layers to share (get_decoder().layers)"
    from peft.tuners.lora import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    head = base.get_output_embeddings()
    layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    start = len(layers)
    for module_name, module in base.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):  # a modules_to_save / trainable-tokens copy: counted for all
            adapted = list(names)
        elif isinstance(module, LoraLayer):
            adapted = [n for n in names if n in module.lora_A or n in getattr(module, "lora_embedding_A", {})]
        else:
            continue
        if not adapted:
            continue
        if id(module) in layer_of:
            start = min(start, layer_of[id(module)])
        elif module is head or getattr(module, "base_layer", None) is head:
            continue  # after every layer: the trunk is unaffected (the one-head identity is not)
        else:
            return 0, f"expert {adapted[0]!r} adapts {module_name}, outside the decoder layers"
    if start == 0:
        return 0, "an expert adapts layer 0"
    span = "layer 0" if start == 1 else f"layers 0-{start - 1}"
    return start, f"every expert leaves {span} of {len(layers)} untouched"


@dataclass
class TrunkState:
    """What the trunk layers of one :func:`shared_trunk` context do.

    ``start``: the first layer above the trunk; ``batch_size``: the rows of one block (``B``). ``record``: a list
    that gets the trunk's output (``[B, T, d]``, the background's rows) of every forward, for lazy catch-ups.
    ``replay``: when set, the next forwards skip the trunk and take this tensor (``[rows, T, d]``) as its output (a
    lazy expert catching up its top layers on the trunk outputs it missed).
    """

    start: int
    batch_size: int
    record: list[Tensor] | None = None
    replay: Tensor | None = None
    rows: int = 0  # the rows of the forward under way (set by the first layer)


def _first_block(value: Any, rows: int, batch: int) -> Any:
    """``value`` with every batch-first tensor of ``rows`` rows (at least 2-D) cut to its first ``batch`` rows."""
    if isinstance(value, Tensor):
        return value[:batch] if value.dim() >= 2 and value.shape[0] == rows and rows != batch else value
    if isinstance(value, tuple):
        return tuple(_first_block(v, rows, batch) for v in value)
    if isinstance(value, list):
        return [_first_block(v, rows, batch) for v in value]
    if isinstance(value, dict):
        return {key: _first_block(v, rows, batch) for key, v in value.items()}
    return value


def _trunk_forward(layer: nn.Module, index: int, state: TrunkState) -> Any:
    inner = vars(layer).get("forward") or functools.partial(type(layer).forward, layer)
    last = index == state.start - 1

    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        if state.replay is not None:  # a catch-up: the trunk already ran these tokens for the background
            return state.replay if last else hidden_states
        batch = state.batch_size
        if index == 0:  # the embeddings of every row block: the rows the other arguments have
            state.rows = hidden_states.shape[0]
            if state.rows % batch:
                raise ValueError(f"shared trunk expects row blocks of B={batch}, got {state.rows} rows")
            hidden_states = hidden_states[:batch]
        rows = state.rows
        out = inner(hidden_states, *_first_block(args, rows, batch), **_first_block(kwargs, rows, batch))
        if not last:
            return out
        hidden = out[0] if isinstance(out, tuple) else out
        if state.record is not None:
            state.record.append(hidden)
        blocks = rows // batch  # the row blocks the layers above run
        if blocks > 1:
            hidden = torch.cat([hidden] * blocks)
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    return forward


@contextmanager
def shared_trunk(model: nn.Module, state: TrunkState) -> Iterator[TrunkState]:
    """Layers ``0 .. state.start-1`` of ``model`` (a Hugging Face causal LM) run on the first row block only while
    the context lasts (each layer's ``forward`` replaced by an instance attribute, removed afterwards)."""
    layers = decoder_layers(model)
    if layers is None or not 0 < state.start <= len(layers):
        raise ValueError(f"shared trunk: layer {state.start} is not within the model's decoder layers")
    trunk = list(layers)[: state.start]
    saved = [vars(layer).get("forward") for layer in trunk]
    try:
        for i, layer in enumerate(trunk):
            vars(layer)["forward"] = _trunk_forward(layer, i, state)
        yield state
    finally:
        for layer, forward in zip(trunk, saved, strict=True):
            if forward is None:
                vars(layer).pop("forward", None)
            else:
                vars(layer)["forward"] = forward


def rewound(layer: Any, length: int) -> Any:
    """A stand-in for a trunk cache layer that reports ``length`` tokens (for the attention-mask sizes of a lazy
    catch-up forward, which skips the trunk): a view of its first ``length`` tokens, or, for a sliding-window layer
    (which keeps only its window), a shallow copy whose token count is ``length``."""
    out = copy.copy(layer)
    if hasattr(layer, "cumulative_length"):
        out.cumulative_length = length
    elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
        out.keys, out.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return out
