"""Everything about a composed model: the operator, the composed LM, metrics, merges, exports."""

from compose.operator import compose_logprobs

__all__ = ["compose_logprobs"]
