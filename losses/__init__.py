"""Task losses and the off-mask regularizers (METHOD.md §4). No Lightning here."""

from losses.divergences import DIVERGENCE_KINDS, IGNORE_INDEX, check_divergence_args, divergence
from losses.regularizer import off_mask_divergence, region_positions, task_nll

__all__ = [
    "DIVERGENCE_KINDS",
    "IGNORE_INDEX",
    "check_divergence_args",
    "divergence",
    "off_mask_divergence",
    "region_positions",
    "task_nll",
]
