"""Everything about a composed model: the operator, the composed LM, metrics, merges, exports.

Names are imported lazily, so ``import compose.metrics`` (or the operator) does not load transformers
and the composed LM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compose.composed_lm import ComposedLM
    from compose.export import Manifest, export_composition, load_manifest
    from compose.operator import compose_logprobs

_HOMES = {
    "ComposedLM": "compose.composed_lm",
    "compose_logprobs": "compose.operator",
    "export_composition": "compose.export",
    "Manifest": "compose.export",
    "load_manifest": "compose.export",
}
__all__ = ["ComposedLM", "Manifest", "compose_logprobs", "export_composition", "load_manifest"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'compose' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
