"""What makes a killed run resumable with `ckpt_path=last` into the same result as an uninterrupted one.

* `check_resume`: a resumed run may not change what it already trained: its config is compared with the
  run's `config.yaml` before anything is written, and differing keys that matter are refused by name.
* `seed_stage`: each stage seeds the global RNG from (seed, stage name), so skipping a finished stage on
  resume leaves the next one's draws (model and LoRA initialisation) as they were.
* `AtomicCheckpointIO`: checkpoints are written to a temporary sibling and renamed into place, so a kill
  never leaves a truncated `.ckpt` (Lightning's own save goes through a temporary file in `/tmp`, which is
  copied, not renamed, when `/tmp` is another filesystem).
* `ResumableCSVLogger`: `logs/<stage>/metrics.csv` keeps the rows of the interrupted process up to where the
  resumed one starts logging again, and is rewritten whole through a temporary file (Lightning's deletes the
  file when a resumed stage opens it, and rewrites it in place when a new column appears).
* `stop_on_signals`, `SaveOnStop`, `Interrupted`: SIGTERM (what a scheduler or `kill` sends) and SIGINT (Ctrl-C)
  stop the run where it can resume: a training stage at the end of its current step (Lightning's own SIGTERM
  handling; SIGINT is handed to it) with `last.ckpt` saved there, anything else at once (every write is atomic);
  the process then exits with 128 + the signal's number. A second signal stops at once.
* `PausePoints`: the test hook `compose.common.pause_point` after every training step.

The training data order is resumable on its own (`data.sampler`); interrupted atomic saves leave only
`.<name>.tmp-<id>` / `.<name>.old-<id>` entries, which `compose.common.remove_stale_temporaries` removes.
"""

from __future__ import annotations

import csv
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf

from compose.atomic import PAUSE_ENV, atomic_file, pause_point
from data.splits import derive_seed
from lightning_modules.pipeline.config import ConfigError

# Keys a resumed run may change: they shape no trained weight (where the run writes, how it reports, what runs
# after the experts, validation's cadence and size, evaluation batching).
FREE_ON_RESUME = (
    "output_dir", "ckpt_path", "report", "ablations", "ablation_ks", "baselines", "data.num_workers",
    "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.val_check_interval",
    "trainer.limit_val_batches", "trainer.num_sanity_val_steps", "trainer.threads",
    "composition.eval_batch_size", "composition.val_limit", "composition.active_threshold", "composition.lm_eval",
    "trainer.logger",
)
# Keys only the expert stage reads: free until that stage has a checkpoint or an export.
EXPERT_STAGE = ("expert", "composition.compose_with")
# Every other key (seed, task, data.batch_size, model, background, experts, the trainer's numerics) shapes the
# background or the data of every stage: never free on resume.


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a config's leaves, list items by index (`experts.0.weight`)."""
    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=True)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None or not node:
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}{key}."))
    return out


_UNSET = object()


def _same(a: Any, b: Any) -> bool:
    """Equal, an unset key counting as its schema default when that is empty (null, [], {})."""
    a, b = (None if x is _UNSET or x in ([], {}) else x for x in (a, b))
    return a == b


def _short(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def expert_stage_started(out: Path) -> bool:
    return any((out / "checkpoints" / "experts").glob("*.ckpt")) or (out / "export").exists()


def check_resume(cfg: DictConfig, out: Path) -> None:
    """Refuse (one `ConfigError` line naming the keys, nothing written) a resume whose config changes what
    `out` already trained: any key but `FREE_ON_RESUME`, and the `EXPERT_STAGE` keys too once the expert
    stage has a checkpoint or an export. A run folder without `config.yaml` has trained nothing yet."""
    saved_path = out / "config.yaml"
    if cfg.ckpt_path != "last" or not saved_path.is_file():
        return
    try:
        saved = _flat(OmegaConf.load(saved_path))
    except Exception as e:
        raise ConfigError(f"ckpt_path=last: cannot read {saved_path}: {str(e).splitlines()[0]}") from None
    new = _flat(cfg)
    changed = [k for k in sorted(saved.keys() | new.keys()) if not _same(saved.get(k, _UNSET), new.get(k, _UNSET))]
    experts_started = expert_stage_started(out)
    refused = [k for k in changed if not _matches(k, FREE_ON_RESUME)
               and (experts_started or not _matches(k, EXPERT_STAGE))]
    if refused:
        said = ", ".join(f"{k} ({_short(saved.get(k))} -> {_short(new.get(k))})" for k in refused)
        what = "the background and the experts" if experts_started else "the background and the data"
        raise ConfigError(f"ckpt_path=last: {saved_path} differs in {said}; these change what this run already "
                          f"trained ({what}): resume with the saved values, or start a new output_dir")


def seed_stage(seed: int, stage: str) -> None:
    """Seed the global RNGs (torch, numpy, random) for `stage` from the run's seed and the stage's name."""
    pl.seed_everything(derive_seed(seed, "stage", stage) % 2**32, workers=True, verbose=False)


def last_step(checkpoint: Path) -> int | None:
    """The global step of a Lightning checkpoint (read without loading its tensors), or None if there is none."""
    if not checkpoint.is_file():
        return None
    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    return int(state.get("global_step", 0))


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` to a temporary sibling of the checkpoint, then `os.replace` (`compose.common.atomic_file`)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            torch.save(checkpoint, tmp)


class _KeepingWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, but it keeps an existing `metrics.csv` and writes files whole.

    The rows already in the file are kept up to the first step this process logs: rows from that step on were
    logged by the interrupted process after its last checkpoint and are logged again now.
    """

    def __init__(self, log_dir: str) -> None:
        # Not ExperimentWriter.__init__: it deletes an existing metrics.csv.
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []
        self.hparams: dict[str, Any] = {}
        os.makedirs(log_dir, exist_ok=True)
        self._rows: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                reader = csv.DictReader(f)
                self._rows = [row for row in reader if row.get("step") not in (None, "")]
                self.metrics_keys = list(reader.fieldnames or [])
        self._trimmed = not self._rows

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        path = Path(self.log_dir) / self.NAME_HPARAMS_FILE
        with atomic_file(path) as tmp:
            save_hparams_to_yaml(tmp, self.hparams)

    def save(self) -> None:
        if not self.metrics:
            return
        if not self._trimmed:
            first = min(int(m["step"]) for m in self.metrics)
            self._rows = [row for row in self._rows if int(float(row["step"])) < first]
            self._trimmed = True
        self._rows += self.metrics
        self.metrics = []
        keys = set(self.metrics_keys).union(*self._rows)
        self.metrics_keys = sorted(keys)
        with atomic_file(self.metrics_file_path) as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys, restval="")
            writer.writeheader()
            writer.writerows(self._rows)


class ResumableCSVLogger(CSVLogger):
    """`CSVLogger` writing through `_KeepingWriter` (a resumed stage continues its `metrics.csv`)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _KeepingWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return self._experiment


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(SystemExit):
    """SIGTERM or SIGINT stopped the run; uncaught, the process exits with 128 + the signal's number.

    `output_dir`: the run folder to resume with `ckpt_path=last` (None: stopped before the run wrote anything)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.output_dir: Path | None = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class _Stop:
    """The handler `stop_on_signals` installs for SIGTERM and SIGINT.

    Outside a fit it raises `Interrupted`. During a fit Lightning's SignalConnector holds SIGTERM (calling this
    handler after its own): the first signal only sets Lightning's flag, which stops the fit after the current
    step (`SaveOnStop` saves there), and `check_stop` raises after the fit; SIGINT is handed to Lightning's
    handler for that. A second signal raises at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._forwarding = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self._forwarding:
            return
        first = self.received is None
        if first:
            self.received = signum
        current = signal.getsignal(signal.SIGTERM)
        if first and current != self and callable(current):  # in a fit: Lightning's handler wraps this one
            if signum != signal.SIGTERM:
                self._forwarding = True
                try:
                    current(signum, frame)
                finally:
                    self._forwarding = False
            return
        raise Interrupted(self.received)


_ACTIVE: list[_Stop] = []


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT stop the block resumably (`Interrupted`, see `_Stop`); the previous handlers are
    restored after it. Nested blocks share the outer one's; off the main thread (where Python delivers signals)
    it changes nothing."""
    if _ACTIVE or threading.current_thread() is not threading.main_thread():
        yield
        return
    stop = _Stop()
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    _ACTIVE.append(stop)
    try:
        yield
    finally:
        _ACTIVE.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)


def check_stop() -> None:
    """Raise `Interrupted` if a signal arrived during a fit that ended anyway (it came after the last step)."""
    if _ACTIVE and _ACTIVE[0].received is not None:
        raise Interrupted(_ACTIVE[0].received)


class SaveOnStop(pl.Callback):
    """Saves the stage's `last.ckpt` where Lightning stops a fit after SIGTERM (`SIGTERMException`, raised after
    the current step and its validation), so a resume continues from the step reached rather than from the
    last validation. Stopped inside a validation, the checkpoint of the previous one is kept: a validation
    restarted half-way would log other values than a whole one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.training and not trainer.sanity_checking:
            for callback in trainer.checkpoint_callbacks:  # its `last.ckpt` is this one: no `last-v1.ckpt` after it
                if Path(callback.dirpath) == self.path.parent:
                    callback.last_model_path = str(self.path)
            trainer.save_checkpoint(self.path, weights_only=False)


class PausePoints(pl.Callback):
    """Pause points of a training stage (tests only: added when `$COMPOSABLE_EXPERTS_PAUSE_AT` is set):
    `<run folder>/<stage> step <n>` after training step n, before its checkpoint is written, and
    `<run folder>/<stage> validation <n>` when the validation after step n starts (its checkpoint written)."""

    def __init__(self, out: Path, stage: str) -> None:
        self.prefix = f"{Path(out).name}/{stage}"

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        name = f"{self.prefix} step {trainer.global_step}"
        if _ACTIVE and os.environ.get(PAUSE_ENV) == name:
            # Waits for a signal rather than forever: SIGKILL ends the process here; SIGTERM or SIGINT, caught by
            # `stop_on_signals`, let the step end where Lightning stops the fit.
            print(f"[pause] {name}", flush=True)
            while _ACTIVE[0].received is None:
                time.sleep(0.05)
            return
        pause_point(name)

    def on_validation_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if not trainer.sanity_checking:
            pause_point(f"{self.prefix} validation {trainer.global_step}")
