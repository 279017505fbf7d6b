"""How :meth:`ComposedLM.generate <compose.composed_lm.ComposedLM.generate>` runs its decoding steps.

* :class:`PlainSteps`: every component on every new token (the ``(k+1)·B`` batch, or every model);
* :class:`CompiledSteps`: the same on static KV caches, each step after the prompt's through ``torch.compile``;
* :class:`LazySteps`: gated composition that skips the experts whose interval is closed and catches them up.

Each is called with the prefix so far and returns the next token's logits of the components it ran. They drive
the composed model through its decoding-step surface: ``step_modules``, ``new_caches``, ``component_logits`` and
``base_model``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticCache

from compose.grouped_lora import row_blocks
from compose.heads import decoder_of
from compose.modules import accepts
from compose.trunk import TrunkState, rewound

if TYPE_CHECKING:
    from compose.composed_lm import ComposedLM


class PlainSteps:
    """Decoding steps that run every component (the ``(k+1)·B`` batch, or every model) on every new token.

    With ``hidden`` a step returns the components' final hidden states instead of their logits (the one-head path:
    the composed model runs its shared head once on their mixture)."""

    def __init__(self, lm: ComposedLM, hidden: bool = False) -> None:
        self.lm, self.caches, self.held, self.hidden = lm, lm.new_caches(), 0, hidden

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor,
                 active: list[int] | None) -> Tensor:
        """Logits ``[k+1, B, V]`` (float32) of the next token after ``input_ids``, or with :attr:`hidden` final
        hidden states ``[k+1, B, d]``; ``active`` is ignored."""
        new = slice(self.held, input_ids.shape[1])
        self.held = input_ids.shape[1]
        step = self.lm.component_hidden if self.hidden else self.lm.component_logits
        return step(input_ids[:, new], attention_mask, positions[:, new], self.caches, True)[:, :, -1]


class CompiledSteps:
    """:class:`PlainSteps` on static KV caches: the prompt's forward eager, every later step through the components'
    compiled forwards. The attention mask is padded to the cache length (with ones: causal masking already hides
    the positions not yet written), so every step has the same shapes and reuses one compiled graph."""

    hidden = False  # logits, every component's head

    def __init__(self, lm: ComposedLM, length: int, mode: str | None) -> None:
        modules = lm.step_modules()
        self.lm, self.length, self.held = lm, length, 0
        self.caches = [StaticCache(config=m.config, max_cache_len=length) for m in modules]
        self.forwards = [functools.partial(_compiled_forward(type(m), mode), m) for m in modules]

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor,
                 active: list[int] | None) -> Tensor:
        """Logits ``[k+1, B, V]`` (float32) of the next token after ``input_ids``; ``active`` is ignored."""
        new = slice(self.held, input_ids.shape[1])
        forwards = self.forwards if self.held else None  # the prompt (any length) runs eager
        self.held = input_ids.shape[1]
        mask = F.pad(attention_mask, (0, self.length - attention_mask.shape[1]), value=1)
        # dynamo guards strides too, even of size-1 dims: a slice of the growing prefix would recompile every step
        ids, positions = (t[:, new].clone(memory_format=torch.contiguous_format) for t in (input_ids, positions))
        return self.lm.component_logits(ids, mask, positions, self.caches, True, forwards)[:, :, -1]


@functools.cache
def _compiled_forward(cls: type[nn.Module], mode: str | None) -> Callable[..., Any]:
    """``torch.compile`` of a model class's ``forward`` (one graph, static shapes), called with the module first.
    The module's parameters are graph inputs, not constants, so every module of the class (the k+1 models of the
    separate backend, several ``ComposedLM``) shares the graphs: only a new batch size, cache length or module
    structure compiles. Nothing here holds a module."""
    return torch.compile(cls.forward, fullgraph=True, dynamic=False, mode=mode)


def check_compile(value: bool | str, packed_weights: bool = False) -> bool | str:
    """``generate``'s ``compile`` argument, checked: a bool, ``"true"``/``"false"`` (any case, as command lines and
    lm-eval's ``model_args`` give it), or a ``torch.compile`` mode (``torch._inductor.list_mode_options()``); and not
    together with oneDNN-packed weights (``packed_weights``: :meth:`ComposedLM.packed_weights` is or will be on).

    Raises:
        TypeError: neither a bool nor a string.
        ValueError: a string that is neither a boolean nor a mode (the message lists the modes), or compiling on
            packed weights.
    """
    if isinstance(value, bool):
        compiled: bool | str = value
    elif not isinstance(value, str):
        raise TypeError(f"compile must be a bool or a torch.compile mode string, got {value!r}")
    elif value.strip().lower() in ("true", "false"):
        compiled = value.strip().lower() == "true"
    elif value in (modes := list(torch._inductor.list_mode_options())):
        compiled = value
    else:
        raise ValueError(f"compile={value!r} is not a torch.compile mode; expected true, false or one of {modes}")
    if compiled and packed_weights:
        raise ValueError("compile and packed_weights do not combine (inductor cannot compile oneDNN-packed linear "
                         "layers); use one or the other")
    return compiled


# Static KV caches (``generate(compile=...)``) hold a multiple of this many tokens, so that prompts of similar
# lengths share one compiled graph.
STATIC_CACHE_STEP = 128


def static_cache_length(tokens: int) -> int:
    return -(-tokens // STATIC_CACHE_STEP) * STATIC_CACHE_STEP


# Lazy decoding (adapters backend): an expert that missed at most this many tokens joins the next step's forward,
# with the other members rolled back to its length, instead of a catch-up prefill of its own (`LazySteps._regroup`).
FUSED_CATCH_UP_TOKENS = 32


class LazySteps:
    """Decoding steps that run the background and only the ``active`` experts (lazy gated composition).

    Each component's KV cache records how many tokens it holds (``held``); an expert skipped while its interval
    was closed is brought up to date, when it is next active, by one forward of all the tokens it missed (its
    catch-up prefill), with the same attention mask and position ids as the plain path, so its logits equal the
    plain path's (up to floating-point rounding of a multi-token forward).

    *separate*: one forward per active component of its missed tokens. *adapters*: the background and the
    active experts run as one batch of row blocks over one merged cache (:func:`compose.grouped_lora.lora_blocks`); when the active
    set changes, the merged cache is split into per-component caches, the joining experts catch up (inside the
    step's forward when they missed at most :data:`FUSED_CATCH_UP_TOKENS`, else by a prefill of their own first),
    and the new set's caches are merged again (copies only at interval boundaries).

    With a shared trunk (``trunk``, :mod:`compose.trunk`) the cache's trunk layers are the background's alone, and
    a joining expert catches up only its top layers, on the trunk outputs the background's forwards kept
    (``trunk.record``). With ``hidden`` a step returns final hidden states instead of logits (the one-head path).
    """

    def __init__(self, lm: ComposedLM, select: Callable[[tuple[int, ...]], None] | None = None,
                 prefill_all: bool = False, hidden: bool = False, trunk: TrunkState | None = None) -> None:
        self.lm, self.select, self.prefill_all, self.hidden, self.trunk = lm, select, prefill_all, hidden, trunk
        self.shared = 0 if trunk is None else trunk.start  # cache layers held by the background alone
        n = lm.num_experts + 1
        self.held = [0] * n
        if lm.backend == "adapters":
            self.config = lm.base_model.config
            self.group: tuple[int, ...] = ()
            self.group_cache = DynamicCache(config=self.config)
            self.parked: dict[int, DynamicCache] = {}
        else:
            self.models = [lm.background, *lm.experts]
            self.caches = [DynamicCache(config=m.config) for m in self.models]

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, active: list[int]) -> Tensor:
        """Logits ``[1 + len(active), B, V]`` (float32), or final hidden states ``[1 + len(active), B, d]``: the
        background's, then the active experts' in order.

        With ``prefill_all``, the prompt's forward (the first call) runs every expert; only the active ones'
        outputs are returned."""
        components = (0, *(i + 1 for i in active))
        if self.prefill_all and self.held[0] == 0 and len(components) < len(self.held):
            out = self(input_ids, attention_mask, positions, list(range(len(self.held) - 1)))
            return out[list(components)]
        if self.lm.backend == "adapters":
            return self._blocks_step(components, input_ids, attention_mask, positions)
        out = []
        for c in components:
            new = slice(self.held[c], input_ids.shape[1])
            out.append(_last_output(self.models[c], input_ids[:, new], attention_mask, positions[:, new],
                                    self.caches[c], self.hidden))
            self.held[c] = input_ids.shape[1]
        return torch.stack(out)

    def _blocks_step(self, components: tuple[int, ...], input_ids: Tensor, attention_mask: Tensor,
                     positions: Tensor) -> Tensor:
        if components != self.group:
            self._regroup(components, input_ids, attention_mask, positions)
        new = slice(self.held[0], input_ids.shape[1])
        n, batch = len(components), input_ids.shape[0]
        self.select(components)
        rows = tuple(row_blocks(t, n) for t in (input_ids[:, new], attention_mask, positions[:, new]))
        out = _last_output(self.lm.base_model, *rows, self.group_cache, self.hidden)
        for c in components:
            self.held[c] = input_ids.shape[1]
        return out.view(n, batch, -1)

    def _regroup(self, components: tuple[int, ...], input_ids: Tensor, attention_mask: Tensor,
                 positions: Tensor) -> None:
        """Split the merged cache, bring the new group's caches to one length, merge them.

        Joining experts that missed at most :data:`FUSED_CATCH_UP_TOKENS` tokens are not caught up alone: every
        member of the new group is rolled back to the shortest member's length (the caches ahead are cropped), so
        the step's one forward runs them all over the missed tokens and the new one. The members ahead recompute
        a few tokens, which costs less than a forward of its own where a step is mostly per-op overhead. Longer
        catch-ups, caches that cannot be cropped (sliding-window layers), and every catch-up over a shared trunk
        (which runs only the expert's top layers) run a prefill of their own first.
        """
        if self.group:
            parts = _split_cache(self.group_cache, len(self.group), self.shared)
            for c, part in zip(self.group, parts, strict=True):
                self.parked[c] = part if c in components else _cloned_cache(part, self.shared)
        length = self.held[0]
        caches = {c: self.parked.pop(c, None) for c in components}
        caches = {c: DynamicCache(config=self.config) if cache is None else cache for c, cache in caches.items()}
        start = min(self.held[c] for c in components)
        if (not self.shared and 0 < length - start <= FUSED_CATCH_UP_TOKENS
                and all(map(_croppable, caches.values()))):
            for c in components:
                if start == 0:  # an expert that has not run yet (lazy=True): every member starts from the prompt
                    caches[c] = DynamicCache(config=self.config)
                else:
                    caches[c].crop(start - self.held[c])  # minus the tokens to drop (a no-op at 0)
                self.held[c] = start
        else:
            for c in components:
                if self.held[c] < length:  # one prefill of the tokens it missed (never the background)
                    self._catch_up(c, caches[c], caches[0], input_ids, attention_mask, positions, length)
        self.group, self.group_cache = components, _merge_caches([caches[c] for c in components], self.shared)

    def _catch_up(self, c: int, cache: DynamicCache, background: DynamicCache, input_ids: Tensor,
                  attention_mask: Tensor, positions: Tensor, length: int) -> None:
        """Expert ``c``'s cache brought to ``length`` tokens by a forward of the tokens it missed (its decoder only:
        the logits are not needed); over a shared trunk, its top layers only, on the kept trunk outputs."""
        missed = slice(self.held[c], length)
        self.select((c,))
        model = decoder_of(self.lm.base_model) or self.lm.base_model
        kwargs = dict(input_ids=input_ids[:, missed], attention_mask=attention_mask[:, :length],
                      position_ids=positions[:, missed], use_cache=True)
        if not self.shared:
            model(cache=cache, **kwargs)
        else:
            record = self.trunk.record
            if len(record) > 1:
                record[:] = [torch.cat(record, dim=1)]
            view = copy.copy(cache)  # the background's trunk layers, as long as this expert's top layers
            view.layers = [rewound(layer, self.held[c]) for layer in background.layers[: self.shared]]
            view.layers += cache.layers[self.shared:]
            self.trunk.replay = record[0][:, missed]
            try:
                model(cache=view, **kwargs)
            finally:
                self.trunk.replay = None
        self.held[c] = length


def _croppable(cache: DynamicCache) -> bool:
    """Every layer keeps all its tokens (no sliding window), so dropping the last few and recomputing them is exact."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _last_output(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                 cache: DynamicCache, hidden: bool = False) -> Tensor:
    """One cached forward of ``model``: float32 logits of the last position ``[rows, V]``, or with ``hidden`` its
    decoder's final hidden state there ``[rows, d]``."""
    if hidden:
        out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache, use_cache=True)
        return out.last_hidden_state[:, -1]
    kwargs: dict[str, Any] = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, **kwargs)
    return out.logits[:, -1].float()


def _split_cache(cache: DynamicCache, parts: int, shared: int = 0) -> list[DynamicCache]:
    """``parts`` caches holding equal consecutive row blocks of ``cache`` (views; layer state such as a sliding
    window's token count is kept); its first ``shared`` layers (a shared trunk's) are in every part whole."""
    out = []
    for i in range(parts):
        part = copy.copy(cache)
        part.layers = list(cache.layers[:shared])
        for layer in cache.layers[shared:]:
            piece = copy.copy(layer)
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                piece.keys, piece.values = layer.keys.chunk(parts)[i], layer.values.chunk(parts)[i]
            part.layers.append(piece)
        out.append(part)
    return out


def _cloned_cache(cache: DynamicCache, shared: int = 0) -> DynamicCache:
    """``cache`` with storage of its own (a parked block no longer keeps the whole merged cache alive); its first
    ``shared`` layers (a shared trunk's, the background's) stay as they are."""
    for layer in cache.layers[shared:]:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    return cache


def _merge_caches(caches: list[DynamicCache], shared: int = 0) -> DynamicCache:
    """One cache whose rows are the given caches' rows, block after block (all hold the same number of tokens);
    its first ``shared`` layers are the first cache's (a shared trunk's: the background's)."""
    if len(caches) == 1:
        return caches[0]
    merged = copy.copy(caches[0])
    merged.layers = list(caches[0].layers[:shared])
    for layers in zip(*(c.layers[shared:] for c in caches), strict=True):
        layer = copy.copy(layers[0])
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            layer.keys = torch.cat([x.keys for x in layers])
            layer.values = torch.cat([x.values for x in layers])
        merged.layers.append(layer)
    return merged
