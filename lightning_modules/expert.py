"""Experts trained to be composable: task NLL plus the off-mask regularizer of docs/method.md, the regularizer.

Several experts train at once. With LoRA (default) they are adapters of one `PeftModel` on the frozen
background, and a batch mixing the experts' rows is ONE forward with peft's per-row `adapter_names`; the
background's distribution comes from the same model under `disable_adapter()` and `no_grad`. With full
fine-tuning each expert is its own copy and the background a frozen copy.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from compose import ComposedLM
from compose.grouped_lora import peft_adapter_names
from compose.heads import hidden_and_head
from compose.metrics import ActiveSetPrecisionRecall, MaskedDivergence
from compose.model_io import pretrained_causal_lm
from compose.modules import eval_mode
from compose.positions import model_position_ids
from compose.trunk import decoder_layers
from lightning_modules.background import training_position_ids
from lightning_modules.optim import adamw_with_schedule
from losses import (
    IGNORE_INDEX,
    check_divergence_args,
    divergence_spec,
    off_mask_divergence,
    region_positions,
    task_nll,
)
from losses.background_cache import CACHE_KINDS, BackgroundCache, BackgroundTopK
from losses.chunked import Head, RowSum, chunked_row_sums
from losses.features import FeatureMap, feature_divergence, feature_masks, owned_matrix

Mode = Literal["lora", "full", "head"]
Regularizer = Literal["token", "features"]
MODES: tuple[str, ...] = get_args(Mode)
REGULARIZERS: tuple[str, ...] = get_args(Regularizer)
_ANY = object()  # a reference to a setting that names no value
_TOP_LAYERS = re.compile(r"top_[1-9][0-9]*")
HEAD_MODULES = ("lm_head",)  # LoRA targets that name the output head, which no decoder layer holds
# Regularizer weights of marked positions -> the training rows' column that marks them (the text task's).
SPAN_WEIGHTS = {"reg_after_close": "after_close", "reg_inside_foreign": "inside_foreign", "reg_at_open": "at_open"}


def setting_name(name: str | None, value: Any = _ANY) -> str:
    """How `ExpertSettings`' errors name a setting: `loss_chunk_size`, `regularizer='features'`, or a bare value."""
    if name is None:
        return repr(value)
    return name if value is _ANY else f"{name}={value!r}"


class SettingsError(ValueError):
    """Settings of `ExpertSettings` that do not go together.

    `template` refers to settings by placeholder; `refs` maps each placeholder to `(field,)`, `(field, value)` or
    `(None, value)`. The message names them with `setting_name`; `render` names them another way (the pipeline
    words them as its config keys), so each rule is written once.
    """

    def __init__(self, template: str, **refs: tuple) -> None:
        self.template, self.refs = template, refs
        super().__init__(self.render(setting_name))

    def render(self, name: Callable[..., str]) -> str:
        return self.template.format(**{key: name(*ref) for key, ref in self.refs.items()})


@dataclass(frozen=True)
class ExpertSettings:
    """How `ExpertLM` trains its experts: one frozen object, checked on construction (`__post_init__` holds every
    rule about which settings go together). The defaults are the config schema's (`expert:` of `train.py`).

    Attributes:
        mode: "lora" (peft adapters), "full" (a full copy per expert) or "head" (a copy per expert whose output
            layer alone trains: the linear setting of docs/method.md, when the rule is exact).
        lora_r, lora_alpha, target_modules: the LoRA adapters' settings.
        lora_layers: the decoder layers that carry adapters (peft's `layers_to_transform`): None (all), `"top_L"`
            (the top L layers) or a tuple of layer indices; `target_modules="all-linear"` then means the linear
            layers of those decoder layers. Not with the output head among the targets (`lm_head`).
        reg_weight: λ of the regularizer; 0 is plain fine-tuning.
        reg_after_close: how many times the regularizer counts the first position after an interval closes, the
            expert's own or a foreign span of its regularizer rows (the rows' `after_close` column, text task), 1
            counting it as any other: where experts drift alike, the rule adds their drifts.
        reg_inside_foreign: how many times the regularizer counts a position inside a random foreign span of its
            regularizer rows (`inside_foreign` column, text task; 1: as any other): there another expert is active
            in a composition, and this expert's drift is multiplied into that expert's choice.
        reg_at_open: how many times the regularizer counts the position predicting the token that opens an
            interval, the expert's own or a foreign span of its regularizer rows (`at_open` column, text task; 1: as
            any other): experts that each lower an opening a little keep another expert's interval from being written.
        divergence, jsd_beta, temperature: the divergence `D`, a name in `losses.DIVERGENCES`.
        task_loss_on_mask_only: score the task NLL on mask positions only.
        lr, weight_decay, warmup_ratio, max_steps: AdamW and its warm-up/cosine schedule.
        active_threshold: divergence above which a position counts as active (precision/recall).
        log_every_n_steps: how often the per-expert training metrics are computed and logged.
        regularizer: "token" (`off_mask_divergence`) or "features" (`losses.feature_divergence`: per feature
            marginal of the task's feature map, off the mask on the features an expert owns, everywhere on the
            others).
        background_top_k: None: the regularizer runs the background on every batch. An integer `k`: the
            background's distribution at each off-mask target position is cached (`losses.background_cache`: its
            top-k tokens and the tail mass) the first time a (row, corruption variant) is seen, and read from the
            cache after that; training batches must carry `row_index` and `corruption_variant`
            (`TaskDataModule(corruption_variants=n)`). Exact when `k` covers the vocabulary.
        position_jump: 0, or the largest random jump of each training row's position ids, for the expert and its
            background alike (`lightning_modules.background.training_position_ids`).
        loss_chunk_size: None: the training losses take the full `[B, T, V]` logits. An integer `c`: they are
            computed from the models' final hidden states at the positions they count only (no prompt position
            reaches a head), `B·c` positions at a time, each block's logits recomputed in backward
            (`losses.chunked`): the same losses, with ~`B·c·V` logits held instead of `B·T·V`.
    """

    mode: Mode = "lora"
    lora_r: int = 8
    lora_alpha: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    lora_layers: str | tuple[int, ...] | None = None
    reg_weight: float = 3.0
    reg_after_close: float = 1.0
    reg_inside_foreign: float = 1.0
    reg_at_open: float = 1.0
    divergence: str = "forward_kl"
    jsd_beta: float = 0.5
    temperature: float = 3.0
    task_loss_on_mask_only: bool = False
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    max_steps: int = 150
    active_threshold: float = 0.01
    log_every_n_steps: int = 25
    regularizer: Regularizer = "token"
    background_top_k: int | None = None
    position_jump: int = 0
    loss_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.lora_layers, list | tuple):
            object.__setattr__(self, "lora_layers", tuple(self.lora_layers))
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.regularizer not in REGULARIZERS:
            raise ValueError(f"regularizer={self.regularizer!r} is not one of {', '.join(REGULARIZERS)}")
        check_divergence_args(self.divergence, self.jsd_beta, self.temperature)
        chunk = self.loss_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"loss_chunk_size must be a positive number of positions or None, got {chunk!r}")
        self._check_together()

    def _check_together(self) -> None:
        """The settings that do not go together, each rule once."""
        chunk, cache, none = ("loss_chunk_size",), ("background_top_k",), (None, None)
        self._check_layers()
        for key in SPAN_WEIGHTS:
            weight = getattr(self, key)
            if weight < 0:
                raise SettingsError("{weight} must be >= 0 (1 weighs those positions as any other)",
                                    weight=(key, weight))
            if weight != 1 and self.regularizer == "features":
                raise SettingsError("{weight} needs {token} (the feature regularizer weighs every position alike)",
                                    weight=(key, weight), token=("regularizer", "token"))
        if self.regularizer == "features" and divergence_spec(self.divergence).needs_written:
            raise SettingsError("{divergence} needs {token} (feature marginals have no written token)",
                                divergence=("divergence", self.divergence), token=("regularizer", "token"))
        if self.position_jump and self.background_top_k is not None:
            raise SettingsError("{jump} cannot be used with {cache} (the cache holds one set of positions per row): "
                                "set one of them to 0 / {none}", jump=("position_jump",), cache=cache, none=none)
        if self.background_top_k is not None and self.divergence not in CACHE_KINDS:
            kinds = list(CACHE_KINDS)
            raise SettingsError("{cache} needs {divergence} " + f"{', '.join(kinds[:-1])} or {kinds[-1]} "
                                f"({self.divergence} is not cacheable: it needs the background's full distribution); "
                                "set {no_cache}", cache=cache, divergence=("divergence",), no_cache=(*cache, None))
        if self.background_top_k is not None and self.regularizer == "features":
            raise SettingsError("{cache} cannot be used with {features}: it needs the background's full logits; set "
                                "{no_cache}", cache=cache, features=("regularizer", "features"),
                                no_cache=(*cache, None))
        if self.loss_chunk_size is None:
            return
        if self.background_top_k is not None:  # the cache gathers off-mask positions of the whole batch at once
            raise SettingsError("{chunk} cannot be used with {cache}: set one of them to {none}", chunk=chunk,
                                cache=cache, none=none)
        if self.regularizer == "features":  # `feature_divergence` has no block-wise form
            raise SettingsError("{chunk} cannot be used with {features}: use {token} or {no_chunk}", chunk=chunk,
                                features=("regularizer", "features"), token=("regularizer", "token"),
                                no_chunk=(*chunk, None))

    def _check_layers(self) -> None:
        """`lora_layers`: its form, and LoRA targets it can go with (peft's `layers_to_transform` needs a list of
        module names; `all-linear` is resolved to one per model)."""
        layers = self.lora_layers
        if layers is None:
            return
        ref = ("lora_layers", list(layers) if isinstance(layers, tuple) else layers)
        if isinstance(layers, str):
            if not _TOP_LAYERS.fullmatch(layers):
                raise SettingsError("{layers}: give top_L (the top L decoder layers, e.g. top_4) or a list of layer "
                                    "indices", layers=ref)
        elif not isinstance(layers, tuple) or not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) \
                or len(set(layers)) != len(layers):
            raise SettingsError("{layers}: give top_L (e.g. top_4) or a non-empty list of distinct layer indices >= 0",
                                layers=ref)
        targets = self.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            raise SettingsError("{layers} needs {targets} as a list of module names or all-linear (peft matches a "
                                "string as a pattern over whole module paths)", layers=ref,
                                targets=("target_modules", targets))
        if not isinstance(targets, str) and any(t.split(".")[-1] in HEAD_MODULES for t in targets):
            raise SettingsError("{layers} puts adapters on some decoder layers, but {targets} adapts the output head, "
                                "which lies outside them: drop lm_head from the targets or set {all_layers}",
                                layers=ref, targets=("target_modules", list(targets)), all_layers=("lora_layers", None))

    def layer_indices(self, num_layers: int) -> list[int] | None:
        """The decoder layers that carry adapters in a model of `num_layers` layers (None: all). Raises a
        `SettingsError` naming `lora_layers` for layers the model does not have."""
        layers = self.lora_layers
        if layers is None:
            return None
        if isinstance(layers, str):
            top = int(layers.removeprefix("top_"))
            if top > num_layers:
                raise SettingsError("{layers}: the model has only " + f"{num_layers} decoder layers",
                                    layers=("lora_layers", layers))
            return list(range(num_layers - top, num_layers))
        beyond = [i for i in layers if i >= num_layers]
        if beyond:
            raise SettingsError("{layers}: the model has decoder layers 0 to " + f"{num_layers - 1} only (no layer "
                                f"{beyond[0]})", layers=("lora_layers", list(layers)))
        return sorted(layers)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (what a checkpoint's and the logs' hyperparameters record)."""
        values = asdict(self)
        for key in ("target_modules", "lora_layers"):
            if isinstance(getattr(self, key), tuple):
                values[key] = list(getattr(self, key))
        return values


class ExpertLM(pl.LightningModule):
    """Fine-tunes one or more experts against a frozen background.

    Training loss: `NLL(task_targets(batch)) + reg_weight · off_mask_divergence`. The NLL scores every target
    of a task row and the expert's own mask of compositional rows (`task_targets`).

    Args:
        background: the background HF causal LM (frozen; LoRA adapters are attached to it).
        names: the experts trained here; a batch's `expert_index` indexes this list.
        settings: how they train (`ExpertSettings`).
        frozen_adapters: {name: adapter folder} of experts trained earlier, loaded (not trained) so
            they join the composition evaluated in validation.
        init_from: {name: folder} of experts that start from an existing PEFT adapter (`mode="lora"`: trained
            further with its own LoRA settings; `mode="full"`: merged into the expert's copy) or full HF model
            (`mode="full"`) instead of a fresh one (`init_kind`; the pipeline checks that each fits the
            background before building this).
        init_base: the model folder the `init_from` folders were trained against, when not the background: a
            full model's difference from it is moved onto the background (`moved_model`); an adapter's moves as
            it is.
        weights: composition weight per expert name (default 1).
        feature_map, owned_features: the task's token bijection and, per expert name, the features it owns
            (default: all), for `settings.regularizer="features"`.
    """

    def __init__(self, background: PreTrainedModel, names: Sequence[str], settings: ExpertSettings = ExpertSettings(),
                 *, frozen_adapters: Mapping[str, str] | None = None, weights: Mapping[str, float] | None = None,
                 feature_map: FeatureMap | None = None, owned_features: Mapping[str, Sequence[str]] | None = None,
                 init_from: Mapping[str, str] | None = None, init_base: str | None = None) -> None:
        super().__init__()
        if not names:
            raise ValueError("ExpertLM needs at least one expert name")
        if frozen_adapters and settings.mode != "lora":
            raise ValueError("frozen_adapters (compose_with) needs mode='lora'")
        if settings.regularizer == "features" and feature_map is None:
            raise ValueError("regularizer='features' needs a feature_map")
        init_from = {n: str(path) for n, path in (init_from or {}).items()}
        for name, path in init_from.items():
            if name not in names:
                raise ValueError(f"init_from names {name!r}, which is not an expert trained here ({list(names)})")
            kind = init_kind(path)
            if settings.mode not in INIT_MODES[kind]:
                raise ValueError(f"init_from[{name!r}]={path} is a {kind} folder: it needs mode "
                                 f"{' or '.join(INIT_MODES[kind])}, got mode={settings.mode!r}")
        self.settings, self.names, self.frozen_names = settings, list(names), list(frozen_adapters or {})
        self.init_from, self.init_base = init_from, init_base
        self.weights, self.feature_map = dict(weights or {}), feature_map
        self.save_hyperparameters({**settings.to_dict(), "names": self.names,
                                   "frozen_adapters": dict(frozen_adapters or {}), "init_from": init_from,
                                   "init_base": init_base,
                                   "weights": self.weights,
                                   "owned_features": {k: list(v) for k, v in (owned_features or {}).items()}})
        self.background_cache = (None if settings.background_top_k is None else
                                 BackgroundCache(settings.background_top_k, temperatures=(settings.temperature, 1.0)))
        if settings.regularizer == "features":
            self.register_buffer("owned", owned_matrix(self.names, owned_features or {}, feature_map), persistent=False)
        for p in background.parameters():
            p.requires_grad_(False)
        if settings.mode == "lora":
            self._attach_adapters(background, frozen_adapters or {})
        else:
            self._copy_experts(background)
        metric = lambda region: nn.ModuleDict({n: MaskedDivergence(region=region) for n in self.names})  # noqa: E731
        self.val_off_mask_kl, self.val_on_mask_kl = metric("off"), metric("on")
        self.val_nll = nn.ModuleDict({n: MeanMetric() for n in self.names})
        self.val_active = nn.ModuleDict({n: ActiveSetPrecisionRecall(threshold=settings.active_threshold)
                                         for n in self.names})

    def _attach_adapters(self, background: PreTrainedModel, frozen_adapters: Mapping[str, str]) -> None:
        """`mode="lora"`: one trainable adapter per expert on the background, and the frozen ones loaded."""
        config = self._lora_config(background)
        first, path = self.names[0], self.init_from.get(self.names[0])
        self.model: nn.Module = (PeftModel.from_pretrained(background, path, adapter_name=first, is_trainable=True)
                                 if path else get_peft_model(background, config, adapter_name=first))
        for name in self.names[1:]:
            if name in self.init_from:  # its own LoRA settings, as saved
                self.model.load_adapter(self.init_from[name], adapter_name=name, is_trainable=True)
            else:
                self.model.add_adapter(name, config)
        for name, path in frozen_adapters.items():
            self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        self.model.set_requires_grad(self.names, True)

    def _lora_config(self, background: PreTrainedModel) -> LoraConfig:
        """The new adapters' `LoraConfig`; with `lora_layers`, on those decoder layers only (`all-linear` then names
        the linear layers inside them: peft takes `layers_to_transform` with a list of module names only)."""
        s = self.settings
        targets = s.target_modules if isinstance(s.target_modules, str) else list(s.target_modules)
        layers = s.layer_indices(background.config.get_text_config().num_hidden_layers)
        if layers is not None and targets == "all-linear":
            targets = linear_module_names(background)
        return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, bias="none", target_modules=targets,
                          layers_to_transform=layers, task_type="CAUSAL_LM")

    def _copy_experts(self, background: PreTrainedModel) -> None:
        """`mode="full"` or `"head"`: a trainable copy per expert (its output layer alone for "head": logits are
        then linear in the trained parameters, the setting where task arithmetic equals composition, docs/method.md
        §2) beside the frozen background."""
        head = self.settings.mode == "head"
        if head and background.get_output_embeddings().weight is background.get_input_embeddings().weight:
            raise ValueError("mode='head' needs untied input/output embeddings")
        self.background = background.eval()
        self.experts = nn.ModuleDict({n: self._expert_copy(background, self.init_from.get(n), self.init_base)
                                      for n in self.names})
        for expert in self.experts.values():
            for p in (expert.get_output_embeddings() if head else expert).parameters():
                p.requires_grad_(True)

    @staticmethod
    def _expert_copy(background: PreTrainedModel, init_from: str | None,
                     init_base: str | None = None) -> PreTrainedModel:
        """A full expert: a copy of the background, or the model of `init_from` (moved onto the background when it
        was trained from `init_base`), or the background with the adapter of `init_from` merged in (its difference
        from the background then trains in full)."""
        if init_from is None:
            return copy.deepcopy(background)
        if init_kind(init_from) == "model":
            expert = pretrained_causal_lm(init_from, dtype=background.dtype)
            if init_base is not None:
                expert = moved_model(expert, pretrained_causal_lm(init_base, dtype=background.dtype), background)
        else:
            expert = PeftModel.from_pretrained(copy.deepcopy(background), init_from).merge_and_unload()
        return expert

    # --- forwards -----------------------------------------------------------------------------
    def expert_logits(self, input_ids: Tensor, attention_mask: Tensor, expert_index: Tensor,
                      position_ids: Tensor | None = None) -> Tensor:
        """Logits of each row's own expert ([B, T, V]): one mixed-adapter forward under LoRA. Position ids default
        to the model's own (`compose.positions.model_position_ids`)."""
        if position_ids is None:
            position_ids = model_position_ids(self._background_model, input_ids, attention_mask)
        if self.settings.mode == "lora":
            adapter_names = [self.names[i] for i in expert_index.tolist()]
            with eval_mode(self.model):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  adapter_names=adapter_names).logits
        out = None
        for i, name in enumerate(self.names):
            rows = (expert_index == i).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            logits = self.experts[name](input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                                        position_ids=None if position_ids is None else position_ids[rows]).logits
            if out is None:
                out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
            out = out.index_copy(0, rows, logits)
        return out

    @torch.no_grad()
    def background_logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """The background's logits: under LoRA, the same model with every adapter disabled.

        `disable_adapter()` is the `PeftModel`'s own (found under any DDP/FSDP wrapper: `peft_model`); the forward
        goes through `self.model`, so that a wrapper that holds the weights sharded (FSDP) gathers them.
        """
        if position_ids is None:
            position_ids = model_position_ids(self._background_model, input_ids, attention_mask)
        if self.settings.mode != "lora":
            with eval_mode(self.background):  # Trainer.fit's train() reaches the frozen copy too
                return self.background(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids).logits
        with self._adapters_disabled():
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

    @contextmanager
    def _adapters_disabled(self) -> Iterator[None]:
        """Under LoRA, the background: every adapter disabled, eval mode."""
        peft = self.peft_model
        with peft.disable_adapter(), eval_mode(self.model):
            # A wrapper that re-enabled adapters would silently regularize toward the expert.
            if any(not m.disable_adapters for m in self.model.modules() if isinstance(m, LoraLayer)):
                raise RuntimeError("disable_adapter() left LoRA layers active: unwrap the model first")
            yield
        # Leaving disable_adapter() re-activates only peft's "active" adapter and freezes the others.
        peft.set_requires_grad(self.names, True)

    # --- the same forwards, stopped short of the output heads (loss_chunk_size) ---------------
    def _expert_heads(self, input_ids: Tensor, attention_mask: Tensor, expert_index: Tensor,
                      position_ids: Tensor | None) -> list[tuple[Tensor, Head, Tensor]]:
        """`(rows, output head, its input [rows, T, d])` of each row's own expert, as `expert_logits` runs them: one
        mixed-adapter forward under LoRA, one per expert with rows otherwise."""
        if self.settings.mode == "lora":
            adapter_names = [self.names[i] for i in expert_index.tolist()]
            # peft's `adapter_names=` holds only for one forward; the hooks stay for the head's own check too
            with eval_mode(self.model), peft_adapter_names(self.model, adapter_names):
                head, hidden = _split_head(self.model, input_ids, attention_mask, position_ids)
            rows = torch.arange(len(adapter_names), device=input_ids.device)
            return [(rows, _head_with_adapter_names(head, self.peft_model.get_output_embeddings(), adapter_names), hidden)]
        out = []
        for i, name in enumerate(self.names):
            rows = (expert_index == i).nonzero(as_tuple=True)[0]
            if rows.numel():
                positions = None if position_ids is None else position_ids[rows]
                head, hidden = _split_head(self.experts[name], input_ids[rows], attention_mask[rows], positions)
                out.append((rows, _rows_ignored(head), hidden))
        return out

    @torch.no_grad()
    def _background_head(self, input_ids: Tensor, attention_mask: Tensor,
                         position_ids: Tensor | None) -> tuple[Head, Tensor]:
        """`(output head, its input [B, T, d])` of the background, as `background_logits` runs it."""
        if self.settings.mode != "lora":
            with eval_mode(self.background):
                head, hidden = _split_head(self.background, input_ids, attention_mask, position_ids)
            return _rows_ignored(head), hidden
        with self._adapters_disabled():
            head, hidden = _split_head(self.model, input_ids, attention_mask, position_ids)
        # a LoRA-wrapped head, called later on its own, is the background's under peft's "__base__" name
        base = ["__base__"] * input_ids.shape[0]
        return _head_with_adapter_names(head, self.peft_model.get_output_embeddings(), base), hidden

    @property
    def _background_model(self) -> nn.Module:
        """The model whose config says how positions count (under LoRA, the PeftModel around the background)."""
        return self.peft_model if self.settings.mode == "lora" else self.background

    @property
    def peft_model(self) -> PeftModel:
        model = self.model
        while not isinstance(model, PeftModel) and hasattr(model, "module"):  # DDP/FSDP wrappers
            model = model.module
        return model

    def composed_model(self, tokenizer=None, names: Sequence[str] | None = None) -> ComposedLM:
        """The background composed with `names` (default: every expert in play, trained and frozen)."""
        weights = self.weights
        names = list(names) if names is not None else self.names + self.frozen_names
        w = [float(weights.get(n, 1.0)) for n in names]
        if self.settings.mode == "lora":
            return ComposedLM.from_peft(self.peft_model, names, weights=w, tokenizer=tokenizer)
        return ComposedLM(self.background, [self.experts[n] for n in names], weights=w, names=names,
                          tokenizer=tokenizer)

    # --- training -----------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        h = self.settings
        log_now = self.global_step % h.log_every_n_steps == 0
        # the same (jumped) positions for the expert and its background
        positions = training_position_ids(self._background_model, batch, h.position_jump)
        losses = self._plain_losses if h.loss_chunk_size is None else self._chunked_losses
        nll, reg = losses(batch, positions, log_now)
        loss = nll
        if reg is not None:
            loss = loss + h.reg_weight * reg
            self.log("train/reg", reg)
        self.log("train/loss", loss, prog_bar=True)
        if self._trainer is not None and self.trainer.world_size > 1:
            # DDP reduces the gradient of every trainable parameter each step, but a rank's batch may hold no row
            # of an expert (its adapter then takes no part in the loss): a zero term keeps each one in the graph.
            loss = loss + 0.0 * sum(p.sum() for p in self.parameters() if p.requires_grad)
        return loss

    def _plain_losses(self, batch: dict[str, Tensor], positions: Tensor | None,
                      log_now: bool) -> tuple[Tensor, Tensor | None]:
        """The task NLL and the regularizer (None when λ = 0), from the `[B, T, V]` logits of expert and background."""
        h = self.settings
        ids, attn, targets = batch["input_ids"], batch["attention_mask"], batch["targets"]
        own_mask = batch["masks"][:, 0]  # each training row carries its own expert's mask
        expert_index, is_task = batch["expert_index"], batch["is_task"].bool()
        bg = None
        if h.reg_weight > 0 or log_now:
            bg = (self.background_logits(ids, attn, positions) if self.background_cache is None
                  else self.cached_background(batch))
        logits = self.expert_logits(ids, attn, expert_index, positions)
        nll = task_nll(logits, task_targets(batch, h.task_loss_on_mask_only))
        reg = (self.regularizer_loss(logits, bg, targets, own_mask, expert_index, self._position_weight(batch))
               if h.reg_weight > 0 else None)
        if log_now:
            self._log_per_expert(logits.detach(), bg, targets, own_mask, expert_index, is_task)
        return nll, reg

    def _chunked_losses(self, batch: dict[str, Tensor], positions: Tensor | None,
                        log_now: bool) -> tuple[Tensor, Tensor | None]:
        """`_plain_losses` `loss_chunk_size` positions at a time (`losses.chunked`): the same sums over the same
        positions, normalised alike (by the count of scored / off-mask target positions), never `[B, T, V]`."""
        h = self.settings
        targets, own_mask, is_task = batch["targets"], batch["masks"][:, 0], batch["is_task"].bool()
        scored, off = task_targets(batch, h.task_loss_on_mask_only), region_positions(targets, own_mask, "off")
        terms = [RowSum(scored != IGNORE_INDEX, scored)]
        if h.reg_weight > 0:
            terms.append(RowSum(off, targets, divergence=h.divergence, beta=h.jsd_beta, temperature=h.temperature,
                                weight=self._position_weight(batch)))
        if log_now:  # `_log_per_expert`'s metrics: the NLL of task rows, the forward KL (T = 1) off the mask
            terms += [RowSum((targets != IGNORE_INDEX) & is_task.unsqueeze(1), targets, grad=False),
                      RowSum(off, divergence="forward_kl", grad=False)]
        sums = self._loss_row_sums(batch, positions, terms, background=h.reg_weight > 0 or log_now)
        counts = torch.stack([t.positions.sum(1) for t in terms])
        if log_now:
            self._log_per_expert_sums(sums[-2:].detach(), counts[-2:], batch["expert_index"], is_task)
        reg = _mean(sums[1], counts[1]) if h.reg_weight > 0 else None
        return _mean(sums[0], counts[0]), reg

    def _loss_row_sums(self, batch: dict[str, Tensor], positions: Tensor | None, terms: list[RowSum],
                       background: bool) -> Tensor:
        """`[len(terms), B]`: each term summed per row (`losses.chunked.chunked_row_sums`), the bodies run once."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        bg_head, bg_hidden = self._background_head(ids, attn, positions) if background else (None, None)
        sums = None
        for rows, head, hidden in self._expert_heads(ids, attn, batch["expert_index"], positions):
            part = chunked_row_sums(head, hidden, bg_head, None if bg_hidden is None else bg_hidden[rows],
                                    [t.part(rows=rows) for t in terms], self.settings.loss_chunk_size)
            sums = (part.new_zeros(len(terms), ids.shape[0]) if sums is None else sums).index_copy(1, rows, part)
        return sums

    @torch.no_grad()
    def cached_background(self, batch: dict[str, Tensor]) -> BackgroundTopK:
        """The background at the batch's off-mask target positions, from the cache (`background_top_k`); the rows
        whose (row_index, corruption_variant) it has not seen yet go through the background once, and are added."""
        if "row_index" not in batch or "corruption_variant" not in batch:
            raise ValueError("background_top_k (the background cache) needs training batches keyed by row_index and "
                             "corruption_variant: build the data module with corruption_variants=n")
        ids, attn = batch["input_ids"], batch["attention_mask"]
        keep = region_positions(batch["targets"], batch["masks"][:, 0], "off")
        keys = list(zip(batch["row_index"].tolist(), batch["corruption_variant"].tolist(), strict=True))
        missing = self.background_cache.missing(keys)
        if missing:
            rows = torch.tensor(missing, device=ids.device)
            logits = self.background_logits(ids[rows], attn[rows])
            self.background_cache.add([keys[i] for i in missing], logits[keep[rows]], keep[rows].sum(1).tolist())
        if self._trainer is not None:
            self.log("train/bg_cache_miss_rate", len(missing) / len(keys))
        return self.background_cache.gather(keys, ids.device)

    def _position_weight(self, batch: dict[str, Tensor]) -> Tensor | None:
        """The regularizer's weight per position: `reg_after_close` right after an interval closes,
        `reg_inside_foreign` inside a foreign span, `reg_at_open` where a span opens, else 1 (the excesses over 1
        added where several hold); None when all are 1."""
        weight = None
        for key, column in SPAN_WEIGHTS.items():
            w = getattr(self.settings, key)
            if w == 1:
                continue
            if column not in batch:
                raise ValueError(f"{key} needs training rows that mark those positions (the text task's {column} "
                                 "column)")
            extra = (w - 1.0) * batch[column].float()
            weight = 1.0 + extra if weight is None else weight + extra
        return weight

    def regularizer_loss(self, logits: Tensor, bg: Tensor, targets: Tensor, own_mask: Tensor,
                         expert_index: Tensor, position_weight: Tensor | None = None) -> Tensor:
        """The regularizer (before λ): `off_mask_divergence` (each position weighted by `position_weight`), or with
        `regularizer="features"` the per-feature `feature_divergence`, each row's expert free only on its mask and
        only on the features it owns."""
        h = self.settings
        kwargs = dict(kind=h.divergence, beta=h.jsd_beta, temperature=h.temperature)
        if h.regularizer != "features":
            return off_mask_divergence(logits, bg, targets, own_mask, position_weight=position_weight, **kwargs)
        if not isinstance(bg, Tensor):
            raise ValueError("regularizer='features' needs the background's full logits (no background cache)")
        masks = feature_masks(own_mask, self.owned[expert_index])
        return feature_divergence(logits, bg, targets, masks, self.feature_map, **kwargs)

    @torch.no_grad()
    def _log_per_expert(self, logits, bg, targets, own_mask, expert_index, is_task) -> None:
        keep_row = region_positions(targets, own_mask, "off").nonzero(as_tuple=True)[0]  # row of each off-mask position
        for i, name in enumerate(self.names):
            rows = expert_index == i
            task_rows = rows & is_task
            if task_rows.any():
                self.log(f"train/{name}/nll", task_nll(logits[task_rows], targets[task_rows]))
            if rows.any():
                bg_rows = bg[rows[keep_row]] if isinstance(bg, BackgroundTopK) else bg[rows]
                kl = off_mask_divergence(logits[rows], bg_rows, targets[rows], own_mask[rows], kind="forward_kl")
                self.log(f"train/{name}/off_mask_kl", kl)

    @torch.no_grad()
    def _log_per_expert_sums(self, sums: Tensor, counts: Tensor, expert_index: Tensor, is_task: Tensor) -> None:
        """`_log_per_expert` from per-row sums and counts (`[2, B]`: task rows' NLL, off-mask forward KL)."""
        for i, name in enumerate(self.names):
            rows = expert_index == i
            if (rows & is_task).any():
                self.log(f"train/{name}/nll", _mean(sums[0][rows & is_task], counts[0][rows & is_task]))
            if rows.any():
                self.log(f"train/{name}/off_mask_kl", _mean(sums[1][rows], counts[1][rows]))

    # --- validation: each expert on its own data (the composition is evaluated by a callback) ---
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        ids, attn, targets = batch["input_ids"], batch["attention_mask"], batch["targets"]
        own_mask, expert_index = batch["masks"][:, 0], batch["expert_index"]
        bg = self.background_logits(ids, attn)
        logits = self.expert_logits(ids, attn, expert_index)
        for i, name in enumerate(self.names):
            rows = expert_index == i
            if not rows.any():
                continue
            args = (logits[rows], bg[rows], targets[rows], own_mask[rows])
            self.val_off_mask_kl[name].update(*args)
            self.val_on_mask_kl[name].update(*args)
            self.val_active[name].update(*args)
            self.val_nll[name].update(task_nll(logits[rows], targets[rows]),  # token-weighted
                                      weight=(targets[rows] != IGNORE_INDEX).sum())

    def on_validation_epoch_end(self) -> None:
        """Log each expert's validation metrics, reduced across the ranks of a distributed run (torchmetrics'
        `compute`; every rank computes the same metrics in the same order, so each reduction is entered by all)."""
        for name in self.names:
            metrics = (self.val_off_mask_kl, self.val_on_mask_kl, self.val_active, self.val_nll)
            if self._rows_seen(self.val_off_mask_kl[name]):  # an expert with no validation rows logs nothing
                values = {"off_mask_kl": self.val_off_mask_kl[name].compute(),
                          "on_mask_kl": self.val_on_mask_kl[name].compute(), "nll": self.val_nll[name].compute()}
                pr = self.val_active[name].compute()
                values |= {"active_precision": pr["precision"], "active_recall": pr["recall"]}
                for key, value in values.items():  # the same value on every rank: sync_dist keeps it as it is
                    self.log(f"val/{name}/{key}", value, sync_dist=True)
            for m in metrics:
                m[name].reset()

    def _rows_seen(self, metric) -> bool:
        """Whether any rank updated `metric` in this validation."""
        count = torch.tensor(metric.update_count, device=self.device)
        if self._trainer is not None:
            count = self.trainer.strategy.reduce(count, reduce_op="sum")
        return bool(count > 0)

    def configure_optimizers(self) -> dict:
        h = self.settings
        return adamw_with_schedule(self.parameters(), h.lr, h.weight_decay, h.warmup_ratio, h.max_steps)

    # --- checkpoints: the trained state only --------------------------------------------------------
    def _frozen_names(self) -> set[str]:
        """State-dict keys of the frozen parameters: the background (under LoRA, every weight but the trained
        adapters; else the frozen copy and the untrained part of each expert) and adapters of earlier runs."""
        params = self.named_parameters(remove_duplicate=False)
        if self.settings.mode == "lora":  # by adapter name: peft freezes inactive adapters while it switches
            return {n for n, _ in params if not any(f".{name}." in n for name in self.names)}
        return {n for n, p in params if not p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint holds what training changes (the trained parameters, with the optimizer, schedulers and
        loops Lightning adds), not the frozen weights: they come from the background's folder and the frozen
        adapters' exports, from which the module is built (`load_state_dict` takes them from it again). Under
        FSDP, whose parameter names are its own, the state is kept whole."""
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            return
        state = checkpoint["state_dict"]
        for name in self._frozen_names():
            state.pop(name, None)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`; the frozen weights a checkpoint leaves out (`on_save_checkpoint`) are
        the module's own."""
        own = self.state_dict()
        missing = {name: own[name] for name in self._frozen_names() if name not in state_dict and name in own}
        return super().load_state_dict({**missing, **state_dict}, strict=strict, assign=assign)


# what an `init_from` folder holds -> the modes it can start an expert of
INIT_MODES: dict[str, tuple[str, ...]] = {"adapter": ("lora", "full"), "model": ("full",)}


def init_kind(folder: str | Path) -> Literal["adapter", "model"]:
    """What an `init_from` folder holds: a PEFT adapter (`adapter_config.json`) or a full HF model (`config.json`).
    Raises a one-line `ValueError` naming the folder for anything else."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file():
        return "model"
    raise ValueError(f"{folder} is neither a PEFT adapter folder (adapter_config.json) nor an HF model folder "
                     "(config.json)")


@torch.no_grad()
def moved_model(model: PreTrainedModel, base: PreTrainedModel, background: PreTrainedModel) -> PreTrainedModel:
    """`background + (model − base)`, parameter by parameter, written into `model` (no further copy): a full
    fine-tune's difference from the model it was trained from, moved onto another background of the same shapes
    (a tied weight counts once)."""
    start, onto = dict(base.named_parameters()), dict(background.named_parameters())
    for name, p in model.named_parameters():
        p.add_(onto[name].to(p.dtype) - start[name].to(p.dtype))
    return model


def linear_module_names(model: nn.Module) -> list[str]:
    """The names (last path part) of the linear layers inside `model`'s decoder layers: what peft's `all-linear`
    adapts there."""
    from transformers.pytorch_utils import Conv1D

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to choose from (get_decoder().layers)")
    return sorted({name.split(".")[-1] for name, m in layers.named_modules() if isinstance(m, nn.Linear | Conv1D)})


def _mean(row_sums: Tensor, row_counts: Tensor) -> Tensor:
    """A sum over rows divided by its count of positions (at least 1), as `task_nll` and `off_mask_divergence` do."""
    return row_sums.sum() / row_counts.sum().clamp_min(1)


def _head_with_adapter_names(head: Callable[[Tensor], Tensor], module: nn.Module, adapter_names: list[str]) -> Head:
    """`head` as a `losses.chunked.Head`, with each position's row's name of `adapter_names` passed to its output
    layer `module` when peft wrapped it (`lm_head` among the LoRA targets): each block's call, and its
    recomputation in backward, come after the body's forward."""
    if not any(isinstance(m, LoraLayer | AuxiliaryTrainingWrapper) for m in module.modules()):
        return _rows_ignored(head)

    def call(hidden: Tensor, rows: Tensor) -> Tensor:
        with peft_adapter_names(module, [adapter_names[i] for i in rows.tolist()]):
            return head(hidden)

    return call


def _rows_ignored(head: Callable[[Tensor], Tensor]) -> Head:
    """`head(hidden)` as a `losses.chunked.Head`: the same for every row."""
    return lambda hidden, rows: head(hidden)


def _split_head(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                position_ids: Tensor | None) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """`(output head, its input [B, T, d])` of one forward of `model` (`compose.heads.hidden_and_head`)."""
    pair = hidden_and_head(model, input_ids, attention_mask, position_ids)
    if pair is None:
        raise ValueError(f"loss_chunk_size: the output head of {type(model).__name__} cannot be run on its own "
                         "(see compose.heads.hidden_and_head; a model inside a wrapper such as FSDP's has no "
                         "get_output_embeddings): set loss_chunk_size=None")
    return pair


def task_targets(batch: dict[str, Tensor], on_mask_only: bool = False) -> Tensor:
    """The targets the task loss scores (``-100`` elsewhere): every target of a task row (``is_task``), and
    the targets on the expert's own mask of rows marked ``task_on_mask`` (compositional regularizer rows,
    whose targets there are the expert's own rule's). ``on_mask_only``: the own mask only, in every row."""
    targets, own_mask = batch["targets"], batch["masks"][:, 0]
    scored = batch["is_task"].bool().unsqueeze(1) | (batch["task_on_mask"].bool().unsqueeze(1) & own_mask)
    if on_mask_only:
        scored = scored & own_mask
    return targets.where(scored, IGNORE_INDEX)
