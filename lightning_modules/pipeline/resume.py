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
* `PausePoints`: the test hook `compose.common.pause_point` after every training step.

The training data order is resumable on its own (`data.sampler`); interrupted atomic saves leave only
`.<name>.tmp-<id>` / `.<name>.old-<id>` entries, which `compose.common.remove_stale_temporaries` removes.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, ListConfig, OmegaConf

from compose.atomic import atomic_file, pause_point
from data.splits import derive_seed
from lightning_modules.pipeline.config import ConfigError

# Keys a resumed run may change: they shape no trained weight (where the run writes, how it reports, what runs
# after the experts, validation's cadence and size, evaluation batching).
FREE_ON_RESUME = (
    "output_dir", "ckpt_path", "report", "ablations", "ablation_ks", "baselines", "data.num_workers",
    "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.val_check_interval",
    "trainer.limit_val_batches", "trainer.num_sanity_val_steps",
    "composition.eval_batch_size", "composition.val_limit", "composition.active_threshold",
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


class PausePoints(pl.Callback):
    """Pause points of a training stage (tests only: added when `$COMPOSABLE_EXPERTS_PAUSE_AT` is set):
    `<run folder>/<stage> step <n>` after training step n, before its checkpoint is written, and
    `<run folder>/<stage> validation <n>` when the validation after step n starts (its checkpoint written)."""

    def __init__(self, out: Path, stage: str) -> None:
        self.prefix = f"{Path(out).name}/{stage}"

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        pause_point(f"{self.prefix} step {trainer.global_step}")

    def on_validation_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if not trainer.sanity_checking:
            pause_point(f"{self.prefix} validation {trainer.global_step}")
