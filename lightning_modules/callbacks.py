"""Callbacks: evaluate the composition (and downstream tasks) during validation; export for composition at fit end."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from transformers import PreTrainedModel

from compose.composed_lm import ComposedLM
from compose.distributed import sharded
from compose.export import export_composition
from compose.model_io import sha256_file
from data.tasks import Task, settings_node


@contextmanager
def full_parameters(trainer: pl.Trainer) -> Iterator[None]:
    """The module's whole parameters outside the strategy's own forward: under FSDP they are gathered from the
    shards for the block (not written back); nothing to do otherwise. Every rank must enter it."""
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
            yield
    else:
        yield


class CompositionEvaluation(pl.Callback):
    """At validation end, compose the background with every expert in play and log how the composition does.

    Decodes the task's compositional validation rows with `ComposedLM` and logs, under `val/composed/`, what
    `Task.composition_metrics` returns: `exact_match`, `nll`, `projectivity_error`, per-skill accuracy,
    per-expert off/on-mask KL on compositional prefixes, pairwise active-set overlap, and the task's extras.

    In a distributed run every rank evaluates in step: rank `r` decodes and scores rows `r, r + W, ...` and the
    metrics are reduced across the ranks (`compose.distributed`), so each rank logs the values of all the rows.

    Args:
        task: the task (its `compositional_dataset("val")`, in the composed model's expert order).
        batch_size: rows per decoding batch.
        limit: decode at most this many rows (None: all).
        active_threshold: divergence (nats) above which a position counts as active.
    """

    def __init__(self, task: Task, batch_size: int = 250, limit: int | None = None,
                 active_threshold: float = 0.01) -> None:
        self.task, self.batch_size, self.limit, self.active_threshold = task, batch_size, limit, active_threshold
        self.last: dict[str, float] = {}

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        dataset = self.task.compositional_dataset("val")
        if self.limit is not None and len(dataset) > self.limit:
            dataset = dataset.select(range(self.limit))
        with full_parameters(trainer):
            composed = sharded(pl_module.composed_model(self.task.tokenizer))
            self.last = self.task.composition_metrics(composed, dataset, self.batch_size, self.active_threshold)
        for key, value in self.last.items():
            pl_module.log(f"val/composed/{key}", value, prog_bar=key == "exact_match", sync_dist=True)


class DownstreamEvaluation(pl.Callback):
    """At validation end, score the background, each trained expert alone and the composition on downstream tasks.

    `evaluate` maps a `ComposedLM` to flat metrics `{"<task>/<metric>": value}` (the pipeline passes its lm-eval
    runner, `lightning_modules.pipeline.downstream.LMEvalRunner`); each is logged as
    `val/lm_eval/<task>/<metric>/<model>`, `<model>` being `background`, an expert's name or `composed`. The
    models are built from the live modules (`composed_model`), as `CompositionEvaluation` builds its own; every
    rank calls `evaluate` in step and gets the same values.

    Args:
        evaluate: the evaluation of one composed model.
        tokenizer: the models' tokenizer.
        prefix: the logged keys' prefix.
    """

    def __init__(self, evaluate: Callable[[ComposedLM], Mapping[str, float]], tokenizer,
                 prefix: str = "val/lm_eval") -> None:
        self.evaluate, self.tokenizer, self.prefix = evaluate, tokenizer, prefix
        self.last: dict[str, float] = {}

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tok, self.last = self.tokenizer, {}
        with full_parameters(trainer):
            models = {"background": lambda: pl_module.composed_model(tok, names=[]),
                      **{name: lambda name=name: pl_module.composed_model(tok, names=[name]) for name in pl_module.names},
                      "composed": lambda: pl_module.composed_model(tok)}
            for model, build in models.items():
                for key, value in self.evaluate(build()).items():
                    self.last[f"{self.prefix}/{key}/{model}"] = value
        for key, value in self.last.items():
            pl_module.log(key, value, sync_dist=True)


class CheckpointBackgroundError(ValueError):
    """A checkpoint was trained on other frozen background weights than the folder it is resumed with."""


class FrozenBackgroundCheck(pl.Callback):
    """Records in every checkpoint which frozen background its experts were trained on, and refuses to resume
    on another: the experts' checkpoints hold only their trained state (`ExpertLM.on_save_checkpoint`), the
    background's weights stay in its own folder (the run's `background/` or `background.path`), referenced by
    the SHA-256 of its safetensors files (`checkpoint["frozen_background"]`, hashed once per stage).

    Args:
        folder: the background's HF folder the experts are built on.
    """

    KEY = "frozen_background"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._digests: dict[str, str] | None = None

    def reference(self) -> dict:
        if self._digests is None:
            self._digests = {f.name: sha256_file(f) for f in sorted(self.folder.glob("*.safetensors"))}
        return {"folder": str(self.folder.resolve()), "sha256": dict(self._digests)}

    def verify(self, checkpoint: Mapping) -> None:
        """Raise `CheckpointBackgroundError` (one line) if `checkpoint` names other background weights."""
        saved = checkpoint.get(self.KEY)
        if saved is None:
            return  # a checkpoint that holds its background's weights itself
        ours = self.reference()
        if saved["sha256"] != ours["sha256"]:
            differ = sorted(set(saved["sha256"].items()) ^ set(ours["sha256"].items()))
            raise CheckpointBackgroundError(
                f"the checkpoint was trained on the background in {saved['folder']} (safetensors SHA-256 "
                f"{', '.join(sorted({name for name, _ in differ}))} differ from {self.folder}): resume with that "
                "background, or start a new output_dir")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[self.KEY] = self.reference()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.verify(checkpoint)


class ExportForComposition(pl.Callback):
    """At fit end, write the export folder + `composition.yaml` (atomically: temporary folder, then rename).

    Args:
        path: the export folder (refused if it exists, unless `overwrite`).
        tokenizer: saved with the export.
        specs: per expert name, its mask spec stored in the manifest (e.g. `{"rules": {"A": "B"}}`).
        weights: per expert name, its composition weight.
        background_path: the clean background's HF folder (LoRA wraps the live model in place, so the
            export's copy is read from here).
        load_background: reads that folder into a model (the pipeline passes its own loader).
        copy_background: copy the background into the export (self-contained) or store a reference to it.
        extra: free-form metadata for the manifest (config, metrics). The settings of the task the experts
            were trained on (the trainer's datamodule's task) are added as `task_settings` (its `task:` node),
            so `compose.combine` can rebuild the task's compositional test set from the export alone.
    """

    def __init__(self, path: str | Path, tokenizer, specs: Mapping[str, dict], weights: Mapping[str, float],
                 background_path: str | Path, load_background: Callable[[Path], PreTrainedModel],
                 copy_background: bool = True, extra: dict | None = None, overwrite: bool = False) -> None:
        self.path, self.tokenizer, self.specs, self.weights = Path(path), tokenizer, dict(specs), dict(weights)
        self.background_path, self.copy_background = Path(background_path).resolve(), copy_background
        self.load_background = load_background
        self.extra, self.overwrite = extra, overwrite

    @torch.no_grad()
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rank 0 writes the export (every rank gathers FSDP's shards with it)."""
        with full_parameters(trainer):
            if trainer.is_global_zero:
                self._export(trainer, pl_module)

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = pl_module.names
        background = self.load_background(self.background_path) if self.copy_background else None
        ref = None if self.copy_background else str(self.background_path)
        extra = dict(self.extra or {})
        task = getattr(trainer.datamodule, "task", None)
        if isinstance(task, Task):
            extra.setdefault("task_settings", settings_node(task))
        # the exact shortcuts the composition of these experts takes when loaded (ComposedLM.paths)
        extra["decoding_paths"] = dataclasses.asdict(pl_module.composed_model(self.tokenizer).paths)
        common = dict(tokenizer=self.tokenizer, background=background, background_ref=ref,
                      weights={n: self.weights.get(n, 1.0) for n in names},
                      specs={n: self.specs.get(n, {}) for n in names}, extra=extra, overwrite=self.overwrite)
        if pl_module.settings.mode == "lora":
            export_composition(self.path, peft_model=pl_module.peft_model, adapter_names=names, **common)
        else:
            export_composition(self.path, expert_models={n: pl_module.experts[n] for n in names}, **common)
