"""Everything about a composed model: the operator, the composed LM, metrics, merges, exports."""

from compose.composed_lm import ComposedLM
from compose.export import export_composition, load_manifest
from compose.operator import compose_logprobs

__all__ = ["ComposedLM", "compose_logprobs", "export_composition", "load_manifest"]
