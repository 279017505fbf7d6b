"""What a run prints, in one place: stage lines, one progress bar per training stage, and no library noise.

A default run prints one line per stage (`[background] ...`, `[experts] ...`, `[composition] ...`), Lightning's
progress bar counting the stage's optimizer steps, the summary table and the report path. `quiet()` removes
what libraries print on every stage although nothing is wrong, each by its exact message:

* Lightning's info lines: "GPU available / TPU available", the litlogger tip, "`Trainer(...=1.0)` was configured
  so ...", "`Trainer.fit` stopped: `max_steps=N` reached." (the stage line already says how many steps), and under
  DDP each rank's "Initializing distributed: ..." and the "distributed_backend=..." banner; "Received SIGTERM: N"
  (train.py says in one line how to resume a stopped run).
* "Found N module(s) in eval mode at the start of training": the experts' frozen background is kept in eval
  mode on purpose (no dropout in the reference distribution).
* "The '..._dataloader' does not have many workers": rows are pre-tokenized in memory and collated cheaply.
* "Checkpoint directory ... exists and is not empty": said when a stage resumes (`ckpt_path=last`), which
  continues in its own checkpoint folder on purpose (a new run's folder is always empty).
* FutureWarnings of calls we cannot change: torch's `LeafSpec` (used by Lightning's pytree helper).
* What loading and saving models prints (`compose.quiet`: transformers' progress bars, the FutureWarning of
  peft's `get_peft_model`), for the whole run.

Everything else (warnings that point at a real problem, "Restoring states from the checkpoint path", errors)
stays visible. `quiet()` is idempotent; `train.py` and `stages.run` call it.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from compose.quiet import ignore_loading_noise

# Lightning info lines (logged through its rank-zero loggers), matched at the start of the message.
NOISE_LOG_MESSAGES: tuple[str, ...] = (
    r"GPU available: ",
    r"TPU available: ",
    r"💡 Tip: ",
    r"`Trainer\(\w+=1(\.0)?\)` was configured so ",
    r"`Trainer\.fit` stopped: `max_steps=\d+` reached",
    r"(\[rank: \d+\] )?Received SIGTERM: ",
    r"Initializing distributed: GLOBAL_RANK: ",
    r"-+\ndistributed_backend=",
)
# (message regex, category) of warnings that point at no problem of the run.
NOISE_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"Found \d+ module\(s\) in eval mode at the start of training", UserWarning),
    (r"The '\w+' does not have many workers", UserWarning),
    (r"Checkpoint directory .* exists and is not empty", UserWarning),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
            "lightning.pytorch", "lightning.fabric")


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of `NOISE_LOG_MESSAGES`."""

    pattern = re.compile("|".join(f"(?:{p})" for p in NOISE_LOG_MESSAGES))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


_FILTER = _DropMessages()


def quiet() -> None:
    """Silence the library noise listed in this module's docstring (and nothing else)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.addFilter(_FILTER)  # a no-op when already there
        for handler in logger.handlers:  # records of child loggers reach these without the logger's filters
            handler.addFilter(_FILTER)
    for message, category in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    ignore_loading_noise()


def stage(name: str, message: str) -> None:
    """One stage line on stdout: `[name] message`."""
    print(f"[{name}] {message}", flush=True)


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar counting the optimizer steps of a `max_steps` run (`experts: 40/150`) over the
    whole stage, instead of the batches of each epoch ("Epoch 4/-2")."""

    def __init__(self, stage: str, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=False)
        self.stage = stage

    def on_train_start(self, trainer: Any, *_: Any) -> None:
        self.train_progress_bar = Tqdm(
            desc=self.stage, total=trainer.max_steps if trainer.max_steps > 0 else None,
            initial=trainer.global_step,  # a resumed stage starts where it stopped
            position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
            file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        pass  # one bar for the whole stage: no reset per epoch

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar, n = self.train_progress_bar, trainer.global_step
        if bar is not None and not bar.disable and self._should_update(n, bar.total or 0):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # our loggers have no version
        return items
