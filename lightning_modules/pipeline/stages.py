"""The pipeline `train.py` runs: background → experts → composition, each a Lightning fit or evaluation.

It talks to the task only through `data.tasks.Task`. Everything a run writes lands in its `output_dir`:
`config.yaml`, `background/` (HF folder), `tokenizer/`, `checkpoints/<stage>/`, `logs/<stage>/` (CSV, and the
logger `trainer.logger` adds: `pipeline.loggers`), `export/` (for composition, with its model card `README.md`)
and `summary.json`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf

from compose import ComposedLM
from compose.atomic import PAUSE_ENV, atomic_save, atomic_write_text, remove_stale_temporaries
from compose.distributed import agree, barrier, is_leader, sharded
from compose.export import MANIFEST_NAME, load_manifest, verify_export
from compose.merges import max_logprob_gap, merged_adapter, task_arithmetic
from compose.model_card import write_model_card
from data.tasks import Expert, Task
from lightning_modules.background import BackgroundLM
from lightning_modules.callbacks import (
    CheckpointBackgroundError,
    CompositionEvaluation,
    DownstreamEvaluation,
    ExportForComposition,
    FrozenBackgroundCheck,
)
from lightning_modules.expert import ExpertLM, ExpertSettings
from lightning_modules.pipeline import console
from lightning_modules.pipeline.ablations import check_ablations, run_ablations
from lightning_modules.pipeline.build import (
    build_datamodule,
    build_expert,
    build_task,
    expert_background,
)
from lightning_modules.pipeline.config import ConfigError, is_pretrained
from lightning_modules.pipeline.downstream import LMEvalRunner, check_lm_eval
from lightning_modules.pipeline.feature_head import check_factored, merge_factored_head
from lightning_modules.pipeline.loggers import check_logger, stage_loggers
from lightning_modules.pipeline.models import (
    build_causal_lm,
    count_parameters,
    load_options,
    load_pretrained,
    pretrained_folder,
)
from lightning_modules.pipeline.ranks import OUTPUT_DIR_ENV
from lightning_modules.pipeline.reg_samples import draw_background_samples
from lightning_modules.pipeline.report import with_intervals, write_report
from lightning_modules.pipeline.resume import (
    AtomicCheckpointIO,
    Interrupted,
    PausePoints,
    SaveOnStop,
    check_resume,
    check_stop,
    last_step,
    seed_stage,
    stop_on_signals,
)
from losses import IGNORE_INDEX, divergence

# The summary's sections an export's model card shows (timing, length sweeps and ablations stay in the report).
CARD_METRICS = ("background", "experts", "composition", "baselines")
# Keys of the composition's metrics that belong to one expert (`<name>/<key>`): they go under
# `summary.experts.<name>`.
PER_EXPERT_KEYS = ("off_mask_kl", "on_mask_kl", "max_off_mask_log_ratio", "skill_accuracy", "active_precision",
                   "active_recall")


@dataclass
class Plan:
    """What a run will do, checked in full before anything is written."""

    out: Path
    task: Task
    trained: list[str]                     # experts trained in this run
    frozen: list[str]                      # experts from earlier exports (compose_with)
    frozen_adapters: dict[str, str] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    specs: dict[str, dict] = field(default_factory=dict)

    @property
    def in_play(self) -> list[str]:
        return self.trained + self.frozen

    @property
    def tokenizer(self):
        return self.task.tokenizer


def output_dir(cfg: DictConfig) -> Path:
    """The run's folder: `output_dir`, or `runs/<experiment>/<timestamp>`; refuses to overwrite one.

    A rank > 0 of a distributed run takes rank 0's folder as it is (`pipeline.ranks`): rank 0 has checked it, and it is
    not empty by the time the others start."""
    if not is_leader():
        folder = cfg.output_dir or os.environ.get(OUTPUT_DIR_ENV)
        if not folder:
            raise ConfigError("this process is a rank > 0 of a distributed run (LOCAL_RANK, NODE_RANK or RANK set) "
                              f"but was given no run folder: pass output_dir= (or ${OUTPUT_DIR_ENV})")
        return Path(folder)
    resuming = cfg.ckpt_path == "last"
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        _check_writable(out)
        if out.exists() and any(out.iterdir()) and not resuming:
            raise ConfigError(f"output_dir {out} exists and is not empty: pass ckpt_path=last to resume it, "
                              "or choose another output_dir")
    else:
        if resuming:
            raise ConfigError("ckpt_path=last needs output_dir= naming the run to resume")
        out = Path("runs") / cfg.experiment / datetime.now().strftime("%Y%m%d-%H%M%S")
        _check_writable(out, "runs/<experiment>/<timestamp> (no output_dir given)")
        os.environ[OUTPUT_DIR_ENV] = str(out)  # for the ranks Lightning's launcher may start later
    if resuming and not out.exists():
        raise ConfigError(f"ckpt_path=last: output_dir {out} does not exist")
    return out


def _check_writable(out: Path, key: str = "output_dir") -> None:
    """`out` must be a folder, or creatable in the nearest existing folder above it, by this process."""
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{key}={out}: is a file; output_dir must be a folder (new, empty, or a run to resume)")
        existing = out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
    except PermissionError as e:
        raise ConfigError(f"{key}={out}: cannot be reached by this user ({e.strerror}: {e.filename})") from None
    if not existing.is_dir():
        raise ConfigError(f"{key}={out}: {existing} is a file, so the folder cannot be created there")
    effective = os.access in os.supports_effective_ids  # the ids the kernel checks a write against
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        raise ConfigError(f"{key}={out}: {existing} is not writable by this user; choose a writable output_dir")


def check_trainer(cfg: DictConfig) -> None:
    """The accelerator must be on this machine, and Lightning must accept accelerator, devices, strategy and
    precision together: a Trainer is built from them (it writes nothing) and its refusal becomes one line.
    FSDP is Lightning's on CUDA devices only: on any other accelerator it is refused naming the one it needs."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.accelerators import MPSAccelerator, XLAAccelerator

    t = cfg.trainer
    check_logger(t.logger)
    if t.strategy in FSDPStrategy.get_registered_strategies() and t.accelerator not in ("gpu", "cuda"):
        raise ConfigError(f"trainer.strategy={t.strategy} needs trainer.accelerator=gpu (CUDA devices; got "
                          f"trainer.accelerator={t.accelerator}): Lightning runs FSDP on CUDA only; on CPU use "
                          "trainer.strategy=ddp")
    available = {"gpu": torch.cuda.is_available, "cuda": torch.cuda.is_available,
                 "mps": MPSAccelerator.is_available, "tpu": XLAAccelerator.is_available}
    if t.accelerator in available and not available[t.accelerator]():
        raise ConfigError(f"trainer.accelerator={t.accelerator}: no such device on this machine; use "
                          "trainer.accelerator=cpu (configs/trainer/cpu.yaml) or auto")
    devices = OmegaConf.to_container(t.devices) if isinstance(t.devices, DictConfig | ListConfig) else t.devices
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    try:
        with warnings.catch_warnings():  # the stages' Trainers say what this one would
            warnings.simplefilter("ignore")
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            pl.Trainer(accelerator=t.accelerator, devices=devices, strategy=t.strategy, precision=t.precision,
                       logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False)
    except (MisconfigurationException, ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"trainer: accelerator={t.accelerator}, devices={devices}, strategy={t.strategy}, "
                          f"precision={t.precision} do not go together: {str(e).strip().splitlines()[0]}") from None
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _verify_export_holding(folder: Path, key: str) -> None:
    """A model folder that is an export's own `background/` is verified with its export (checksums, no
    missing, extra or pickle files), as `ComposedLM.from_manifest` would."""
    root = folder.parent
    if not (root / MANIFEST_NAME).is_file():
        return
    try:
        manifest = load_manifest(root)
        entry = manifest["background"]
        if "path" in entry and (root / entry["path"]).resolve() == folder.resolve():
            verify_export(root, manifest)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


def plan_run(cfg: DictConfig) -> Plan:
    """Validate everything the config names (task, experts, files, exports, tokenizers) without writing."""
    out = output_dir(cfg)
    if is_leader():
        check_resume(cfg, out)
    check_trainer(cfg)
    check_lm_eval(cfg)
    for key in PRETRAINED_KEYS:
        if OmegaConf.select(cfg, key):
            _verify_export_holding(pretrained_folder(OmegaConf.select(cfg, key), key), key)
    frozen, frozen_adapters, exports = _earlier_experts(cfg)
    task = build_task(cfg, frozen)
    for export, manifest in exports:
        _check_same_vocab(manifest, task.tokenizer, export)
    check_ablations(cfg, task)
    _check_task_fits(cfg, task)
    _check_pretrained_models(cfg, task)
    return Plan(out, task, list(task.trained), list(frozen_adapters), frozen_adapters,
                weights={e.name: e.weight for e in task.experts}, specs={e.name: dict(e.spec) for e in task.experts})


PRETRAINED_KEYS = ("background.path", "model.pretrained_path")


def _earlier_experts(cfg: DictConfig) -> tuple[list[Expert], dict[str, str], list[tuple[str, dict]]]:
    """The experts of `composition.compose_with`'s exports, verified: `(experts, {name: adapter folder},
    [(export, manifest)])`."""
    experts, frozen_adapters, exports = [], {}, []
    for export in cfg.composition.compose_with:
        try:  # the checks of `ComposedLM.from_manifest`: checksums, no missing, extra or pickle file
            manifest = load_manifest(export)
            verify_export(export, manifest)
        except (OSError, ValueError) as e:
            raise ConfigError(f"composition.compose_with: {e}") from None
        _check_same_background(manifest, export, cfg.background.path)
        for entry in manifest["experts"]:
            if entry.get("kind", "lora") != "lora":
                raise ConfigError(f"composition.compose_with: {export}: expert '{entry['name']}' is not a LoRA adapter")
            experts.append(Expert(entry["name"], dict(entry.get("spec") or {}), float(entry.get("weight", 1.0))))
            frozen_adapters[entry["name"]] = str(Path(export) / entry["path"])
        exports.append((export, manifest))
    return experts, frozen_adapters, exports


def _check_task_fits(cfg: DictConfig, task: Task) -> None:
    """The task has what the model's head and the regularizer need, and its rows (with the position jumps) fit
    the positions of a model built from scratch."""
    for key, value in (("model.head", "factored"), ("expert.regularizer", "features")):
        if OmegaConf.select(cfg, key) == value and task.feature_map is None:
            raise ConfigError(f"{key}={value} needs a task with a feature map (task.name=features); task "
                              f"{task.name!r} has none")
    for key, marks in (("reg_after_close", "where intervals close"), ("reg_inside_foreign", "foreign spans"),
                       ("reg_at_open", "where spans open")):
        if cfg.expert[key] != 1 and not task.marks_span_positions:
            raise ConfigError(f"expert.{key}={cfg.expert[key]} needs a task whose rows mark {marks} "
                              f"(task.name=text); task {task.name!r} does not")
    longest, positions = task.max_row_length, cfg.model.max_position_embeddings
    if is_pretrained(cfg) or longest is None:
        return
    coupled = cfg.model.position_encoding == "coupled"  # ids up to the row length, 2 per slot of jump room
    if longest + coupled > positions:
        key = getattr(task.cfg, "max_row_length_key", "task.max_len")  # what sets the longest row
        raise ConfigError(f"model.max_position_embeddings={positions} is shorter than the task's longest row "
                          f"({longest} tokens, from {key}={OmegaConf.select(cfg, key)}): raise it to >= "
                          f"{longest + coupled} or lower {key}")
    key, jump = max((("background.position_jump", cfg.background.position_jump),
                     ("expert.position_jump", cfg.expert.position_jump)), key=lambda item: item[1])
    reach = longest - 1 + jump * (1 + coupled) + coupled
    if jump and reach >= positions:
        raise ConfigError(f"{key}={jump}: position ids may reach {reach} (the longest row, {longest} tokens, and "
                          f"the jump), beyond model.max_position_embeddings={positions}: raise it to >= {reach + 1} "
                          f"or lower {key}")


def _check_pretrained_models(cfg: DictConfig, task: Task) -> None:
    """Fail early on a pretrained model: a missing folder, a small vocabulary, another tokenizer, tied embeddings
    under `expert.mode=head`, a head the factored one cannot replace."""
    for key in PRETRAINED_KEYS:
        if OmegaConf.select(cfg, key):
            model = load_pretrained(OmegaConf.select(cfg, key), task.tokenizer, where=key, **load_options(cfg.model))
            _check_saved_tokenizer(pretrained_folder(OmegaConf.select(cfg, key), key), task.tokenizer, key)
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            if cfg.expert.mode == "head" and tied:
                raise ConfigError(f"expert.mode=head needs untied input/output embeddings; the model of {key} "
                                  "ties them (use expert.mode=lora or full)")
            if cfg.model.head == "factored":
                check_factored(model, task.feature_map, key)


def _check_saved_tokenizer(folder: Path, tokenizer, key: str) -> None:
    """A model folder saved with a tokenizer (in it, or beside it as a run's or an export's `tokenizer/`) must
    have been trained with this task's token ids: a larger embedding table alone does not show that."""
    from data.tokenizer import TokenizerFolderError, load_tokenizer_folder

    for where in (folder, folder.parent / "tokenizer"):
        if (where / "tokenizer.json").is_file() or (where / "tokenizer_config.json").is_file():
            try:
                theirs = load_tokenizer_folder(where, where=key).get_vocab()
            except TokenizerFolderError:
                continue
            ours = tokenizer.get_vocab()
            if any(theirs.get(token) != i for token, i in ours.items()):
                raise ConfigError(f"{key}={folder}: its tokenizer ({where}) maps tokens to other ids than this "
                                  "run's (a different alphabet or tokenizer)")
            return


def _check_same_vocab(manifest: dict, tokenizer, export: str) -> None:
    from data.tokenizer import TokenizerFolderError, load_tokenizer_folder

    tok_dir = Path(export) / manifest.get("tokenizer", "tokenizer")
    try:
        theirs = load_tokenizer_folder(tok_dir, where=f"composition.compose_with: {export}")
    except TokenizerFolderError as e:
        raise ConfigError(str(e)) from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"composition.compose_with: the tokenizer of {export} differs from this run's")


def _check_same_background(manifest: dict, export: str, background_path: str | None) -> None:
    """Adapters only mean something on the background they were trained on: require that one."""
    entry = manifest["background"]
    theirs = Path(export) / entry["path"] if "path" in entry else Path(export) / entry["ref"]
    if not background_path:
        raise ConfigError(f"composition.compose_with: set background.path to the background the experts of "
                          f"{export} were trained on (e.g. background.path={theirs})")
    if not _same_weights(pretrained_folder(background_path, "background.path"), theirs):
        raise ConfigError(f"composition.compose_with: the background of {export} ({theirs}) differs from "
                          f"background.path={background_path}")


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    files_a, files_b = sorted(a.glob("*.safetensors")), sorted(b.glob("*.safetensors"))
    if [f.name for f in files_a] != [f.name for f in files_b] or not files_a:
        return False
    for fa, fb in zip(files_a, files_b, strict=True):
        ta, tb = load_file(fa), load_file(fb)
        if ta.keys() != tb.keys() or any(not torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def make_trainer(cfg: DictConfig, out: Path, stage: str, max_steps: int, callbacks: list) -> pl.Trainer:
    t = cfg.trainer
    # A checkpoint after each validation (every val_check_interval steps), so that a stage resumed from it has
    # already run that validation (one saved before it would skip it); without validation, every N steps.
    when = (dict(every_n_epochs=1, save_on_train_epoch_end=False) if t.limit_val_batches != 0
            else dict(every_n_train_steps=t.val_check_interval))
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints" / stage, filename="step{step}", save_last=True,
                                 save_top_k=1, auto_insert_metric_name=False, **when)
    loggers = stage_loggers(cfg, out, stage)
    # The progress bar counts the stage's steps (console.StepProgressBar); a default value is left to Lightning
    # (passing `limit_val_batches=1.0` explicitly makes it print that it will use 100% of the batches).
    bar = [console.StepProgressBar(stage)] if t.enable_progress_bar else []
    pause = [PausePoints(out, stage)] if os.environ.get(PAUSE_ENV) else []
    stop = SaveOnStop(out / "checkpoints" / stage / "last.ckpt")  # SIGTERM / SIGINT: save where the fit stops
    return pl.Trainer(
        max_steps=max_steps, accelerator=t.accelerator, devices=t.devices, strategy=t.strategy,
        precision=t.precision, val_check_interval=min(t.val_check_interval, max_steps),
        check_val_every_n_epoch=None, log_every_n_steps=t.log_every_n_steps,
        limit_val_batches=None if t.limit_val_batches == 1.0 and isinstance(t.limit_val_batches, float)
        else t.limit_val_batches,  # (an int 1 is one batch)
        num_sanity_val_steps=t.num_sanity_val_steps,
        enable_progress_bar=t.enable_progress_bar, enable_model_summary=False,
        callbacks=[checkpoint, LearningRateMonitor(logging_interval="step"), stop, *bar, *pause, *callbacks],
        logger=loggers, default_root_dir=out, plugins=[AtomicCheckpointIO()],
    )


def _fit(trainer: pl.Trainer, module, datamodule, cfg: DictConfig, out: Path, stage: str) -> None:
    """Fit one stage; with `ckpt_path=last`, from the stage's `last.ckpt` when it has one (a stage that was
    interrupted after its last step then only runs its end: the fit-end callbacks and the final save)."""
    ckpt = None
    if cfg.ckpt_path == "last":
        last = out / "checkpoints" / stage / "last.ckpt"
        ckpt = agree(lambda: str(last) if last.is_file() else None)
    elif cfg.ckpt_path:
        ckpt = cfg.ckpt_path
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    except SIGTERMException:  # Lightning stopped the fit after a signal (`SaveOnStop` saved where)
        check_stop()
        raise Interrupted(signal.SIGTERM) from None
    except RuntimeError as e:
        if ckpt and ("size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e)):
            raise ConfigError(f"checkpoint {ckpt} does not match the config ({str(e).splitlines()[0][:200]})") from None
        raise
    except CheckpointBackgroundError as e:
        raise ConfigError(str(e)) from None
    # ModelCheckpoint saves every N steps; make `last.ckpt` the state at the end of the stage as well.
    # weights_only=False: the full state (optimizer, loops) that a resume needs; said explicitly, so Lightning
    # does not announce its default. Loading stays weights_only=True (only tensors and plain containers).
    trainer.save_checkpoint(out / "checkpoints" / stage / "last.ckpt", weights_only=False)
    check_stop()  # a signal during the fit's last step or its end (the export): stop now, resumable


def logging_interval(cfg: DictConfig, datamodule, max_steps: int) -> int:
    """`trainer.log_every_n_steps`, or when it is null `ExpertSettings.log_every_n_steps` lowered to the stage's
    length: its steps and its training batches per epoch and rank (a longer interval never logs a short stage,
    and Lightning warns about it)."""
    if cfg.trainer.log_every_n_steps is not None:
        return cfg.trainer.log_every_n_steps
    devices = cfg.trainer.devices
    ranks = devices if isinstance(devices, int) and devices > 0 else len(devices) if isinstance(devices, ListConfig) else 1
    per_epoch = math.ceil(len(datamodule.dataset("train")) / ranks / datamodule.batch_size)
    return max(1, min(ExpertSettings.log_every_n_steps, max_steps, per_epoch))


def with_logging_interval(cfg: DictConfig, datamodule, max_steps: int) -> DictConfig:
    """`cfg` with the stage's `trainer.log_every_n_steps` (`logging_interval`): the Trainer and the experts'
    own training metrics read the same one."""
    return OmegaConf.merge(cfg, {"trainer": {"log_every_n_steps": logging_interval(cfg, datamodule, max_steps)}})


def background_stage(cfg: DictConfig, plan: Plan) -> Path:
    """Train (or take) the background; return its HF folder."""
    if cfg.background.path:
        return pretrained_folder(cfg.background.path, "background.path")
    path = plan.out / "background"
    if agree(lambda: (path / "config.json").is_file()):  # finished earlier (resumed run)
        return path
    b = cfg.background
    seed_stage(cfg.seed, "background")
    model = build_causal_lm(cfg.model, plan.tokenizer, plan.task.feature_map)
    print(f"[background] {count_parameters(model):,} parameters, {b.max_steps} steps, corruption ρ={b.corruption_prob}"
          + (f", output positions jump by up to {b.position_jump}" if b.position_jump else ""))
    module = BackgroundLM(model, lr=b.optim.lr, weight_decay=b.optim.weight_decay,
                          warmup_ratio=b.optim.warmup_ratio, max_steps=b.max_steps, position_jump=b.position_jump)
    dm = build_datamodule(cfg, plan.task, "background")
    trainer = make_trainer(with_logging_interval(cfg, dm, b.max_steps), plan.out, "background", b.max_steps, [])
    _fit(trainer, module, dm, cfg, plan.out, "background")
    merge_factored_head(model)  # a factored head is saved as the plain weight it computes
    tokenizer = plan.tokenizer if cfg.model.pretrained_path else None  # a fine-tuned pretrained model keeps its own

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:  # so that `background.path` can name this folder alone
            tokenizer.save_pretrained(tmp)

    if is_leader():
        atomic_save(save, path)
    barrier()  # every rank loads the experts' background from `path`
    return path


def expert_module(cfg: DictConfig, plan: Plan, background_path: Path) -> ExpertLM:
    background = expert_background(cfg, background_path, plan.tokenizer)
    return build_expert(cfg, plan.task, background, frozen_adapters=plan.frozen_adapters)


def experts_stage(cfg: DictConfig, plan: Plan, background_path: Path) -> ExpertLM:
    """Train every expert of `cfg.experts` at once; composition is evaluated at each validation."""
    e, c = cfg.expert, cfg.composition
    draw_background_samples(cfg, plan.task, background_path)  # expert.reg_data=own+samples: its regularizer rows
    dm = build_datamodule(cfg, plan.task, "experts")  # k experts train on k × data.batch_size rows
    dm.dataset("train")
    cfg = with_logging_interval(cfg, dm, e.max_steps)
    seed_stage(cfg.seed, "experts")  # the LoRA initialisation does not depend on whether the background trained here
    module = expert_module(cfg, plan, background_path)
    weights = (f", ×{e.reg_after_close} after a close" if e.reg_after_close != 1 else "") + (
        f", ×{e.reg_inside_foreign} inside foreign spans" if e.reg_inside_foreign != 1 else "") + (
        f", ×{e.reg_at_open} where spans open" if e.reg_at_open != 1 else "")
    print(f"[experts] {', '.join(plan.trained)}: {e.mode}, λ={e.reg_weight} ({e.divergence}, T={e.temperature}"
          f"{weights}), reg data={e.reg_data}, {e.max_steps} steps, corruption ρ={e.corruption_prob}")
    for name, folder in module.init_from.items():
        print(f"[experts] {name} starts from {folder}"
              + (f" (trained on {e.init_base}, moved onto the background)" if e.init_base else ""))
    callbacks = [
        CompositionEvaluation(plan.task, batch_size=c.eval_batch_size, limit=c.val_limit,
                              active_threshold=c.active_threshold),
        ExportForComposition(plan.out / "export", plan.tokenizer, specs=plan.specs, weights=plan.weights,
                             background_path=background_path, load_background=load_pretrained,
                             extra={"experiment": cfg.experiment, "seed": cfg.seed, "task": cfg.task.name},
                             overwrite=cfg.ckpt_path == "last"),
        background_check := FrozenBackgroundCheck(background_path),  # checkpoints hold no frozen weight
    ]
    if c.lm_eval.tasks:  # downstream tasks at each validation, on the background, each expert and the composition
        callbacks.insert(1, DownstreamEvaluation(LMEvalRunner.from_config(cfg), plan.tokenizer))
    export, last = plan.out / "export" / MANIFEST_NAME, plan.out / "checkpoints" / "experts" / "last.ckpt"
    # Finished earlier: the export is written at the end of the fit, `last.ckpt` right after it. An export
    # without the final checkpoint (a kill in between) resumes the fit, which writes both again.
    if cfg.ckpt_path == "last" and agree(lambda: export.is_file() and last_step(last) == e.max_steps):
        state = torch.load(last, map_location="cpu", weights_only=True)
        _load_trained(module, state, background_check)
        return module
    trainer = make_trainer(cfg, plan.out, "experts", e.max_steps, callbacks)
    _fit(trainer, module, dm, cfg, plan.out, "experts")
    if isinstance(trainer.strategy, FSDPStrategy):
        # The module's parameters are now views of FSDP's shards: go on with the whole trained state, from the
        # final checkpoint (written by rank 0, every rank past its barrier).
        state = torch.load(last, map_location="cpu", weights_only=True)
        module = expert_module(cfg, plan, background_path)
        _load_trained(module, state, background_check)
    return module


def _load_trained(module: ExpertLM, state: dict, background_check: FrozenBackgroundCheck) -> None:
    """The trained state of an experts checkpoint into `module` (its frozen weights are the module's own)."""
    try:
        background_check.verify(state)
    except CheckpointBackgroundError as e:
        raise ConfigError(str(e)) from None
    module.load_state_dict(state["state_dict"])


def composition_stage(cfg: DictConfig, plan: Plan, background_path: Path, module: ExpertLM | None) -> dict:
    """Final evaluation on the test split: background, each expert alone, and the composition."""
    task, tok, bs = plan.task, plan.tokenizer, cfg.composition.eval_batch_size
    seed_stage(cfg.seed, "composition")
    console.stage("composition", "decoding the test split: background")
    background = sharded(ComposedLM(load_pretrained(background_path, tok).eval(), tokenizer=tok))
    # (`sharded`: in a distributed run each rank decodes its share of every batch; all get every output)
    summary: dict = {"background": task.evaluate_background(background, "test", bs)}
    if module is None:
        return summary | length_sweep(task, background, None, plan.trained, bs)
    module.eval()
    summary["experts"] = {}
    for name in plan.trained:
        console.stage("composition", f"decoding the test split: expert {name} alone")
        alone = task.evaluate_expert(sharded(module.composed_model(tok, names=[name])), name, "test", bs)
        # `skill_accuracy` of an expert is its accuracy inside the composition (below); alone it is this:
        renamed = {"skill_accuracy": "skill_accuracy_alone", "skill_accuracy_n": "skill_accuracy_alone_n"}
        summary["experts"][name] = {renamed.get(k, k): v for k, v in alone.items()}
    test_set = task.compositional_dataset("test")
    if cfg.composition.test_limit is not None and cfg.composition.test_limit < len(test_set):
        test_set = test_set.select(range(cfg.composition.test_limit))
    composed = sharded(module.composed_model(tok))
    console.stage("composition", f"decoding {len(test_set)} compositional test rows: {', '.join(plan.in_play)}")
    results = task.composition_metrics(composed, test_set, bs, cfg.composition.active_threshold)
    for name in plan.in_play:
        entry = summary["experts"].setdefault(name, {"trained_in": "compose_with"})
        for key in PER_EXPERT_KEYS:
            entry[key] = results.pop(f"{name}/{key}")
        for key in ("skill_accuracy_n", "intervals_missing"):  # _n: the count its interval (report) comes from
            if f"{name}/{key}" in results:
                entry[key] = results.pop(f"{name}/{key}")
    features = {k.split("/", 1)[1]: results.pop(k) for k in list(results) if k.startswith("features/")}
    summary["composition"] = {
        "exact_match": results.pop("exact_match"),
        "k": len(plan.in_play),
        "n_test": len(test_set),
        "failures": {k.split("/", 1)[1]: results.pop(k) for k in list(results) if k.startswith("failures/")},
        "overlap": {k.split("/", 1)[1]: results.pop(k) for k in list(results) if k.startswith("overlap/")},
        **results,
    }
    if features:  # a feature-space task (`compose.features.feature_metrics`)
        summary["composition"]["features"] = features
    summary |= length_sweep(task, background, module, plan.trained, bs)
    if cfg.composition.gated and any("interval" in plan.specs[n] for n in plan.in_play):
        # Gated: each expert's factor only where its stopping-time detector says its interval is open.
        # Lazy: an expert runs only once its interval opens (the same tokens, fewer forwards).
        composed.specs, composed.composition = [plan.specs[n] for n in composed.names], "gated"
        composed.lazy = True
        console.stage("composition", "decoding the compositional test rows again, gated")
        summary["composition"]["gated"] = task.evaluate_composition(composed, test_set, bs)
        composed.composition, composed.lazy = "soft", False
    if task.notes:
        summary["composition"]["notes"] = task.notes
    if is_leader():
        write_divergence_map(composed, test_set.select(range(min(4, len(test_set)))), task.collator(),
                             plan.out / "divergence_map.json")
    if cfg.baselines:
        summary["baselines"] = merge_baselines(cfg, plan, module, test_set)
    return summary


def length_sweep(task: Task, background: ComposedLM, module: ExpertLM | None, trained: list[str], batch_size: int) -> dict:
    """`{"length": ...}`: the background, each trained expert alone and the composition decoded at every input
    length the task asks for (`Task.evaluate_lengths`, e.g. `task.eval_lengths` of the letter task); `{}` if none."""
    tok = task.tokenizer
    experts = {name: sharded(module.composed_model(tok, names=[name])) for name in trained} if module else {}
    composed = sharded(module.composed_model(tok)) if module else None
    results = task.evaluate_lengths(background, experts, composed, batch_size,
                                    progress=lambda n: console.stage("composition", f"length sweep: length {n}"))
    return {"length": results} if results else {}


def merge_baselines(cfg: DictConfig, plan: Plan, module: ExpertLM, test_set) -> dict:
    """The same experts merged in parameter space, scored on the compositional test set.

    Also records how far task arithmetic's log-probs are from the composition's (docs/method.md, when the rule is exact: equal in
    the linear setting, apart elsewhere).
    """
    task, tok, bs, names = plan.task, plan.tokenizer, cfg.composition.eval_batch_size, plan.in_play
    composed = module.composed_model(tok)
    batch = task.collator()([test_set[i] for i in range(min(len(test_set), bs))])
    valid = batch["targets"] != IGNORE_INDEX
    composed_lp = composed.score(batch["input_ids"], batch["attention_mask"])

    def evaluate(merged: ComposedLM) -> dict:
        return {**task.evaluate_composition(sharded(merged), test_set, bs),  # exact match, per-skill accuracy, extras
                "max_logprob_gap_vs_composed": max_logprob_gap(merged.score(batch["input_ids"],
                                                                            batch["attention_mask"]), composed_lp,
                                                               valid)}

    results = {}
    for method in cfg.baselines:
        if module.settings.mode != "lora" and method != "task_arithmetic":
            console.stage("baselines", f"{method}: skipped (TIES and DARE merge LoRA adapters only)")
            continue
        console.stage("baselines", f"{method}: merging {', '.join(names)} and decoding {len(test_set)} test rows")
        if module.settings.mode == "lora":
            with merged_adapter(module.peft_model, names, method, weights=composed.weights,
                                seed=cfg.seed) as merged_name:
                results[method] = evaluate(ComposedLM.from_peft(module.peft_model, [merged_name], tokenizer=tok))
        else:  # task arithmetic of full copies
            results[method] = evaluate(ComposedLM(task_arithmetic(module.background, [module.experts[n] for n in names],
                                                                  composed.weights), tokenizer=tok))
    return results


@torch.no_grad()
def write_divergence_map(composed: ComposedLM, rows, collate, path: Path) -> None:
    """Per output position, KL(p_b ‖ p_i) of each expert on a few test inputs, with its mask (for the heatmap)."""
    batch = collate([rows[i] for i in range(len(rows))])
    lp_b, lp_e = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
    kl = divergence(lp_e, lp_b.expand_as(lp_e), "forward_kl")  # [k, B, T]
    valid = batch["targets"] != IGNORE_INDEX
    tokens = [[composed.tokenizer.decode([t]) for t in batch["targets"][b][valid[b]].tolist()] for b in range(len(rows))]
    out = {"experts": list(composed.names), "inputs": list(rows["x"]), "outputs": list(rows["y"]), "tokens": tokens,
           "divergence": [[kl[i, b][valid[b]].tolist() for b in range(len(rows))] for i in range(len(composed.names))],
           "masks": [[batch["masks"][b, i][valid[b]].int().tolist() for b in range(len(rows))]
                     for i in range(len(composed.names))]}
    atomic_write_text(path, json.dumps(out))


_RUNNING: list[DictConfig] = []  # the run in progress and the ablation sub-runs it started


def run(cfg: DictConfig, command: str | None = None) -> dict:
    """Run the whole pipeline for `cfg`; returns the summary (also written to `summary.json`).

    SIGTERM and SIGINT stop it resumably (`resume.stop_on_signals`): `Interrupted` (a `SystemExit` of status
    128 + the signal's number) is raised, with `output_dir` naming the run folder to resume."""
    console.quiet()
    plan = None
    with stop_on_signals(), cpu_threads(cfg.trainer.threads) as threads:
        try:
            plan = plan_run(cfg)  # with ckpt_path=last: refuses a config that changes what the run already trained
            if not _RUNNING:
                source = ("trainer.threads" if cfg.trainer.threads else "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ
                          else "torch's default; trainer.threads sets it")
                console.stage("run", f"{threads} CPU thread{'s' if threads > 1 else ''} per process ({source})")
            _RUNNING.append(cfg)
            try:
                return _run_planned(cfg, plan, command)
            finally:
                _RUNNING.pop()
        except Interrupted as stop:
            if plan is not None and plan.out.is_dir():
                stop.output_dir = plan.out  # the outermost run's folder: an ablation's is resumed through it
            raise


@contextmanager
def cpu_threads(threads: int | None) -> Iterator[int]:
    """`trainer.threads` for the block: torch's intra-op threads, and `OMP_NUM_THREADS` for the ranks Lightning's
    DDP launcher starts (it divides the cores among them only where that is unset); None: as torch chose.
    Yields the threads in use."""
    if threads is None:
        yield torch.get_num_threads()
        return
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def _run_planned(cfg: DictConfig, plan: Plan, command: str | None) -> dict:
    t0 = time.time()
    leader = is_leader()  # a rank > 0 of a distributed run writes nothing (`pipeline.ranks`)
    if leader:
        if cfg.ckpt_path == "last":
            remove_stale_temporaries(plan.out)  # what a killed atomic save left behind
        plan.out.mkdir(parents=True, exist_ok=True)
        saved = cfg.copy()
        saved.ckpt_path = None  # the run's config; how it was (re)started is the summary's `command`
        atomic_write_text(plan.out / "config.yaml", OmegaConf.to_yaml(saved, resolve=True))
        if not (plan.out / "tokenizer").is_dir():
            atomic_save(plan.tokenizer.save_pretrained, plan.out / "tokenizer")
    torch.set_float32_matmul_precision("high")

    background_path = background_stage(cfg, plan)
    timing = {"background_s": time.time() - t0}
    module = experts_stage(cfg, plan, background_path) if plan.trained else None
    timing["experts_s"] = time.time() - t0 - timing["background_s"]
    summary = {"experiment": cfg.experiment, "task": cfg.task.name, "seed": cfg.seed, "command": command,
               **composition_stage(cfg, plan, background_path, module)}
    timing["composition_s"] = time.time() - t0 - timing["background_s"] - timing["experts_s"]
    if cfg.ablations:
        summary["ablations"] = run_ablations(cfg, plan.out, background_path, plan.task, run)
        timing["ablations_s"] = time.time() - t0 - sum(timing.values())
    timing["total_s"] = time.time() - t0
    summary["timing"] = {k: round(v, 1) for k, v in timing.items()}
    summary["output_dir"] = str(plan.out)
    summary["export"] = str(plan.out / "export") if plan.trained else None
    if leader:
        atomic_write_text(plan.out / "summary.json", json.dumps(with_intervals(summary), indent=2))
        if plan.trained:  # the export's model card (outside its checksums: the export still verifies)
            write_model_card(plan.out / "export", metrics={k: summary[k] for k in CARD_METRICS if k in summary},
                             title=cfg.experiment)
        if cfg.report:
            summary["report"] = str(write_report(summary, plan.out))
    return summary
