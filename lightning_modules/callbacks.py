"""Callbacks: evaluate the composition during validation; export for composition at fit end."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch

from compose.export import export_composition
from data.letters import RuleSet, check_format
from lightning_modules.evaluation import evaluate_composition
from lightning_modules.models import load_pretrained


class CompositionEvaluation(pl.Callback):
    """At validation end, compose the background with every expert in play and log how the composition does.

    Decodes the compositional validation set greedily with `ComposedLM` and logs `val/composed/exact_match`,
    `val/composed/nll`, `val/composed/projectivity_error`, per-skill accuracy, failure types, per-expert
    off/on-mask KL on compositional prefixes and pairwise active-set overlap.

    Args:
        dataset_fn: returns the compositional validation `datasets.Dataset` (x, y, input_ids, targets, masks).
        rule_sets: the rule set of every expert in play, in the composed model's expert order.
        collate: the collator turning dataset rows into tensors.
        tokenizer: the shared tokenizer.
        limit: decode at most this many inputs (None: all).
        format: the data format of the dataset (`generative`: greedy decoding; `aligned`: argmax at the
            positions of `x`, nothing generated).
    """

    def __init__(self, dataset_fn: Callable, rule_sets: Sequence[RuleSet], collate, tokenizer,
                 batch_size: int = 250, limit: int | None = None, active_threshold: float = 0.01,
                 format: str = "generative") -> None:
        self.dataset_fn, self.rule_sets, self.collate = dataset_fn, list(rule_sets), collate
        self.tokenizer, self.batch_size, self.limit = tokenizer, batch_size, limit
        self.active_threshold = active_threshold
        self.format = check_format(format)
        self.last: dict[str, float] = {}

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        dataset = self.dataset_fn()
        if self.limit is not None and len(dataset) > self.limit:
            dataset = dataset.select(range(self.limit))
        composed = pl_module.composed_model(self.tokenizer)
        self.last = evaluate_composition(composed, self.tokenizer, dataset, self.rule_sets, self.collate,
                                         self.batch_size, self.active_threshold, format=self.format)
        for key, value in self.last.items():
            pl_module.log(f"val/composed/{key}", value, prog_bar=key == "exact_match", sync_dist=True)


class ExportForComposition(pl.Callback):
    """At fit end, write the export folder + `composition.yaml` (atomically: temporary folder, then rename).

    Args:
        path: the export folder (refused if it exists, unless `overwrite`).
        tokenizer: saved with the export.
        specs: per expert name, the spec stored in the manifest (e.g. `{"rules": {"A": "B"}}`).
        weights: per expert name, its composition weight.
        background_path: the clean background's HF folder (LoRA wraps the live model in place, so the
            export's copy is read from here).
        copy_background: copy the background into the export (self-contained) or store a reference to it.
        extra: free-form metadata for the manifest (config, metrics).
    """

    def __init__(self, path: str | Path, tokenizer, specs: Mapping[str, dict], weights: Mapping[str, float],
                 background_path: str | Path, copy_background: bool = True, extra: dict | None = None,
                 overwrite: bool = False) -> None:
        self.path, self.tokenizer, self.specs, self.weights = Path(path), tokenizer, dict(specs), dict(weights)
        self.background_path, self.copy_background = Path(background_path).resolve(), copy_background
        self.extra, self.overwrite = extra, overwrite

    @torch.no_grad()
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        names = pl_module.names
        background = load_pretrained(self.background_path) if self.copy_background else None
        ref = None if self.copy_background else str(self.background_path)
        common = dict(tokenizer=self.tokenizer, background=background, background_ref=ref,
                      weights={n: self.weights.get(n, 1.0) for n in names},
                      specs={n: self.specs.get(n, {}) for n in names}, extra=self.extra, overwrite=self.overwrite)
        if pl_module.hparams.mode == "lora":
            export_composition(self.path, peft_model=pl_module.peft_model, adapter_names=names, **common)
        else:
            export_composition(self.path, expert_models={n: pl_module.experts[n] for n in names}, **common)
