"""Task losses and the off-mask regularizers (docs/method.md, the regularizer). No Lightning here."""

from losses.divergences import (
    DIVERGENCES,
    IGNORE_INDEX,
    DivergenceSpec,
    check_divergence_args,
    divergence,
    divergence_spec,
    register_divergence,
)
from losses.regularizer import off_mask_divergence, region_positions, task_nll

__all__ = [
    "DIVERGENCES",
    "IGNORE_INDEX",
    "DivergenceSpec",
    "check_divergence_args",
    "divergence",
    "divergence_spec",
    "off_mask_divergence",
    "region_positions",
    "register_divergence",
    "task_nll",
]
