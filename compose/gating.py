"""Gated composition: each expert acts only inside its skill interval (``compose.intervals``).

A gate is a callable ``gate(prefix_ids [B, t]) -> bool [B]`` that :meth:`compose.ComposedLM.generate`
calls once per decoding step with the whole prefix (prompt + generated tokens); where it is False the
expert's factor is 1 for the next token. :class:`IntervalGate` answers with a
:class:`~compose.intervals.StoppingTimeDetector` fed only the generated tokens it has not seen yet.
:func:`interval_masks` is the teacher-forced equivalent, for ``ComposedLM.score(..., masks=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from compose.intervals import IntervalSpec, StoppingTimeDetector

Gate = Callable[[Tensor], Tensor]


class IntervalGate:
    """Gate of one expert: open iff its interval is open after the generated tokens ``prefix[:, prompt_len:]``.

    One gate serves one ``generate`` call: each call must extend the prefix seen before (only the new
    columns are read, one :meth:`StoppingTimeDetector.update` per column).
    """

    def __init__(self, spec: IntervalSpec | Mapping[str, Any], tokenizer, prompt_len: int) -> None:
        self.spec = IntervalSpec.from_dict(spec)
        self.tokenizer = tokenizer
        self.prompt_len = int(prompt_len)
        self.detector: StoppingTimeDetector | None = None
        self._seen = self.prompt_len

    def __call__(self, prefix_ids: Tensor) -> Tensor:
        """Bool ``[B]`` (CPU) for the prefix ``[B, t]``, ``t >= prompt_len``."""
        batch, t = prefix_ids.shape
        if self.detector is None:
            self.detector = StoppingTimeDetector(self.spec, self.tokenizer, batch)
        if t < self._seen:
            raise ValueError(
                f"IntervalGate already read {self._seen} columns but got a prefix of {t}; use one gate per generation"
            )
        if t == self._seen + 1:  # the usual step: one new column (one tensor op instead of a slice and a transpose)
            self.detector.update(prefix_ids[:, -1].tolist())
        else:
            for column in prefix_ids[:, self._seen : t].T.tolist():
                self.detector.update(column)
        self._seen = t
        return self.detector.is_open()


def gates_from_specs(specs: Sequence[Mapping[str, Any]], tokenizer, prompt_len: int) -> list[IntervalGate | None]:
    """An :class:`IntervalGate` for each spec with an ``interval``; None (always on) for any other."""
    return [
        IntervalGate(spec["interval"], tokenizer, prompt_len) if spec and spec.get("interval") is not None else None
        for spec in specs
    ]


def interval_masks(
    specs: Sequence[Mapping[str, Any]], tokenizer, input_ids: Tensor, prompt_len: int
) -> Tensor:
    """Teacher-forced gates, bool ``[k, B, T]`` for ``score(input_ids, masks=...)``.

    ``masks[i, :, t]`` is what expert ``i``'s gate answers in ``generate`` for the prefix ``input_ids[:, :t+1]``,
    i.e. whether it acts on the prediction of token ``t+1`` (score's output at ``t``); this is exactly
    running the detectors step by step over the tokens after ``prompt_len``. Positions before
    ``prompt_len - 1`` take the state of an empty generation (closed); experts without an interval are
    True everywhere.
    """
    batch, length = input_ids.shape
    masks = torch.ones(len(specs), batch, length, dtype=torch.bool)
    for i, gate in enumerate(gates_from_specs(specs, tokenizer, prompt_len)):
        if gate is None:
            continue
        masks[i, :, : max(prompt_len - 1, 0)] = False
        for t in range(max(prompt_len - 1, 0), length):
            masks[i, :, t] = gate(input_ids[:, : t + 1])
    return masks.to(input_ids.device)
