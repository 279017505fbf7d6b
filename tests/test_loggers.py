"""trainer.logger: the CSV log every stage keeps, the logger chosen beside it, and the missing-package errors."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_modules.pipeline.config import LOGGERS, ConfigError, load_config
from lightning_modules.pipeline.loggers import check_logger, stage_loggers
from lightning_modules.pipeline.resume import ResumableCSVLogger

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "configs" / "debug" / "fast.yaml"


def installed(name: str) -> bool:
    package = LOGGERS[name]
    return package is None or any(importlib.util.find_spec(p) is not None
                                  for p in ([package, "tensorboardX"] if name == "tensorboard" else [package]))


class Logging(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def fit(cfg, out: Path, stage: str = "experts") -> pl.Trainer:
    trainer = pl.Trainer(max_steps=4, logger=stage_loggers(cfg, out, stage), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(Logging())
    return trainer


def test_csv_is_the_default_and_writes_the_stage_metrics(tmp_path):
    cfg = load_config([str(FAST)])
    assert cfg.trainer.logger == "csv"
    trainer = fit(cfg, tmp_path)
    assert [type(logger) for logger in trainer.loggers] == [ResumableCSVLogger]
    with open(tmp_path / "logs" / "experts" / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert steps == [0, 1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["experts"]


def test_unknown_logger_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config([str(FAST)], ["trainer.logger=neptune"])
    message = str(err.value)
    assert message.startswith("trainer.logger='neptune' is not one of csv, tensorboard, wandb, mlflow")
    assert "\n" not in message


@pytest.mark.parametrize("name", [n for n in LOGGERS if not installed(n)] or ["(every logger is installed)"])
def test_missing_package_is_one_line_naming_what_to_install_before_anything_is_written(name, tmp_path):
    if name not in LOGGERS:
        pytest.skip("every logger's package is installed here")
    from lightning_modules.pipeline.stages import plan_run

    with pytest.raises(ConfigError) as err:
        check_logger(name)
    lighter = " or the lighter tensorboardX" if name == "tensorboard" else ""
    assert str(err.value) == (f"trainer.logger={name} needs the {LOGGERS[name]} package, which is not installed: "
                              f"pip install -e '.[{name}]' (the project's extra; or pip install {LOGGERS[name]}"
                              f"{lighter}; or trainer.logger=csv)")
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"trainer.logger={name} needs"):
        plan_run(load_config([str(FAST)], [f"output_dir={out}", f"trainer.logger={name}"]))
    assert not out.exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_chosen_logger_writes_beside_the_csv(name, tmp_path, monkeypatch):
    if not installed(name):
        pytest.skip(f"{LOGGERS[name]} is not installed")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline: nothing leaves the machine
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trainer = fit(load_config([str(FAST)], [f"trainer.logger={name}"]), tmp_path)
    assert isinstance(trainer.loggers[0], ResumableCSVLogger) and len(trainer.loggers) == 2
    assert (tmp_path / "logs" / "experts" / "metrics.csv").is_file()
    where = {"tensorboard": "experts/tb", "wandb": "wandb", "mlflow": "mlruns"}[name]
    assert any(p.is_file() for p in (tmp_path / "logs" / where).rglob("*")), where
