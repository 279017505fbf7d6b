"""The letter-replacement task: rules, rows and evaluation."""

from data.tasks.letters.rules import (
    RuleSet,
    apply_rules,
    build_aligned_dataset,
    build_letters_dataset,
    combined_rules,
    compositional_inputs,
    decode_outputs,
    expert_inputs,
    prompt_batch,
    random_rule_outputs,
    sample_strings,
    validate_rule_sets,
)
from data.tasks.letters.task import LettersConfig, LettersTask, aligned_outputs, greedy_outputs

__all__ = [
    "LettersConfig",
    "LettersTask",
    "RuleSet",
    "aligned_outputs",
    "apply_rules",
    "build_aligned_dataset",
    "build_letters_dataset",
    "combined_rules",
    "compositional_inputs",
    "decode_outputs",
    "expert_inputs",
    "greedy_outputs",
    "prompt_batch",
    "random_rule_outputs",
    "sample_strings",
    "validate_rule_sets",
]
