"""LightningDataModules for the letter-replacement task (the only Lightning code under ``data/``).

* :class:`BackgroundDataModule`: the copy task for the background model.
* :class:`ExpertDataModule`: task rows of one or more experts (one shuffled loader, batches mix experts),
  plus regularizer rows chosen by ``reg_data``, per-expert validation/test rows, and the compositional
  inputs on which the composed model is judged.

Every split is drawn from its own seed derived from ``cfg.seed`` (and the expert's *name*, so adding an
expert leaves the others' data unchanged); validation inputs avoid the training inputs and test inputs
avoid both, so the held-out splits are disjoint from training.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import datasets
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from data.letters import (
    LettersCollator,
    RuleSet,
    check_format,
    compositional_inputs,
    dataset_builder,
    expert_inputs,
    sample_strings,
    validate_rule_sets,
)
from data.tokenizer import build_char_tokenizer, letter_ids, validate_alphabet

REG_DATA_CHOICES = ("own", "background", "composition", "own+background")
EVAL_SPLITS = ("val", "test")


@dataclass
class LettersDataConfig:
    """Data settings of the letter task.

    Attributes:
        alphabet: the letters (must match the tokenizer's).
        min_len, max_len: input lengths are uniform in ``[min_len, max_len]``.
        n_train, n_val, n_test: rows per split, *per expert* for :class:`ExpertDataModule` (the same count
            again for each expert's regularizer rows when ``reg_data`` adds any).
        batch_size: rows per batch (all loaders).
        format: the sequence layout: ``generative`` (``<bos> x <sep> y <eos>``, :func:`build_letters_dataset`)
            or ``aligned`` (``<bos> x``, the logits at ``x[j]`` predict ``y[j]``, :func:`build_aligned_dataset`);
            every split, the background's copy rows, the experts' task and regularizer rows and the
            compositional sets use it.
        corruption_prob: prefix corruption rate for training batches only (val/test are clean). Ignored by
            the ``aligned`` format: it has no teacher-forced outputs, so there is no prefix to corrupt.
        source_prob: fraction of an expert's inputs planted with one of its source letters.
        compositional_min_experts: ``None``: compositional inputs contain a source of every expert in
            play; otherwise of a random subset of at least this many (>= 2).
        reg_data: regularizer data for experts: ``own`` (none added: the regularizer runs on the task rows'
            off-mask positions), ``background`` (copy rows), ``composition`` (compositional rows: every
            composition expert's rules applied, so the prefixes are the composition's own; the expert's task
            loss also scores its own mask there), ``own+background`` (copy rows; the module regularizes on
            both).
        num_workers: DataLoader workers.
        seed: base seed of every split.
    """

    alphabet: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    min_len: int = 8
    max_len: int = 16
    format: str = "generative"
    n_train: int = 8000
    n_val: int = 500
    n_test: int = 1000
    batch_size: int = 64
    corruption_prob: float = 0.0
    source_prob: float = 0.5
    compositional_min_experts: int | None = None
    reg_data: str = "own"
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        validate_alphabet(self.alphabet)
        if self.min_len < 1 or self.max_len < self.min_len:
            raise ValueError(
                f"data config: need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}"
            )
        try:
            check_format(self.format)
        except ValueError as e:
            raise ValueError(f"data config: {e}") from None
        for key in ("n_train", "n_val", "n_test", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"data config: {key} must be >= 1, got {getattr(self, key)}")
        for key in ("corruption_prob", "source_prob"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"data config: {key} must be in [0, 1], got {getattr(self, key)}")
        if self.reg_data not in REG_DATA_CHOICES:
            raise ValueError(f"data config: reg_data={self.reg_data!r} is not one of {list(REG_DATA_CHOICES)}")
        if self.compositional_min_experts is not None and self.compositional_min_experts < 2:
            raise ValueError(
                f"data config: compositional_min_experts must be None or >= 2, got {self.compositional_min_experts}"
            )
        if self.num_workers < 0:
            raise ValueError(f"data config: num_workers must be >= 0, got {self.num_workers}")


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and labels, stable across processes (unlike ``hash``)."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _draw_excluding(
    make: Callable[[int], list[str]], n: int, exclude: set[str], what: str, max_attempts: int = 20
) -> list[str]:
    """``n`` strings from ``make(0), make(1), ...`` that are not in ``exclude``. If the string space is too
    small for that, warns and lets the split overlap ``exclude``."""
    out = [x for x in make(0) if x not in exclude]
    attempt = 1
    while len(out) < n and attempt <= max_attempts:
        out += [x for x in make(attempt) if x not in exclude]
        attempt += 1
    if len(out) < n:
        warnings.warn(
            f"{what}: could not draw {n} inputs disjoint from the earlier splits (string space too small "
            f"for min_len/max_len/alphabet); the split overlaps them",
            stacklevel=3,
        )
        out += make(0)[: n - len(out)]
    return out[:n]


def _check_split(split: str) -> None:
    if split not in EVAL_SPLITS:
        raise ValueError(f"split must be one of {list(EVAL_SPLITS)}, got {split!r}")


class _LettersDataModule(pl.LightningDataModule):
    """Shared loaders of the letter-task datamodules."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, cfg: LettersDataConfig | None) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else LettersDataConfig()
        self.tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer(self.cfg.alphabet)
        letter_ids(self.tokenizer, self.cfg.alphabet)  # every letter must be a token
        self.datasets: dict[str, datasets.Dataset] = {}
        self.build_dataset = dataset_builder(self.cfg.format)

    @property
    def train_corruption_prob(self) -> float:
        """Prefix corruption of training batches: ``cfg.corruption_prob``, or 0 for the ``aligned`` format."""
        return 0.0 if self.cfg.format == "aligned" else self.cfg.corruption_prob

    def _loader(self, dataset: datasets.Dataset, train: bool) -> DataLoader:
        cfg = self.cfg
        collator = LettersCollator(self.tokenizer, cfg.alphabet, self.train_corruption_prob if train else 0.0)
        return DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            shuffle=train,
            collate_fn=collator,
            num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0,
            generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "shuffle")) if train else None,
        )

    def _built(self, split: str) -> datasets.Dataset:
        self.setup()
        return self.datasets[split]

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, with prefix corruption at :attr:`train_corruption_prob`."""
        return self._loader(self._built("train"), train=True)

    def val_dataloader(self) -> DataLoader:
        """Clean validation batches, in order."""
        return self._loader(self._built("val"), train=False)

    def test_dataloader(self) -> DataLoader:
        """Clean test batches, in order."""
        return self._loader(self._built("test"), train=False)

    def _strings(self, n: int, seed: int) -> Callable[[int], list[str]]:
        cfg = self.cfg
        return lambda attempt: sample_strings(
            n, cfg.alphabet, cfg.min_len, cfg.max_len, derive_seed(seed, attempt)
        )


class BackgroundDataModule(_LettersDataModule):
    """Copy-task data for the background: ``y == x``, no masks (``masks`` is ``[B, 0, T]``).

    Args:
        tokenizer: the character tokenizer (``None``: ``build_char_tokenizer(cfg.alphabet)``).
        cfg: data settings (``None``: defaults).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None = None, cfg: LettersDataConfig | None = None
    ) -> None:
        super().__init__(tokenizer, cfg)
        self.inputs: dict[str, list[str]] = {}

    def setup(self, stage: str | None = None) -> None:
        """Build train/val/test once (later calls do nothing)."""
        if self.datasets:
            return
        cfg, seen = self.cfg, set()
        for split, n in (("train", cfg.n_train), ("val", cfg.n_val), ("test", cfg.n_test)):
            make = self._strings(n, derive_seed(cfg.seed, "background", split))
            xs = _draw_excluding(make, n, seen, f"background {split}")
            seen.update(xs)
            self.inputs[split] = xs
            self.datasets[split] = self.build_dataset(xs, [], [], self.tokenizer)

    def copy_eval_inputs(self, split: str) -> list[str]:
        """The inputs of the ``val`` or ``test`` split (for judging the background by generation)."""
        _check_split(split)
        self.setup()
        return list(self.inputs[split])


class ExpertDataModule(_LettersDataModule):
    """Data for training experts, alone or several at once.

    Args:
        tokenizer: the character tokenizer (``None``: ``build_char_tokenizer(cfg.alphabet)``).
        cfg: data settings (``None``: defaults).
        experts: the experts being trained; ``expert_index`` ``i`` is the position in this list.
        composition_experts: every expert in play for composition (default: ``experts``); may include
            experts trained earlier, must include every expert in ``experts``.

    Training rows (all experts shuffled together) per expert ``i``: ``n_train`` task rows (``y`` = its
    rules, ``masks`` = its own mask, ``is_task=1``), a fraction ``source_prob`` planted with one of its
    sources; plus, by ``cfg.reg_data``, ``n_train`` regularizer rows (``is_task=0``, ``masks`` = expert
    ``i``'s own mask): copy rows for ``background`` and ``own+background``, compositional rows (targets
    = all composition experts' rules) for ``composition``, none for ``own``. Every row has ``k = 1``.

    ``task_on_mask=1`` marks rows whose targets on expert ``i``'s mask are its own rule's outputs: task rows,
    and compositional regularizer rows (the expert learns its skill on the prefixes the composition writes,
    while the regularizer holds it to the background off its mask). Copy rows have ``task_on_mask=0``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        cfg: LettersDataConfig | None,
        experts: Sequence[RuleSet],
        composition_experts: Sequence[RuleSet] | None = None,
        allow_overlap: bool = False,
    ) -> None:
        super().__init__(tokenizer, cfg)
        self.experts = list(experts)
        self.composition_experts = list(composition_experts) if composition_experts is not None else list(experts)
        if not self.experts:
            raise ValueError("ExpertDataModule needs at least one expert")
        validate_rule_sets(self.experts, self.cfg.alphabet, allow_overlap=allow_overlap)
        validate_rule_sets(self.composition_experts, self.cfg.alphabet, allow_overlap=allow_overlap)
        names = [e.name for e in self.composition_experts]
        for e in self.experts:
            if e not in self.composition_experts:
                raise ValueError(
                    f"expert {e.name!r} (rules {e.rules}) is trained but not in composition_experts {names}"
                )
        m = self.cfg.compositional_min_experts
        if m is not None and m > len(self.composition_experts):
            raise ValueError(
                f"data config: compositional_min_experts={m} exceeds the {len(self.composition_experts)} "
                f"composition experts {names}"
            )
        self.expert_inputs: dict[str, list[list[str]]] = {}
        self.compositional: dict[str, list[str]] = {}
        self._compositional_datasets: dict[str, datasets.Dataset] = {}

    @property
    def expert_names(self) -> list[str]:
        """Names of the experts being trained, in ``expert_index`` order."""
        return [e.name for e in self.experts]

    def _compositional_maker(self, n: int, seed: int) -> Callable[[int], list[str]]:
        cfg = self.cfg
        return lambda attempt: compositional_inputs(
            n, cfg.alphabet, cfg.min_len, cfg.max_len, derive_seed(seed, attempt),
            self.composition_experts, cfg.compositional_min_experts,
        )

    def setup(self, stage: str | None = None) -> None:
        """Build every split once (later calls do nothing)."""
        if self.datasets:
            return
        cfg, tok, seen = self.cfg, self.tokenizer, set()
        sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
        for split, n in sizes.items():
            parts, self.expert_inputs[split] = [], []
            for i, expert in enumerate(self.experts):
                seed = derive_seed(cfg.seed, "expert", expert.name, split)

                def make(attempt: int, n: int = n, seed: int = seed, expert: RuleSet = expert) -> list[str]:
                    return expert_inputs(
                        n, cfg.alphabet, cfg.min_len, cfg.max_len, derive_seed(seed, attempt), expert,
                        cfg.source_prob,
                    )

                xs = _draw_excluding(make, n, seen, f"expert {expert.name!r} {split}")
                self.expert_inputs[split].append(xs)
                parts.append(self.build_dataset(xs, [expert], [expert], tok, {"expert_index": i, "is_task": 1,
                                                                          "task_on_mask": 1}))
                if split == "train":
                    parts.extend(self._regularizer_rows(i, expert, n))
            for xs in self.expert_inputs[split]:
                seen.update(xs)
            if split == "train":
                for part in parts:
                    seen.update(part["x"])
            else:
                make = self._compositional_maker(n, derive_seed(cfg.seed, "compositional", split))
                self.compositional[split] = _draw_excluding(make, n, seen, f"compositional {split}")
                seen.update(self.compositional[split])
            self.datasets[split] = datasets.concatenate_datasets(parts)

    def _regularizer_rows(self, i: int, expert: RuleSet, n: int) -> list[datasets.Dataset]:
        cfg, extra = self.cfg, {"expert_index": i, "is_task": 0}
        if cfg.reg_data in ("background", "own+background"):
            xs = self._strings(n, derive_seed(cfg.seed, "regularizer-copy", expert.name))(0)
            return [self.build_dataset(xs, [], [expert], self.tokenizer, {**extra, "task_on_mask": 0})]
        if cfg.reg_data == "composition":
            xs = self._compositional_maker(n, derive_seed(cfg.seed, "regularizer-composition", expert.name))(0)
            return [self.build_dataset(xs, self.composition_experts, [expert], self.tokenizer,
                                       {**extra, "task_on_mask": 1})]
        return []

    def compositional_inputs(self, split: str) -> list[str]:
        """Held-out inputs (``val`` or ``test``) that need several composition experts at once."""
        _check_split(split)
        self.setup()
        return list(self.compositional[split])

    def compositional_dataset(self, split: str) -> datasets.Dataset:
        """The compositional inputs tokenized with targets = all composition experts' rules and one mask
        per composition expert (``k = len(composition_experts)``)."""
        _check_split(split)
        self.setup()
        if split not in self._compositional_datasets:
            self._compositional_datasets[split] = self.build_dataset(
                self.compositional[split], self.composition_experts, self.composition_experts, self.tokenizer
            )
        return self._compositional_datasets[split]

    def compositional_dataloader(self, split: str) -> DataLoader:
        """Clean, ordered batches of :meth:`compositional_dataset`."""
        return self._loader(self.compositional_dataset(split), train=False)

    def expert_eval_inputs(self, i: int, split: str) -> list[str]:
        """Held-out inputs for judging expert ``i`` alone (its ``val``/``test`` task inputs; a fraction
        ``source_prob`` is planted with its sources)."""
        _check_split(split)
        if not 0 <= i < len(self.experts):
            raise ValueError(f"expert index {i} out of range for {len(self.experts)} experts {self.expert_names}")
        self.setup()
        return list(self.expert_inputs[split][i])
