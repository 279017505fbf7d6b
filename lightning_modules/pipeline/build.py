"""What a run builds from its config: the task, the experts' settings, the data modules and the experts' module.

The pipeline (`stages`), the scripts and the benchmarks all build through these functions, so a script run on a
config trains, measures or evaluates what `train.py` would for it. Only `new_task` is free of the run config (a
task from settings recorded elsewhere, e.g. an export's manifest); this module imports no Lightning until a
config-level builder runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from data.tasks import Expert, Task, TaskError, task_class

if TYPE_CHECKING:
    from data.datamodule import TaskDataModule
    from lightning_modules.expert import ExpertLM, ExpertSettings

# `ExpertSettings` field -> the config key that sets it (`expert_settings`; its errors name these keys).
SETTING_KEYS = {
    "mode": "expert.mode", "lora_r": "expert.lora.r", "lora_alpha": "expert.lora.alpha",
    "target_modules": "expert.lora.target_modules", "lora_layers": "expert.lora.layers",
    "reg_weight": "expert.reg_weight", "reg_after_close": "expert.reg_after_close",
    "reg_inside_foreign": "expert.reg_inside_foreign", "reg_at_open": "expert.reg_at_open",
    "divergence": "expert.divergence", "jsd_beta": "expert.jsd_beta", "temperature": "expert.temperature",
    "task_loss_on_mask_only": "expert.task_loss_on_mask_only", "lr": "expert.optim.lr",
    "weight_decay": "expert.optim.weight_decay", "warmup_ratio": "expert.optim.warmup_ratio",
    "max_steps": "expert.max_steps", "active_threshold": "composition.active_threshold",
    "log_every_n_steps": "trainer.log_every_n_steps", "regularizer": "expert.regularizer",
    "background_top_k": "expert.background_cache", "position_jump": "expert.position_jump",
    "loss_chunk_size": "expert.loss_chunk_size",
}
_CONFIGURED = object()  # `build_datamodule`: the corruption variants the config asks for


def new_task(name: str, settings: Any, experts: Sequence[Expert], *, trained: Sequence[str] | None = None,
             reg_data: str = "own", seed: int = 0, tokenizer: Any = None, allow_overlap: bool = False) -> Task:
    """The task registered as `name` with its settings object and every expert in play (`data.tasks.Task`);
    raises `TaskError`."""
    return task_class(name)(settings, experts, trained=trained, reg_data=reg_data, seed=seed, tokenizer=tokenizer,
                            allow_overlap=allow_overlap)


def configured_experts(cfg: DictConfig) -> list[Expert]:
    """The experts of `cfg.experts` (those the run trains), with what they own, weight and data."""
    from lightning_modules.pipeline.config import expert_spec

    return [Expert(e.name, expert_spec(e), float(e.weight), tuple(e.data)) for e in cfg.experts]


def build_task(cfg: DictConfig, frozen: Sequence[Expert] = ()) -> Task:
    """The run's task: its settings, the configured experts (trained) then `frozen` ones (from earlier exports),
    the regularizer data, seed, the pretrained model's tokenizer if any; a bad one is a `ConfigError`."""
    from lightning_modules.pipeline.config import ConfigError, task_settings

    try:
        return new_task(cfg.task.name, task_settings(cfg), [*configured_experts(cfg), *frozen],
                        trained=[e.name for e in cfg.experts], reg_data=cfg.expert.reg_data, seed=cfg.seed,
                        tokenizer=model_tokenizer(cfg), allow_overlap=cfg.composition.allow_overlap)
    except TaskError as e:
        raise ConfigError(str(e)) from None


def model_tokenizer(cfg: DictConfig) -> Any:
    """The tokenizer saved inside the pretrained model's folder (`model.pretrained_path`, else `background.path`;
    an HF folder, or the folder a `.gguf` file or `smollm2` converts to), if it has one; else None."""
    from transformers import AutoTokenizer

    from lightning_modules.pipeline.config import ConfigError
    from lightning_modules.pipeline.models import pretrained_folder

    for key in ("model.pretrained_path", "background.path"):
        path = OmegaConf.select(cfg, key)
        folder = pretrained_folder(path, key) if path else None
        if folder is None or not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            continue
        try:
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code)
        except Exception as e:
            raise ConfigError(f"{key}: cannot read the tokenizer in {folder}: {str(e).splitlines()[0]}") from None
    return None


def config_name(field: str | None, *value: Any) -> str:
    """A setting as the config names it: `expert.background_cache`, `expert.regularizer=features`, `null`."""
    def text(v: Any) -> str:
        return "null" if v is None else str(v)

    if field is None:
        return text(value[0])
    return SETTING_KEYS[field] if not value else f"{SETTING_KEYS[field]}={text(value[0])}"


def expert_settings(cfg: DictConfig) -> ExpertSettings:
    """The experts' `ExpertSettings` from the config (`expert:`, `composition.active_threshold`,
    `trainer.log_every_n_steps`); settings that do not go together are a `ConfigError` naming their keys."""
    from lightning_modules.expert import ExpertSettings, SettingsError
    from lightning_modules.pipeline.config import ConfigError, lora_target_modules

    e = cfg.expert
    try:
        return ExpertSettings(
            mode=e.mode, lora_r=e.lora.r, lora_alpha=e.lora.alpha, target_modules=lora_target_modules(cfg),
            lora_layers=_plain(e.lora.layers),
            reg_weight=e.reg_weight, reg_after_close=e.reg_after_close, reg_inside_foreign=e.reg_inside_foreign,
            reg_at_open=e.reg_at_open,
            divergence=e.divergence,
            jsd_beta=e.jsd_beta, temperature=e.temperature,
            task_loss_on_mask_only=e.task_loss_on_mask_only, lr=e.optim.lr, weight_decay=e.optim.weight_decay,
            warmup_ratio=e.optim.warmup_ratio, max_steps=e.max_steps,
            active_threshold=cfg.composition.active_threshold,
            log_every_n_steps=cfg.trainer.log_every_n_steps or ExpertSettings.log_every_n_steps,  # null: stages decide
            regularizer=e.regularizer,
            background_top_k=e.background_cache.top_k if e.background_cache is not None else None,
            position_jump=e.position_jump, loss_chunk_size=e.loss_chunk_size)
    except SettingsError as err:
        raise ConfigError(err.render(config_name)) from None
    except ValueError as err:
        raise ConfigError(f"expert: {err}") from None


def _plain(value: Any) -> Any:
    """A config value as plain Python (lists and mappings of OmegaConf become list and dict)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def build_datamodule(cfg: DictConfig, task: Task, stage: str,
                     corruption_variants: int | None | object = _CONFIGURED) -> TaskDataModule:
    """The data module of a training `stage` ("background" or "experts"), as the pipeline trains it: the experts
    stage takes `data.batch_size` rows per trained expert per step, and with the background cache its rows
    corrupted in `expert.background_cache.variants` fixed ways (`corruption_variants` overrides that)."""
    from data.datamodule import TaskDataModule

    if stage == "background":
        return TaskDataModule(task, "background", cfg.data.batch_size, cfg.background.corruption_prob,
                              cfg.data.num_workers, cfg.seed)
    if corruption_variants is _CONFIGURED:
        cache = cfg.expert.background_cache
        corruption_variants = cache.variants if cache is not None else None
    return TaskDataModule(task, "experts", cfg.data.batch_size * len(task.trained), cfg.expert.corruption_prob,
                          cfg.data.num_workers, cfg.seed, corruption_variants=corruption_variants)


def expert_background(cfg: DictConfig, path: str | Path, tokenizer: Any, mode: str | None = None) -> Any:
    """The background the experts train on, loaded from `path` as the experts stage loads it: under LoRA (`mode`,
    default `expert.mode`) it stays frozen and may take a lower precision; full and head copies train in float32."""
    from lightning_modules.pipeline.models import load_options, load_pretrained

    frozen = (mode or cfg.expert.mode) == "lora"
    return load_pretrained(path, tokenizer, **load_options(cfg.model, cfg.trainer, frozen=frozen))


def build_expert(cfg: DictConfig, task: Task, background: Any, *, frozen_adapters: dict[str, str] | None = None,
                 settings: ExpertSettings | None = None, module_class: type[ExpertLM] | None = None) -> ExpertLM:
    """The experts' module: the task's trained experts on `background`, with `settings` (default:
    `expert_settings(cfg)`), the composition weights of every expert in play, the task's feature map, and the
    folders the experts start from (`expert.init_from`, trained against `expert.init_base`)."""
    from lightning_modules.expert import ExpertLM
    from lightning_modules.pipeline.init_from import init_base_folder, init_from_folders

    base = init_base_folder(cfg)
    return (module_class or ExpertLM)(
        background, task.trained, settings or expert_settings(cfg), frozen_adapters=frozen_adapters,
        weights={e.name: e.weight for e in task.experts}, feature_map=task.feature_map,
        owned_features={n: task.owned_features(n) for n in task.trained},
        init_from={n: str(path) for n, path in init_from_folders(cfg).items() if n in task.trained},
        init_base=None if base is None else str(base))
