"""The task seam: everything the pipeline needs from a task, and nothing else.

A task owns its tokenizer, its rows and the decoding-side evaluation of a composed model. The pipeline
(`lightning_modules/pipeline/`: stages, callbacks, ablations, report, config) only ever calls the methods
below, so adding a task means writing one subclass of `Task` and registering it (`data.tasks.register_task`).

Rows are `datasets.Dataset`s with these columns (the collator pads them):

* `input_ids` (list[int]), `targets` (list[int], already shifted: `logits[:, t]` is scored against
  `targets[:, t]`; `-100` = not scored), `masks` (k lists of 0/1 over the positions of `targets`: 1 where
  that expert may differ from the background);
* `output_start`, `output_len` (int): the span of teacher-forced output tokens that prefix corruption may
  replace (`data.collate.Collator`);
* expert training rows also carry `expert_index` (index into the trained experts), `is_task` (1: the task
  loss scores every target; 0: a regularizer row) and `task_on_mask` (1: the targets on the expert's own
  mask are its skill's outputs, so the task loss scores them there too);
* compositional rows carry `x` (the input, as text) and `y` (the reference output, as text).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import datasets
from torch import Tensor
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from compose import ComposedLM
    from data.collate import CorruptionRate
    from losses.features import FeatureMap

SPLITS = ("train", "val", "test")
EVAL_SPLITS = ("val", "test")
# Regularizer rows that only some tasks make (each task lists the ones it makes in `Task.extra_reg_data`):
# `own+samples` (the background's own continuations of general prompts) and `own+foreign` (rows holding random
# spans in delimiters no expert is known by), both free of any other expert's knowledge.
TASK_REG_DATA = ("own+samples", "own+foreign")
REG_DATA_CHOICES = ("own", "background", "composition", "own+background", "random_rules", *TASK_REG_DATA)


# Column types of task rows (the contract above); expert rows add EXPERT_FEATURES.
ROW_FEATURES = {
    "x": datasets.Value("string"),
    "y": datasets.Value("string"),
    "input_ids": datasets.List(datasets.Value("int64")),
    "targets": datasets.List(datasets.Value("int64")),
    "masks": datasets.List(datasets.List(datasets.Value("int8"))),
    "output_start": datasets.Value("int64"),
    "output_len": datasets.Value("int64"),
}
EXPERT_FEATURES = {key: datasets.Value("int64") for key in ("expert_index", "is_task", "task_on_mask")}


class TaskError(ValueError):
    """Bad task input (a data file, a row, an interval spec, a tokenizer): one line naming it."""


# Synthetic splits are built in memory, in Python (letters, measured: ~0.7 KB and ~0.1 ms per 35-token row, so
# 1M rows of one expert's split take ~0.7 GB and minutes). Larger requests are refused before anything is built.
MAX_ROWS = 1_000_000  # per split and expert (task.n_train, n_val, n_test)
MAX_SPLIT_TOKENS = 100_000_000  # rows x longest row, per split and expert (~2 GB)


def check_split_sizes(settings: Any, row_tokens: int, keys: Sequence[str] = ("n_train", "n_val", "n_test")) -> None:
    """Raise `TaskError` naming `task.<key>` unless each split size is in [1, MAX_ROWS] and its rows of up to
    `row_tokens` tokens stay under MAX_SPLIT_TOKENS."""
    for key in keys:
        n = getattr(settings, key)
        if n < 1 or n > MAX_ROWS:
            raise TaskError(f"task.{key}={n}: must be an integer in [1, {MAX_ROWS:,}] (rows per split and expert, "
                            "built in memory: data/tasks/base.py MAX_ROWS)")
        if n * row_tokens > MAX_SPLIT_TOKENS:
            raise TaskError(f"task.{key}={n} rows of up to {row_tokens} tokens (task.max_len={settings.max_len}) "
                            f"exceed {MAX_SPLIT_TOKENS:,} tokens per split and expert (built in memory: "
                            "data/tasks/base.py MAX_SPLIT_TOKENS); lower task.max_len or the split size")


def check_split(split: str, allowed: Sequence[str] = SPLITS) -> None:
    """Raise `ValueError` unless `split` is one of `allowed` (`SPLITS`, or `EVAL_SPLITS` for held-out rows)."""
    if split not in allowed:
        raise ValueError(f"split must be one of {list(allowed)}, got {split!r}")


@dataclass(frozen=True)
class Expert:
    """One expert as a task sees it.

    Attributes:
        name: unique name (adapter name, manifest name, metric prefix).
        spec: the expert's mask spec, what it owns: `{"rules": {"A": "B"}}` (letter task) or
            `{"interval": {"start": "[", "end": "]"}}` (interval and text tasks). Stored as is in the
            export manifest.
        weight: its composition weight `w_i`.
        data: its training files (text task); empty for synthetic tasks.
    """

    name: str
    spec: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    data: tuple[str, ...] = ()


class Task(ABC):
    """A task: tokenizer, rows, and the decoding-side evaluation of a composed model.

    Args:
        cfg: the task's own settings (an instance of `config_class`, built from the `task:` config node).
        experts: every expert in play, trained in this run or loaded from earlier exports, in composition
            order. Compositional rows carry one mask per expert, in this order.
        trained: names of the experts trained in this run (default: all); `expert_index` indexes this list.
        reg_data: regularizer rows for the trained experts, one of `REG_DATA_CHOICES` (a task that cannot
            make a kind raises `TaskError`).
        seed: base seed of every split.
        tokenizer: a tokenizer to use instead of the task's own (e.g. a pretrained model's); tasks that
            need a specific tokenizer may refuse it.
        allow_overlap: accept experts whose masks or intervals may overlap (reported in `notes`).

    Construction checks everything the task can check without training (files, fields, specs, overlaps)
    and raises `TaskError` (one line naming the file, row or key) on bad input.
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    extra_reg_data: ClassVar[tuple[str, ...]] = ()  # the kinds of TASK_REG_DATA this task makes
    marks_span_positions: ClassVar[bool] = False  # expert rows carry `after_close`, `inside_foreign`, `at_open` (the reg_* weights)

    def __init__(self, cfg: Any, experts: Sequence[Expert], *, trained: Sequence[str] | None = None,
                 reg_data: str = "own", seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None,
                 allow_overlap: bool = False) -> None:
        self.cfg, self.experts, self.seed = cfg, list(experts), seed
        self.trained = [e.name for e in self.experts] if trained is None else list(trained)
        unknown = [n for n in self.trained if n not in self.expert_names]
        if unknown:
            raise TaskError(f"trained experts {unknown} are not among the experts in play {self.expert_names}")
        if reg_data not in REG_DATA_CHOICES:
            raise TaskError(f"reg_data={reg_data!r} is not one of {', '.join(REG_DATA_CHOICES)}")
        if reg_data in TASK_REG_DATA and reg_data not in self.extra_reg_data:
            raise TaskError(f"expert.reg_data={reg_data} is not made by the {self.name} task (the text task makes "
                            f"{', '.join(TASK_REG_DATA)})")
        self.reg_data, self.allow_overlap = reg_data, allow_overlap

    # --- what the pipeline reads -----------------------------------------------------------------
    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer every component shares (saved with the run and the export)."""

    @property
    def expert_names(self) -> list[str]:
        return [e.name for e in self.experts]

    @property
    def max_row_length(self) -> int | None:
        """Tokens in the longest row the task builds, where its settings bound it before anything is built
        (`max_row_length` of the settings); None: unknown. The pipeline checks it against a model built from
        scratch (`model.max_position_embeddings`)."""
        return getattr(self.cfg, "max_row_length", None)

    @property
    def feature_map(self) -> FeatureMap | None:
        """The token bijection ``D: V → F_1 × … × F_n`` of a feature-space task (docs/method.md, when the rule is exact), used by the
        factored head (`model.head: factored`) and the per-feature regularizer; None: the task has none."""
        return None

    def owned_features(self, name: str) -> tuple[str, ...]:
        """The features expert `name` may change on its mask (the others must keep the background's marginal);
        default: every feature."""
        return self.feature_map.names if self.feature_map is not None else ()

    @property
    def notes(self) -> list[str]:
        """Human-readable remarks for the summary (e.g. overlapping experts that were allowed)."""
        return []

    @abstractmethod
    def background_dataset(self, split: str) -> datasets.Dataset:
        """Rows for the background (`masks` has k = 0 rows)."""

    @abstractmethod
    def expert_dataset(self, split: str) -> datasets.Dataset:
        """Rows for training (`split="train"`) or validating the experts of `self.trained`.

        Training rows: each expert's task rows (`is_task=1`) plus regularizer rows chosen by
        `self.reg_data`. Every row has `masks` of k = 1 (its own expert's mask) and `expert_index` into
        `self.trained`. Validation/test rows: each expert's held-out task rows.
        """

    @abstractmethod
    def compositional_dataset(self, split: str) -> datasets.Dataset:
        """Held-out rows (`val` or `test`) that need several experts at once; targets are the composed
        reference, `masks` has one row per expert in play, and `x`/`y` hold the input and reference text."""

    @abstractmethod
    def collator(self, corruption_prob: CorruptionRate = 0.0) -> Callable[[list[dict]], dict[str, Tensor]]:
        """Pads rows into a batch (`data.collate.Collator`), corrupting prefixes at `corruption_prob` (a rate
        or `(low, high)`, a rate per row)."""

    @abstractmethod
    def evaluate_background(self, model: ComposedLM, split: str, batch_size: int) -> dict[str, float]:
        """Decode the background's held-out rows; at least `exact_match`."""

    @abstractmethod
    def evaluate_expert(self, model: ComposedLM, name: str, split: str, batch_size: int) -> dict[str, float]:
        """Decode expert `name` alone (`model` = background + that expert) on its held-out task rows;
        at least `exact_match`."""

    @abstractmethod
    def evaluate_composition(self, model: ComposedLM, dataset: datasets.Dataset,
                             batch_size: int) -> dict[str, float]:
        """Decode `model` (background + every expert in play, in order) on compositional rows:
        at least `exact_match` and `<expert>/skill_accuracy` per expert; optionally `failures/<kind>`.
        The pipeline adds the teacher-forced metrics (`compose.evaluation.teacher_forced_metrics`)."""

    def background_sample_prompts(self) -> list[list[int]]:
        """Prompt ids whose continuations, sampled from the background, `reg_data=own+samples` makes its
        regularizer rows of (`set_background_samples`); [] for a task that makes no such rows."""
        return []

    def set_background_samples(self, responses: Sequence[str]) -> None:
        """The background's continuation of each of `background_sample_prompts()`, in order (decoded text)."""
        raise TaskError(f"the {self.name} task makes no regularizer rows of background samples")

    def standard_experts(self, k: int) -> list[dict]:
        """k disjoint experts as config entries (for the `ablation_ks` sweep); tasks without one raise."""
        raise TaskError(f"task {self.name!r} cannot make a standard set of {k} experts (ablation_ks)")

    def evaluate_lengths(self, background: ComposedLM, experts: Mapping[str, ComposedLM], composed: ComposedLM | None,
                         batch_size: int, progress: Callable[[int], None] | None = None) -> dict[str, dict]:
        """Length generalization (docs/method.md, when the rule is exact): exact match of the background, each trained expert alone (name ->
        background + that expert) and `composed` at each input length the task's settings ask for, keyed by
        length: `{"<L>": {"background", "experts": {name: ...}, "composition", ...}}`. `{}` (the default): the
        task sweeps no lengths."""
        return {}

    # --- shared by every task ---------------------------------------------------------------------
    def composition_metrics(self, model: ComposedLM, dataset: datasets.Dataset, batch_size: int,
                            active_threshold: float = 0.01) -> dict[str, float]:
        """Everything the composition is judged by on compositional rows: the task's decoding metrics
        (`evaluate_composition`) and the teacher-forced ones (`compose.evaluation.teacher_forced_metrics`)."""
        from compose.evaluation import teacher_forced_metrics

        results = self.evaluate_composition(model, dataset, batch_size)
        results |= teacher_forced_metrics(model, dataset, self.collator(), batch_size, active_threshold)
        return results
