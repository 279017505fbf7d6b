"""Tokenizer, synthetic tasks and LightningDataModules.

Everything here but ``data.datamodules`` is free of Lightning; the datamodule names below are loaded
lazily on first access, so ``import data`` never imports Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from data.letters import (
    IGNORE_INDEX,
    LettersCollator,
    RuleSet,
    apply_rules,
    build_letters_dataset,
    combined_rules,
    compositional_inputs,
    decode_outputs,
    expert_inputs,
    prompt_batch,
    sample_strings,
    validate_rule_sets,
)
from data.tokenizer import SPECIAL_TOKENS, build_char_tokenizer, letter_ids, validate_alphabet

if TYPE_CHECKING:
    from data.datamodules import BackgroundDataModule, ExpertDataModule, LettersDataConfig

_LAZY = {"BackgroundDataModule", "ExpertDataModule", "LettersDataConfig", "REG_DATA_CHOICES"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from data import datamodules

        return getattr(datamodules, name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "BackgroundDataModule",
    "ExpertDataModule",
    "LettersCollator",
    "LettersDataConfig",
    "RuleSet",
    "apply_rules",
    "build_char_tokenizer",
    "build_letters_dataset",
    "combined_rules",
    "compositional_inputs",
    "decode_outputs",
    "expert_inputs",
    "letter_ids",
    "prompt_batch",
    "sample_strings",
    "validate_alphabet",
    "validate_rule_sets",
]
