"""A composed language model: a background and k experts combined by ``compose_logprobs``.

Two backends compute the same thing:

* ``"adapters"`` — one :class:`peft.PeftModel` holding the k LoRA adapters; the background is the base
  model (peft's ``"__base__"``). Every step is ONE forward of a batch of ``(k+1)·B`` rows with peft's
  mixed-batch ``adapter_names=["__base__"]*B + [name_1]*B + ...`` and one shared KV cache.
* ``"separate"`` — distinct full Hugging Face causal LMs, each with its own ``DynamicCache``.

Scoring is teacher-forced; generation prefills the prompt once and then feeds one token per step. Gated
generation can be lazy (``generate(..., lazy=True)``): an expert whose interval is closed gets no forward and
catches up with one prefill of the tokens it missed when it opens.

Two exact identities cut the work where they hold (:attr:`ComposedLM.paths`, chosen automatically, each can be
turned off): *one head* — every component shares an untouched output head, so the composed log-probs are the head
applied once to the mixed final hidden states (:class:`compose.heads.OneHead`); *shared trunk* — LoRA experts that
adapt only the top layers share the background's lower layers and their KV cache (:mod:`compose.trunk`).

How the adapters backend runs its row blocks is :mod:`compose.grouped_lora`; how a decoding step runs (eager,
compiled, lazy) is :mod:`compose.decoding`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import LongTensor, Tensor, nn
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import Cache

from compose.decoding import CompiledSteps, LazySteps, PlainSteps, check_compile, static_cache_length
from compose.export import load_export
from compose.grouped_lora import BASE_ADAPTER, adapter_rows, lora_blocks, row_blocks
from compose.heads import OneHead, decoder_of, hidden_and_head, mix_hidden, one_head_check
from compose.modules import accepts, eval_mode
from compose.operator import compose_logprobs
from compose.positions import next_position_ids, position_restart_token
from compose.positions import position_ids as position_ids_of
from compose.quiet import quiet_loading
from compose.trunk import TrunkState, decoder_layers, shared_trunk, trunk_start
from compose.vocab import check_same_vocab, check_tokenizers, vocab_sizes

COMPOSITIONS = ("soft", "gated")
Gate = Callable[[Tensor], Any]


@dataclass(frozen=True)
class DecodingPaths:
    """Which exact shortcuts a :class:`ComposedLM` takes, and why (see :attr:`ComposedLM.paths`).

    ``one_head``: the output head runs once on the mixed final hidden states instead of once per component.
    ``trunk_start``: the decoder layers below it run on the background's rows only (0: no shared trunk), of
    ``num_layers``. The ``*_why`` fields say why each applies or not, in words.
    """

    one_head: bool
    one_head_why: str
    trunk_start: int
    num_layers: int | None
    trunk_why: str

    def describe(self) -> str:
        head = "one head" if self.one_head else "one head per component"
        trunk = (f"shared trunk: {_layer_span(self.trunk_start)} of {self.num_layers} on the background's rows"
                 if self.trunk_start else "no shared trunk")
        return f"{head} ({self.one_head_why}); {trunk} ({self.trunk_why})"


class ComposedLM(nn.Module):
    """Background + k experts sharing one vocabulary, composed with ``compose_logprobs``.

    The constructor builds the *separate* backend from full causal LMs; :meth:`from_peft` builds the
    *adapters* backend from a PeftModel holding LoRA adapters; :meth:`from_manifest` loads an export
    written by :func:`compose.export.export_composition`.

    Args:
        background: the background causal LM.
        experts: full causal LMs sharing the background's vocabulary.
        weights: one float per expert (default all 1, the paper's rule).
        names: one name per expert (default ``expert_0``, ``expert_1``, ...).
        min_logprob: floor on the components' log-probs (see ``compose_logprobs``).
        tokenizer: the shared tokenizer, or a sequence of one tokenizer per component (background
            first), in which case all must be identical (same vocabulary and special tokens).
        specs: one dict per expert (default ``{}``), e.g. ``{"rules": ...}`` or
            ``{"interval": {"start": "[", "end": "]"}}`` (see ``compose.intervals.IntervalSpec``).
        composition: ``"soft"`` (every expert acts at every step) or ``"gated"`` (:meth:`generate`
            gates each expert with an ``interval`` spec by its stopping-time detector; needs a tokenizer).
        one_head: run the shared output head once on the mixed hidden states (:attr:`paths`): None (default) where
            it is exact, False never, True or an error naming why it does not apply.
        shared_trunk: run the layers no expert adapts on the background's rows only (adapters backend): None
            (default) where it applies, False never, True or an error naming why it does not apply.
        lazy: the default of :meth:`generate`'s ``lazy`` (see *Generation options*; gated composition skips the
            experts whose interval is closed; ignored without gates); the front ends set it.

    Raises:
        ValueError: a component's vocabulary size or tokenizer differs from the background's (checked
            before any forward pass), weights/names have the wrong length, or a path forced with ``one_head=True``
            or ``shared_trunk=True`` does not apply.

    Generation options (the keyword arguments of :meth:`generate`):
        input_ids: ``[B, T]`` prompt ids. Right-padded rows (a tokenizer's default, e.g. SmolLM2's) are
            moved to left padding first, so the output is right either way; its prompt part is then
            left-padded, and the generated tokens are ``output[:, T:]`` in both cases.
        attention_mask: ``[B, T]``; if None it is inferred: ``input_ids != pad`` when the pad token
            differs from EOS; when pad = EOS, a leading run of it is padding and a row that *ends* with it
            is refused (right padding cannot be told from an EOS there: pass the mask).
        max_new_tokens: at most this many tokens are appended.
        do_sample: sample (with ``generator``) instead of taking the argmax.
        temperature, top_k, top_p: sampling warpers (transformers' logits processors) applied to the
            composed log-probs; ignored when greedy.
        eos_token_id: one or several ids that finish a sequence (default: tokenizer, else the
            background's generation config); an empty list disables EOS stopping.
        pad_token_id: fills finished sequences (default: tokenizer, generation config, else EOS).
        gates: optional ``k`` callables ``gate(prefix_ids [B, t]) -> bool [B]`` (or None for an
            always-on expert); where False that expert's factor is 1 for that row at this step. With
            ``composition="gated"`` and no gates, each expert with an ``interval`` spec gets an
            :class:`compose.gating.IntervalGate` over the tokens after the prompt.
        generator: a ``torch.Generator`` for reproducible sampling.
        stop_strings: a row also finishes once its generated text (the tokens after the prompt)
            contains one of these strings (transformers' ``StopStringCriteria``); it is then padded
            like a row that emitted EOS. The stop string stays in the output.
        tokenizer: the tokenizer ``stop_strings`` are matched with (default: :attr:`tokenizer`).
        lazy: with gates (gated composition), skip the forward of every expert whose gate is closed on all
            unfinished rows; when it opens, a forward of the tokens it missed brings its KV cache up to
            date (on the adapters backend inside the step's forward when they are at most
            ``FUSED_CATCH_UP_TOKENS``). ``True``: the prompt too (an expert that never opens is never run);
            ``"decode"``: every expert prefills the prompt with the background (as without lazy), only decoding
            steps are skipped, so a catch-up covers only generated tokens. Same tokens as without it (up to
            floating-point rounding of the logits); the adapters backend then runs the background and the
            open experts as one batch of row blocks; with a shared trunk (:attr:`paths`) a catch-up runs only the
            expert's own top layers, on the trunk outputs kept for it. Ignored without gates. None (default):
            :attr:`lazy`, or False with ``compile``.
        compile: run each decoding step through ``torch.compile`` (one graph, static shapes) on static KV caches
            (transformers' ``StaticCache``, ``STATIC_CACHE_STEP``-token multiples); the prompt's forward stays
            eager. ``True`` uses torch's default mode; a string is the mode (``"reduce-overhead"``: CUDA graphs
            on a GPU). The first call with a new batch size or cache length compiles (seconds on a toy model,
            minutes on SmolLM2-135M on a CPU), later ones reuse it. Same tokens as eager decoding, up to
            floating-point rounding; not with ``lazy``; takes neither shortcut of :attr:`paths`. Checked by
            :func:`check_compile`.
        streamer: an object with transformers' streamer interface (``TextStreamer``,
            ``TextIteratorStreamer``): ``put`` gets the (left-aligned) prompt ``[B, T]`` once, then each step's
            tokens ``[B]`` (on the CPU, finished rows' as pad), and ``end()`` is called when decoding stops.
        stopping_criteria: ``criteria(sequences [B, t], scores [B, V]) -> bool [B]`` after each step (transformers'
            ``StoppingCriteriaList`` fits), with the prompt and the tokens so far and the step's composed scores;
            a row where it is True finishes and is padded like one that emitted EOS.

    :meth:`generate` raises ``ValueError`` for ``stop_strings`` or ``stopping_criteria`` without a pad or EOS id to
    fill finished rows (``stop_strings`` also without a tokenizer); no ``attention_mask`` where pad = EOS and a row
    ends with that token; ``lazy`` not one of ``LAZY``; ``compile`` with ``lazy`` or inside :meth:`packed_weights`,
    or a string that is not a mode; and ``TypeError`` for a ``compile`` neither a bool nor a string.
    """

    def __init__(
        self,
        background: PreTrainedModel,
        experts: Sequence[PreTrainedModel] = (),
        *,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
        min_logprob: float = -1e4,
        tokenizer=None,
        specs: Sequence[Mapping[str, Any]] | None = None,
        composition: str = "soft",
        one_head: bool | None = None,
        shared_trunk: bool | None = None,
        lazy: bool | str = False,
    ) -> None:
        super().__init__()
        experts = list(experts)
        names = [f"expert_{i}" for i in range(len(experts))] if names is None else [str(n) for n in names]
        if len(names) != len(experts):
            raise ValueError(f"names has {len(names)} entries but there are {len(experts)} experts")
        self._setup(names, weights, min_logprob, specs, composition, one_head, shared_trunk, lazy)
        components = [("background", background)] + [
            (f"expert {n!r}", m) for n, m in zip(names, experts, strict=True)
        ]
        check_same_vocab(components)
        self.tokenizer = check_tokenizers(tokenizer, ["background"] + [f"expert {n!r}" for n in names])
        self.backend = "separate"
        self.background = background
        self.experts = nn.ModuleList(experts)
        self.model = None
        self._check_forced_paths()

    @classmethod
    def from_peft(
        cls,
        model,
        adapter_names: Sequence[str],
        *,
        weights: Sequence[float] | None = None,
        min_logprob: float = -1e4,
        tokenizer=None,
        specs: Sequence[Mapping[str, Any]] | None = None,
        composition: str = "soft",
        one_head: bool | None = None,
        shared_trunk: bool | None = None,
        lazy: bool | str = False,
    ) -> ComposedLM:
        """Adapters backend: the PeftModel's base model is the background, each named adapter an expert.

        Args:
            model: a ``peft.PeftModel`` holding (at least) the named LoRA adapters, none merged.
            adapter_names: the adapters to compose, in order; they become :attr:`names`.
            weights, min_logprob, tokenizer, specs, composition, one_head, shared_trunk, lazy: as in the constructor.
        """
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            raise ValueError(f"from_peft needs a peft.PeftModel, got {type(model).__name__}")
        names = [str(n) for n in adapter_names]
        for name in names:
            if name == BASE_ADAPTER:
                raise ValueError(f"adapter name {BASE_ADAPTER!r} is reserved for the background")
            if name not in model.peft_config:
                raise ValueError(
                    f"adapter {name!r} is not in the PeftModel (it holds {sorted(model.peft_config)})"
                )
            if getattr(model.peft_config[name], "use_dora", False):
                raise ValueError(f"adapter {name!r} uses DoRA, which peft's mixed-adapter batches do not support")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(names, weights, min_logprob, specs, composition, one_head, shared_trunk, lazy)
        self.tokenizer = check_tokenizers(tokenizer, ["background"] + [f"expert {n!r}" for n in names])
        self.backend = "adapters"
        self.background = None
        self.experts = nn.ModuleList()
        self.model = model
        self._check_forced_paths()
        return self

    @classmethod
    @quiet_loading()  # no library noise (compose.quiet)
    def from_manifest(
        cls,
        path: str | os.PathLike,
        *,
        backend: str = "adapters",
        device: torch.device | str | None = None,
        composition: str = "soft",
        one_head: bool | None = None,
        shared_trunk: bool | None = None,
        lazy: bool | str = False,
        min_logprob: float = -1e4,
    ) -> ComposedLM:
        """Load an export folder (see :func:`compose.export.export_composition`).

        Checksums are verified first (a corrupt or truncated file raises ``ValueError`` naming it).
        ``backend="adapters"`` loads every LoRA expert into one PeftModel; ``backend="separate"`` merges
        each LoRA into its own full copy of the background. Full-model experts need ``"separate"``.
        ``composition="gated"`` gates each expert by the ``interval`` of its stored spec. ``one_head``,
        ``shared_trunk``, ``lazy`` and ``min_logprob`` are the constructor's (:attr:`paths`).
        """
        loaded = load_export(path, backend=backend)
        common = dict(weights=loaded.weights, tokenizer=loaded.tokenizer, specs=loaded.specs, composition=composition,
                      one_head=one_head, shared_trunk=shared_trunk, lazy=lazy, min_logprob=min_logprob)
        if isinstance(loaded.experts, list):
            composed = cls(loaded.background, loaded.experts, names=loaded.names, **common)
        else:
            composed = cls.from_peft(loaded.experts, loaded.names, **common)
        composed.extra = loaded.extra
        return composed if device is None else composed.to(device)

    def _setup(
        self,
        names: list[str],
        weights: Sequence[float] | None,
        min_logprob: float,
        specs: Sequence[Mapping[str, Any]] | None = None,
        composition: str = "soft",
        one_head: bool | None = None,
        shared_trunk: bool | None = None,
        lazy: bool | str = False,
    ) -> None:
        k = len(names)
        if len(set(names)) != k:
            raise ValueError(f"expert names must be unique, got {names}")
        weights = [1.0] * k if weights is None else [float(w) for w in weights]
        if len(weights) != k:
            raise ValueError(f"weights has {len(weights)} entries but there are {k} experts")
        self.names: list[str] = names
        self.weights: list[float] = weights
        self.min_logprob = float(min_logprob)
        self.specs = specs
        self.composition = composition
        for key, value in (("one_head", one_head), ("shared_trunk", shared_trunk)):
            if value not in (None, True, False):
                raise ValueError(f"{key} must be None (where exact), True or False, got {value!r}")
        self._forced = {"one_head": one_head, "shared_trunk": shared_trunk}
        self._paths: tuple[DecodingPaths, OneHead | None] | None = None
        self.lazy = lazy
        self.floor_fallbacks = 0  # steps / score blocks where the floor could be reached: heads per component

    # ------------------------------------------------------------------ exact shortcuts

    @property
    def paths(self) -> DecodingPaths:
        """The exact shortcuts this model takes (one output head, shared trunk) and why; checked once, on first use.

        One head needs every component's logits to be one plain linear head, the same weights for all, on its
        decoder's output: not with LoRA on the output head, experts with head weights of their own, or a final
        logit soft-cap. The shared trunk needs the adapters backend and experts that leave the lower layers
        untouched (peft's ``layers_to_transform``). Where the background's floor ``min_logprob`` could be reached,
        a step runs the heads per component instead (counted in :attr:`floor_fallbacks`). Compiled decoding
        (``generate(compile=...)``) takes neither shortcut.
        """
        return self._decoding_paths()[0]

    def describe(self) -> str:
        """One line: backend, experts, composition and :attr:`paths`."""
        floor = f"; {self.floor_fallbacks} step(s) near the floor ran a head per component" if self.floor_fallbacks else ""
        return (f"{self.backend} backend, {self.num_experts} expert(s) {self.names}, {self.composition}; "
                f"{self.paths.describe()}{floor}")

    def _decoding_paths(self) -> tuple[DecodingPaths, OneHead | None]:
        if self._paths is None:
            head, head_why = (None, "turned off (one_head=False)") if self._forced["one_head"] is False \
                else self._one_head()
            start, trunk_why = (0, "turned off (shared_trunk=False)") if self._forced["shared_trunk"] is False \
                else self._trunk_start()
            layers = decoder_layers(self.base_model)
            paths = DecodingPaths(head is not None, head_why, start, None if layers is None else len(layers),
                                  trunk_why)
            self._paths = (paths, head)
        return self._paths

    def _one_head(self) -> tuple[OneHead | None, str]:
        if self.num_experts == 0:
            return None, "no experts"
        if self.backend == "separate":
            return one_head_check([("background", self.background)]
                                  + [(f"expert {n!r}", m) for n, m in zip(self.names, self.experts, strict=True)])
        from peft.tuners.lora import LoraLayer

        base = self.base_model
        head = base.get_output_embeddings()
        if isinstance(head, LoraLayer):
            adapted = [n for n in self.names if n in head.lora_A or n in getattr(head, "lora_embedding_A", {})]
            if adapted:
                return None, f"expert {adapted[0]!r} adapts the output head (LoRA on it)"
            head = head.base_layer  # adapters outside the composition: the composed rows never run them
        # Leaving peft's disable_adapter() leaves only the active adapter trainable: keep an expert in training
        # as it was.
        trainable = {p: p.requires_grad for p in self.model.parameters()}
        with self.model.disable_adapter():
            found = one_head_check([("background", base)], head)
        for p, flag in trainable.items():
            p.requires_grad_(flag)
        return found

    def _trunk_start(self) -> tuple[int, str]:
        if self.backend != "adapters":
            return 0, "the separate backend runs each expert's own layers"
        if self.num_experts == 0:
            return 0, "no experts"
        return trunk_start(self.model, self.names)

    def _check_forced_paths(self) -> None:
        """``one_head=True`` / ``shared_trunk=True`` where the path does not apply: a one-line error naming why."""
        if not any(self._forced.values()):
            return
        paths = self.paths
        if self._forced["one_head"] and not paths.one_head:
            raise ValueError(f"one_head=True does not apply: {paths.one_head_why}")
        if self._forced["shared_trunk"] and not paths.trunk_start:
            raise ValueError(f"shared_trunk=True does not apply: {paths.trunk_why}")

    def _compose_hidden(self, hidden: Tensor, weights: Sequence[float], masks: Tensor | None) -> Tensor:
        """Composed log-probs ``[..., V]`` from the components' final hidden states ``[1+k', ..., d]`` (background
        first) with one head call; with per-component heads where the floor could be reached (exactly the plain
        path then)."""
        head = self._decoding_paths()[1]
        if head.floor_free(hidden, self.min_logprob):
            return head(mix_hidden(hidden, weights, masks)).log_softmax(-1)
        self.floor_fallbacks += 1
        logits = head(hidden)
        return compose_logprobs(logits[0], logits[1:], weights, masks, self.min_logprob)

    @property
    def specs(self) -> list[dict]:
        """One spec dict per expert, in :attr:`names` order (``{}`` when none)."""
        return self._specs

    @specs.setter
    def specs(self, specs: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None) -> None:
        """A list (one per expert), a dict by expert name (missing names get ``{}``), or None."""
        if specs is None:
            specs = [{} for _ in self.names]
        elif isinstance(specs, Mapping):
            unknown = sorted(set(specs) - set(self.names))
            if unknown:
                raise ValueError(f"specs names unknown experts {unknown}; experts are {self.names}")
            specs = [specs.get(name, {}) for name in self.names]
        specs = [{} if s is None else s for s in specs]
        if len(specs) != len(self.names):
            raise ValueError(f"specs has {len(specs)} entries but there are {len(self.names)} experts")
        for name, spec in zip(self.names, specs, strict=True):
            if not isinstance(spec, Mapping):
                raise ValueError(f"spec of expert {name!r} must be a mapping, got {type(spec).__name__}")
        self._specs = [dict(s) for s in specs]

    @property
    def lazy(self) -> bool | str:
        """:meth:`generate`'s ``lazy`` when the call gives none (``False``, ``True`` or ``"decode"``)."""
        return self._lazy

    @lazy.setter
    def lazy(self, lazy: bool | str) -> None:
        self._lazy = _check_lazy(lazy)

    @property
    def composition(self) -> str:
        """``"soft"`` or ``"gated"`` (see the constructor)."""
        return self._composition

    @composition.setter
    def composition(self, composition: str) -> None:
        self._composition = _check_composition(composition)

    # ------------------------------------------------------------------ properties

    @property
    def num_experts(self) -> int:
        return len(self.names)

    @property
    def device(self) -> torch.device:
        module = self.model if self.backend == "adapters" else self.background
        return next(module.parameters()).device

    @property
    def base_model(self) -> PreTrainedModel:
        """The model the adapters backend runs on its ``(k+1)·B`` row blocks (the PeftModel's base model, its LoRA
        layers driven by :mod:`compose.grouped_lora`), or the separate backend's background."""
        return self.model.get_base_model() if self.backend == "adapters" else self.background

    @property
    def position_restart(self) -> int | None:
        """The token at which the models count positions from 0 again (``compose.positions.position_ids``), if any."""
        return position_restart_token(self.base_model)

    @contextmanager
    def packed_weights(self, batch_size: int = 1) -> Iterator[int]:
        """CPU inference on oneDNN-prepacked linear weights inside the block (:mod:`compose.packed_weights`).

        Pays where a forward has several rows: the adapters backend's ``(k+1)·B`` rows (SmolLM2-135M at one
        thread, a 3-row step against a 1-row dense one: 1.45× packed and 1.68× dense on an AVX2 CPU, 0.90× packed
        and 1.97× dense on an AVX-512 one), or ``B > 1``; on the AVX2 CPU one row was faster on dense weights.
        Packing costs about a copy of the weights, so wrap many calls in one block;
        weights memory-mapped from a safetensors file stay mapped meanwhile (the packed copies then add their size
        to the resident set). A no-op on GPUs and without oneDNN. Yields the number of linear layers packed.
        Not with ``generate(compile=...)`` (inductor cannot lower the packed linears).
        """
        from compose.packed_weights import packed_linear_weights

        rows = batch_size * (self.num_experts + 1 if self.backend == "adapters" else 1)
        self._decoding_paths()  # checked on the dense weights
        with contextlib.ExitStack() as stack:
            packed = sum(stack.enter_context(packed_linear_weights(m, rows)) for m in self.step_modules())
            outer = self.__dict__.get("_packed", False)  # an enclosing block's state, restored on exit
            self.__dict__["_packed"] = outer or packed > 0
            stack.callback(self.__dict__.__setitem__, "_packed", outer)
            yield packed

    # ------------------------------------------------------------------ decoding steps
    # What `compose.decoding` builds its steps from: the modules a step runs, an empty cache for each, and one
    # forward of every component. The adapters backend's row blocks reach its LoRA layers through the context
    # `generate` and `score` open around these calls (`compose.grouped_lora`).

    def component_logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        caches: Sequence[Cache] | None,
        last_only: bool,
        forwards: Sequence[Callable[..., Any]] | None = None,
    ) -> Tensor:
        """Logits of every component, float32 ``[k+1, B, T', V]`` (``T' = 1`` when ``last_only``), background first.

        Args:
            input_ids, attention_mask, position_ids: ``[B, T]`` (the attention mask and position ids cover every
                token the caches hold plus ``input_ids``).
            caches: one cache per module of :meth:`step_modules` (updated in place), or None (no cache).
            last_only: keep only the last position's logits.
            forwards: callables that stand in for the modules of :meth:`step_modules` (their compiled forwards),
                in the same order.
        """
        kwargs: dict[str, Any] = {"use_cache": caches is not None}
        if last_only and accepts(self.base_model, "logits_to_keep"):
            kwargs["logits_to_keep"] = 1
        if self.backend == "adapters":
            # the row blocks reach every LoRA layer through what `_running` set up (grouped_lora.adapter_rows)
            n, b = self.num_experts + 1, input_ids.shape[0]
            out = (self.base_model if forwards is None else forwards[0])(
                input_ids=row_blocks(input_ids, n),
                attention_mask=row_blocks(attention_mask, n),
                position_ids=row_blocks(position_ids, n),
                cache=None if caches is None else caches[0],
                **kwargs,
            )
            logits = out.logits[:, -1:] if last_only else out.logits
            return logits.float().view(n, b, *logits.shape[1:])
        models = [self.background, *self.experts]
        outs = []
        for i, m in enumerate(models if forwards is None else forwards):
            out = m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=None if caches is None else caches[i],
                **kwargs,
            )
            outs.append(out.logits[:, -1:] if last_only else out.logits)
        return torch.stack([o.float() for o in outs])

    def step_modules(self) -> list[nn.Module]:
        """The modules a decoding step runs: the adapters backend's :attr:`base_model`, or every model (background
        first)."""
        return [self.base_model] if self.backend == "adapters" else [self.background, *self.experts]

    def new_caches(self) -> list[DynamicCache]:
        """An empty KV cache per module of :meth:`step_modules`."""
        return [DynamicCache(config=m.config) for m in self.step_modules()]

    @contextmanager
    def _running(self, batch_size: int, trunk: bool = True) -> Iterator[None]:
        """Eval mode and, for the adapters backend, the mixed-adapter batch of ``batch_size`` rows per component
        (:func:`compose.grouped_lora.adapter_rows`) for a whole ``generate`` / ``score`` call; with ``trunk``, the
        shared trunk where :attr:`paths` has one (:func:`compose.trunk.shared_trunk`)."""
        start = self._decoding_paths()[0].trunk_start if trunk and self.backend == "adapters" else 0
        with contextlib.ExitStack() as stack:
            stack.enter_context(eval_mode(self))
            if self.backend == "adapters":
                stack.enter_context(adapter_rows(self.model, self.names, batch_size))
            if start:
                stack.enter_context(shared_trunk(self.base_model, TrunkState(start, batch_size)))
            yield

    def component_hidden(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        caches: Sequence[Cache] | None,
        last_only: bool,
    ) -> Tensor:
        """Final (normalized) hidden states of every component ``[k+1, B, T', d]`` (``T' = 1`` when ``last_only``),
        background first: what each output head takes. Arguments as in :meth:`component_logits`."""
        if self.backend == "adapters":
            n, b = self.num_experts + 1, input_ids.shape[0]
            hidden = _decoder_hidden(self.base_model, row_blocks(input_ids, n), row_blocks(attention_mask, n),
                                     row_blocks(position_ids, n), None if caches is None else caches[0], last_only)
            return hidden.view(n, b, *hidden.shape[1:])
        models = [self.background, *self.experts]
        return torch.stack([_decoder_hidden(m, input_ids, attention_mask, position_ids,
                                            None if caches is None else caches[i], last_only)
                            for i, m in enumerate(models)])

    @torch.no_grad()
    def component_logprobs(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Teacher-forced next-token log-probs of every component.

        With an ``attention_mask``, position ids are computed from it as Hugging Face ``generate`` does
        (so left-padded rows score like unpadded ones).

        Returns:
            background log-probs ``[B, T, V]`` and experts' ``[k, B, T, V]``, float32.
        """
        input_ids = input_ids.to(self.device)
        position_ids = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if attention_mask is not None or self.position_restart is not None:
            position_ids = position_ids_of(input_ids, attention_mask, self.position_restart)
        with self._running(input_ids.shape[0]):
            logits = self.component_logits(input_ids, attention_mask, position_ids, caches=None, last_only=False)
        lp = logits.log_softmax(-1)
        return lp[0], lp[1:]

    @torch.no_grad()
    def component_logit_blocks(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, chunk_size: int | None = None
    ) -> Iterator[tuple[slice, Tensor]]:
        """Teacher-forced logits of every component, one block of positions at a time.

        The models run once over all positions (keeping only the hidden states their output heads take);
        each block then runs the heads on ``chunk_size`` positions, so at most ``(k+1)·B·chunk_size·V`` float32
        logits exist at once, never ``(k+1)·B·T·V``. A model whose head cannot be run on its own (see
        :func:`compose.heads.hidden_and_head`) yields one block of all positions.

        Args:
            input_ids, attention_mask: as in :meth:`component_logprobs`.
            chunk_size: positions per block (default: as many as keep one block within ``SCORE_CHUNK_BYTES``,
                see :func:`score_chunk_size`).

        Yields:
            ``(positions, logits)``: a slice of the ``T`` axis and float32 ``[k+1, B, c, V]`` (background first).
        """
        input_ids, attention_mask, position_ids = self._teacher_forced(input_ids, attention_mask, chunk_size)
        batch, length = input_ids.shape
        n = self.num_experts + 1
        with self._running(batch):
            heads = self._final_hidden_states(input_ids, attention_mask, position_ids)
            if heads is None:  # an output head we cannot call on its own: all positions at once
                yield slice(0, length), self.component_logits(input_ids, attention_mask, position_ids, None, last_only=False)
                return
            out_dim, config_vocab = vocab_sizes(self.base_model)[::-1]
            chunk = chunk_size or score_chunk_size(n, batch, out_dim or config_vocab or 1)
            for start in range(0, length, chunk):
                positions = slice(start, min(start + chunk, length))
                if len(heads) == 1:  # the adapters backend's (k+1)·B rows, one head call
                    head, hidden = heads[0]
                    logits = head(hidden[:, positions]).float()
                else:
                    logits = torch.stack([head(hidden[:, positions]).float() for head, hidden in heads])
                yield positions, logits.view(n, batch, *logits.shape[-2:])
                del logits

    def _teacher_forced(self, input_ids: Tensor, attention_mask: Tensor | None,
                        chunk_size: int | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Scoring's inputs on the device, checked, with their position ids (None where the model's own do)."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
        input_ids = input_ids.to(self.device)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        position_ids = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if attention_mask is not None or self.position_restart is not None:
            position_ids = position_ids_of(input_ids, attention_mask, self.position_restart)
        self._decoding_paths()
        return input_ids, attention_mask, position_ids

    @torch.no_grad()
    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        masks: Tensor | None = None,
        *,
        chunk_size: int | None = None,
    ) -> Tensor:
        """Composed, normalized next-token log-probs ``[B, T, V]`` (teacher-forced, float32).

        Composed block by block of positions (:meth:`component_logit_blocks`): besides the ``[B, T, V]``
        result, at most ``(k+1)·B·chunk_size·V`` float32 logits (and the composition's temporaries of that
        size) are held at once, never ``(k+1)·B·T·V``. With one head (:attr:`paths`) a block is the head's
        ``B·chunk_size·V`` logits of the mixed hidden states: no more than one component's.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: optional ``[B, T]`` (left or right padding; needed whenever the batch is padded).
            masks: optional bool ``[k, B, T]``; where False that expert's factor is 1 (gated composition).
            chunk_size: positions per block (default: see :func:`score_chunk_size`).
        """
        if masks is not None:
            expected = (self.num_experts, *input_ids.shape)
            if tuple(masks.shape) != expected:
                raise ValueError(f"masks has shape {tuple(masks.shape)}, expected {expected} ([k, B, T])")
            masks = masks.to(self.device)
        if self.num_experts and self._decoding_paths()[0].one_head:
            return self._score_one_head(input_ids, attention_mask, masks, chunk_size)
        out = None
        for positions, logits in self.component_logit_blocks(input_ids, attention_mask, chunk_size=chunk_size):
            block = compose_logprobs(logits[0], logits[1:], self.weights,
                                     None if masks is None else masks[:, :, positions], self.min_logprob)
            del logits
            if out is None:
                out = block.new_empty(block.shape[0], input_ids.shape[1], block.shape[-1])
            out[:, positions] = block
        return out

    def _score_one_head(self, input_ids: Tensor, attention_mask: Tensor | None, masks: Tensor | None,
                        chunk_size: int | None) -> Tensor:
        """:meth:`score` with one head call per block on the mixed hidden states (the one-head identity)."""
        input_ids, attention_mask, position_ids = self._teacher_forced(input_ids, attention_mask, chunk_size)
        batch, length = input_ids.shape
        with self._running(batch):
            hidden = self.component_hidden(input_ids, attention_mask, position_ids, None, last_only=False)
        head = self._decoding_paths()[1]
        chunk = chunk_size or score_chunk_size(1, batch, head.head.out_features)
        out = None
        for start in range(0, length, chunk):
            positions = slice(start, min(start + chunk, length))
            block = self._compose_hidden(hidden[:, :, positions], self.weights,
                                         None if masks is None else masks[:, :, positions])
            if out is None:
                out = block.new_empty(batch, length, block.shape[-1])
            out[:, positions] = block
            del block
        return out

    def _final_hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> list[tuple[Callable[[Tensor], Tensor], Tensor]] | None:
        """``(output head, its input at every position)`` per forward: one (the ``(k+1)·B`` batch) for the adapters
        backend, one per component for the separate one. None when a model's head cannot be run on its own."""
        if self.backend == "adapters":
            n = self.num_experts + 1
            blocks = [row_blocks(t, n) for t in (input_ids, attention_mask, position_ids)]
            pairs = [hidden_and_head(self.base_model, *blocks)]
        else:
            pairs = [hidden_and_head(m, input_ids, attention_mask, position_ids)
                     for m in [self.background, *self.experts]]
        return None if any(p is None for p in pairs) else pairs

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, masks: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        """Same as :meth:`score`."""
        return self.score(input_ids, attention_mask, masks, **kwargs)

    def interval_masks(self, input_ids: Tensor, prompt_len: int) -> Tensor:
        """Bool ``[k, B, T]``: the gates of gated :meth:`generate`, teacher-forced, for ``score(masks=...)``.

        Equals running each expert's stopping-time detector step by step over ``input_ids[:, prompt_len:]``
        (see :func:`compose.gating.interval_masks`); experts without an ``interval`` spec are all True.
        """
        from compose.gating import interval_masks

        return interval_masks(self.specs, self._gating_tokenizer(), input_ids, prompt_len)

    def _gating_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("gated composition decodes the generated tokens: give ComposedLM a tokenizer")
        return self.tokenizer

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        gates: Sequence[Gate | None] | None = None,
        generator: torch.Generator | None = None,
        stop_strings: Sequence[str] | None = None,
        tokenizer=None,
        lazy: bool | str | None = None,
        compile: bool | str = False,
        streamer=None,
        stopping_criteria: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> LongTensor:
        """Decode from the composed model, one token at a time, with KV caches.

        The prompt is prefilled once, then each step feeds only the new token (one forward of the ``(k+1)·B``
        mixed-adapter batch, or one forward per component); left-padded prompts are handled like Hugging Face
        ``generate``. Every argument is described under *Generation options* in :class:`ComposedLM`, with what
        raises ``ValueError`` or ``TypeError``.

        Args:
            input_ids: ``[B, T]`` prompt ids, left- or right-padded (``attention_mask``: ``[B, T]``, else inferred).
            max_new_tokens: at most this many tokens are appended (greedy unless ``do_sample``).

        Returns:
            ``[B, T + n]`` prompt plus generated tokens, ``n <= max_new_tokens`` (stops early once every
            sequence has emitted EOS or a stop string; finished rows are filled with ``pad_token_id``).
        """
        device = self.device
        eos, pad = self._special_tokens(eos_token_id, pad_token_id, device)
        input_ids, attention_mask = _checked_prompt(input_ids, attention_mask, eos, pad, device)
        if stopping_criteria is not None and pad is None:
            raise ValueError("stopping_criteria need a pad_token_id (or an eos_token_id) to fill the rows that stopped")
        if streamer is not None:
            streamer.put(input_ids.cpu())
        gates = self._gates(gates, prompt_len=input_ids.shape[1])
        choose = _token_chooser(do_sample, temperature, top_k, top_p, generator)
        stopper = _stop_criteria(stop_strings, self.tokenizer if tokenizer is None else tokenizer, pad)
        lazy, static_length, mode = self._decoding_choice(compile, lazy, gates is not None,
                                                          input_ids.shape[1] + max_new_tokens)
        with self._decoding(input_ids.shape[0], lazy, static_length, mode) as decode:
            return self._decode(decode, input_ids, attention_mask, max_new_tokens, gates, choose,
                                _Finishing(eos, pad, stopper, input_ids.shape[1], stopping_criteria), streamer)

    def _decoding_choice(self, compile: bool | str, lazy: bool | str | None, gated: bool,
                         length: int) -> tuple[bool | str, int | None, str | None]:
        """:meth:`generate`'s ``compile`` and ``lazy``, checked and resolved for a ``length``-token context: the lazy
        setting, the static cache length (None: eager), the ``torch.compile`` mode (None: torch's default)."""
        compile = check_compile(compile, packed_weights=self.__dict__.get("_packed", False))
        if lazy is None:  # the model's default yields to an explicit compile
            lazy = False if compile else self.lazy
        lazy = _check_lazy(lazy)
        if not gated:  # nothing to skip
            lazy = False
        if compile and lazy:
            raise ValueError("generate(compile=...) runs every component at every step: it does not combine with lazy")
        static_length = static_cache_length(length) if compile else None
        return lazy, static_length, compile if isinstance(compile, str) else None

    def _decode(self, decode: PlainSteps | CompiledSteps | LazySteps, input_ids: Tensor, attention_mask: Tensor,
                max_new_tokens: int, gates: Sequence[Gate | None] | None,
                choose: Callable[[Tensor, Tensor], Tensor], finishing: _Finishing, streamer: Any = None) -> Tensor:
        """The decoding loop of :meth:`generate`: compose the step's logits, choose the next tokens, stop when every
        row has finished. ``decode`` is lazy exactly when it is a :class:`LazySteps`."""
        batch, device = input_ids.shape[0], input_ids.device
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        lazy = isinstance(decode, LazySteps)
        positions = position_ids_of(input_ids, attention_mask, self.position_restart)
        for step in range(max_new_tokens):
            masks = _gate_masks(gates, input_ids, device)
            active = _active_experts(masks, unfinished) if lazy else None
            scores = self._composed_step(decode(input_ids, attention_mask, positions, active), masks, active,
                                         decode.hidden)
            next_tokens = finishing.fill(choose(input_ids, scores), unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            done = finishing.done(next_tokens, input_ids, scores)
            if done is not None:
                unfinished &= ~done
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1)
            if step == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            following = next_position_ids(positions[:, -1:], next_tokens, self.position_restart)
            positions = torch.cat([positions, following], dim=-1)
        if streamer is not None:
            streamer.end()
        return input_ids

    def _composed_step(self, out: Tensor, masks: Tensor | None, active: list[int] | None,
                       hidden: bool = False) -> Tensor:
        """Composed log-probs ``[B, V]`` of one step from its logits ``[1 + k', B, V]``, or with ``hidden`` its final
        hidden states ``[1 + k', B, d]`` (background first; with ``active``, only those experts ran)."""
        weights = self.weights
        if active is not None:  # the skipped experts' gates are closed on every unfinished row: their factor is 1 there
            weights, masks = [self.weights[i] for i in active], masks[active]
        if hidden:
            return self._compose_hidden(out, weights, masks)
        return compose_logprobs(out[0], out[1:], weights, masks, self.min_logprob)

    def _gates(self, gates: Sequence[Gate | None] | None, prompt_len: int) -> Sequence[Gate | None] | None:
        """``generate``'s gates: as given, or with ``composition="gated"`` and none given, the specs' intervals."""
        if gates is None and self.composition == "gated":
            from compose.gating import gates_from_specs

            gates = gates_from_specs(self.specs, self._gating_tokenizer(), prompt_len=prompt_len)
        if gates is not None and len(gates) != self.num_experts:
            raise ValueError(f"gates has {len(gates)} entries but there are {self.num_experts} experts")
        return gates

    @contextmanager
    def _decoding(self, batch_size: int, lazy: bool | str, static_length: int | None = None,
                  mode: str | None = None) -> Iterator[PlainSteps | CompiledSteps | LazySteps]:
        """Eval mode and the step function of :meth:`generate`: every component each step (compiled when a static
        cache length is given), or the lazy one."""
        paths = self._decoding_paths()[0]
        hidden = paths.one_head and static_length is None and self.num_experts > 0
        if not lazy:
            with self._running(batch_size, trunk=static_length is None):
                yield (PlainSteps(self, hidden) if static_length is None
                       else CompiledSteps(self, static_length, mode))
            return
        with eval_mode(self):
            prompt = lazy == "decode"
            if self.backend != "adapters":
                yield LazySteps(self, prefill_all=prompt, hidden=hidden)
                return
            with lora_blocks(self.model, self.names, batch_size) as select, contextlib.ExitStack() as stack:
                trunk = None
                if paths.trunk_start:
                    trunk = stack.enter_context(shared_trunk(self.base_model,
                                                             TrunkState(paths.trunk_start, batch_size, record=[])))
                yield LazySteps(self, select, prefill_all=prompt, hidden=hidden, trunk=trunk)

    def _special_tokens(
        self, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None, device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        gen_config = getattr(self.base_model, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
            if eos_token_id is None and gen_config is not None:
                eos_token_id = gen_config.eos_token_id
        if pad_token_id is None:
            pad_token_id = getattr(self.tokenizer, "pad_token_id", None)
            if pad_token_id is None and gen_config is not None:
                pad_token_id = gen_config.pad_token_id
        if eos_token_id is None or (isinstance(eos_token_id, Sequence) and len(eos_token_id) == 0):
            pad = None if pad_token_id is None else torch.tensor(int(pad_token_id), device=device)
            return None, pad
        eos = torch.as_tensor(eos_token_id, dtype=torch.long, device=device).flatten()
        pad = eos[0] if pad_token_id is None else torch.tensor(int(pad_token_id), device=device)
        return eos, pad


# ---------------------------------------------------------------------- helpers


def _layer_span(start: int) -> str:
    return "layer 0" if start == 1 else f"layers 0-{start - 1}"


def _decoder_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                    cache: Cache | None, last_only: bool) -> Tensor:
    """One forward of ``model``'s decoder: the final hidden states ``[rows, T', d]``."""
    out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=cache is not None)
    hidden = out.last_hidden_state
    return hidden[:, -1:] if last_only else hidden


def _check_composition(composition: str) -> str:
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
    return composition


def _checked_prompt(input_ids: Tensor, attention_mask: Tensor | None, eos: Tensor | None, pad: Tensor | None,
                    device: torch.device) -> tuple[Tensor, Tensor]:
    """``generate``'s prompt on ``device``: its attention mask (given or inferred), rows left-aligned."""
    input_ids = input_ids.to(device)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, eos, pad)
    attention_mask = attention_mask.to(device).long()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
        )
    return _left_aligned(input_ids, attention_mask)


def _infer_attention_mask(input_ids: Tensor, eos: Tensor | None, pad: Tensor | None) -> Tensor:
    """The prompt's attention mask when the caller gave none (see :meth:`ComposedLM.generate`)."""
    ones = torch.ones_like(input_ids)
    if pad is None or not bool((input_ids == pad).any()):
        return ones
    is_pad = input_ids == pad
    if eos is None or not bool(torch.isin(eos, pad).any()):
        return (~is_pad).long()
    # pad = EOS: only a leading run can be padding (a prompt does not start with EOS); a trailing one could be
    # right padding or a real EOS, and guessing wrong silently changes the output.
    if bool(is_pad[:, -1].any()):
        row = int(is_pad[:, -1].nonzero()[0])
        raise ValueError(
            f"generate: row {row} of input_ids ends with the pad token {int(pad)}, which is also EOS: right "
            "padding cannot be told from an EOS without attention_mask; pass attention_mask (or pad on the left)"
        )
    return (is_pad.long().cumprod(dim=1) == 0).long()


def _left_aligned(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows with padding anywhere but on the left (right padding) moved to left padding, order kept."""
    if bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all()):
        return input_ids, attention_mask
    order = torch.argsort(attention_mask, dim=1, stable=True)  # padding first, then the tokens in order
    return input_ids.gather(1, order), attention_mask.gather(1, order)


def _stop_criteria(stop_strings: Sequence[str] | None, tokenizer, pad: Tensor | None):
    """transformers' ``StopStringCriteria`` for ``stop_strings`` (None when there are none)."""
    if stop_strings is None:
        return None
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop_strings = [s for s in stop_strings if s]
    if not stop_strings:
        return None
    if tokenizer is None:
        raise ValueError("stop_strings are matched on decoded tokens: pass tokenizer= or give ComposedLM a tokenizer")
    if pad is None:
        raise ValueError("stop_strings need a pad_token_id (or an eos_token_id) to fill the rows that stopped")
    from transformers import StopStringCriteria

    return StopStringCriteria(tokenizer, list(stop_strings))


def _token_chooser(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                   generator: torch.Generator | None) -> Callable[[Tensor, Tensor], Tensor]:
    """``choose(input_ids, scores [B, V]) -> next tokens [B]``: the argmax, or a sample after the warpers."""
    if not do_sample:
        return lambda input_ids, scores: scores.argmax(-1)
    processors = _warpers(temperature, top_k, top_p)

    def sample(input_ids: Tensor, scores: Tensor) -> Tensor:
        probs = processors(input_ids, scores).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return sample


@dataclass
class _Finishing:
    """When a row of ``generate`` finishes (it emitted an EOS id, its generated text holds a stop string, or the
    caller's ``stopping_criteria`` says so) and what fills it from then on (``pad``)."""

    eos: Tensor | None
    pad: Tensor | None
    stopper: Any
    prompt_len: int
    criteria: Callable[[Tensor, Tensor], Tensor] | None = None

    def fill(self, next_tokens: Tensor, unfinished: Tensor) -> Tensor:
        """``next_tokens`` with the finished rows' replaced by the pad token."""
        if self.eos is None and self.stopper is None and self.criteria is None:
            return next_tokens
        return torch.where(unfinished, next_tokens, self.pad)

    def done(self, next_tokens: Tensor, input_ids: Tensor, scores: Tensor | None = None) -> Tensor | None:
        """Bool ``[B]``: rows that finish with ``next_tokens`` (the last column of ``input_ids``; ``scores`` are the
        step's composed log-probs); None when no row can finish before ``max_new_tokens``."""
        done = None if self.eos is None else torch.isin(next_tokens, self.eos)
        if self.stopper is not None:
            stopped = self.stopper(input_ids[:, self.prompt_len:], None).to(next_tokens.device)
            done = stopped if done is None else done | stopped
        if self.criteria is not None:
            stopped = torch.as_tensor(self.criteria(input_ids, scores), device=next_tokens.device).bool()
            done = stopped if done is None else done | stopped
        return done


def _warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


def _gate_masks(gates: Sequence[Gate | None] | None, prefix: Tensor, device: torch.device) -> Tensor | None:
    if gates is None:
        return None
    rows = []
    batch = prefix.shape[0]
    for i, gate in enumerate(gates):
        if gate is None:
            rows.append(torch.ones(batch, dtype=torch.bool, device=device))
            continue
        value = gate(prefix)
        # an IntervalGate's answer is already a bool [B] on the CPU: no conversions (a few µs each, every step)
        if not (type(value) is Tensor and value.dtype == torch.bool and value.shape == (batch,)
                and value.device == device):
            value = torch.as_tensor(value, device=device).to(torch.bool).reshape(-1)
            if value.numel() == 1:
                value = value.expand(batch)
            if value.numel() != batch:
                raise ValueError(f"gate {i} returned {value.numel()} values for a batch of {batch}")
        rows.append(value)
    return torch.stack(rows)


LAZY = (False, True, "decode")


def _check_lazy(lazy: bool | str) -> bool | str:
    if lazy not in LAZY or (lazy is not False and lazy is not True and not isinstance(lazy, str)):
        raise ValueError(f"lazy must be one of {LAZY}, got {lazy!r}")
    return lazy


def _active_experts(masks: Tensor, unfinished: Tensor) -> list[int]:
    """Experts whose gate is open on some unfinished row (``masks [k, B]``, ``unfinished [B]``)."""
    return [i for i, is_open in enumerate((masks & unfinished).any(-1).tolist()) if is_open]


SCORE_CHUNK_BYTES = 1 << 28  # float32 logits of one block of `ComposedLM.score` (256 MiB)


def score_chunk_size(components: int, batch_size: int, vocab_size: int, budget: int = SCORE_CHUNK_BYTES) -> int:
    """Positions per block of :meth:`ComposedLM.score`: the most whose ``[components, B, c, V]`` float32 logits
    fit in ``budget`` bytes (at least 1)."""
    return max(1, budget // (4 * components * batch_size * vocab_size))
