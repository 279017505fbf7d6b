"""Library noise around loading and saving models, silenced by exact message (one home for these filters).

`quiet_loading()` wraps the places the project loads or saves models (`compose.export.load_export`,
`ComposedLM.from_manifest`, `compose.export.export_composition`, the front ends' model folders);
`ignore_loading_noise()` applies the same filters for a whole process (the training pipeline's console).
What it removes, each by its exact message, because it says nothing about the user's models:

* transformers' "Loading weights" / "Writing model shards" progress bars, shown for every small load and save;
* transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised inside peft's
  `get_peft_model` / `PeftModel.from_pretrained`, which we cannot change.

Every other warning and log line stays visible.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# (message regex, category) of warnings raised inside library calls that load or wrap models.
LOADING_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
)


def _filter_warnings() -> None:
    for message, category in LOADING_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def ignore_loading_noise() -> None:
    """For the rest of the process: no `LOADING_WARNINGS`, no transformers progress bars."""
    from transformers.utils import logging as hf_logging

    _filter_warnings()
    hf_logging.disable_progress_bar()


@contextmanager
def quiet_loading() -> Iterator[None]:
    """For the block: no `LOADING_WARNINGS`, no transformers progress bars (both restored after it)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            _filter_warnings()
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
