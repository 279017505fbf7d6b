"""The stages' Lightning loggers (`trainer.logger`).

Every stage writes `logs/<stage>/metrics.csv` (`resume.ResumableCSVLogger`): a resumed stage continues it, and the
report's curves read it. `trainer.logger` adds one of Lightning's own loggers beside it:

* `csv`: nothing more;
* `tensorboard`: `logs/<stage>/tb/` (`TensorBoardLogger`, through tensorboard or tensorboardX; `tensorboard
  --logdir <run>/logs`);
* `wandb`: `WandbLogger`, project `<experiment>`, run `<run folder>-<stage>`, files under `logs/wandb/`; offline
  (nothing leaves the machine; `wandb sync` uploads later) unless `WANDB_MODE=online` is set;
* `mlflow`: `MLFlowLogger`, experiment `<experiment>`, run `<run folder>-<stage>`, in `$MLFLOW_TRACKING_URI` or
  else a local store under `logs/mlruns/` (`mlflow ui --backend-store-uri <run>/logs/mlruns`).

Their packages are optional: `check_logger` names the one to install, before anything is written.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from lightning_modules.pipeline.config import LOGGERS, ConfigError
from lightning_modules.pipeline.resume import ResumableCSVLogger


def check_logger(name: str) -> None:
    """The package `trainer.logger=name` needs is installed (TensorBoard's writer may also be tensorboardX's).

    Raises:
        ConfigError: one line naming the key and the package to install.
    """
    package = LOGGERS.get(name)
    found = package is None or importlib.util.find_spec(package) is not None
    if package == "tensorboard":
        found = found or importlib.util.find_spec("tensorboardX") is not None
    if not found:
        lighter = " or the lighter tensorboardX" if package == "tensorboard" else ""
        raise ConfigError(f"trainer.logger={name} needs the {package} package, which is not installed: "
                          f"pip install -e '.[{name}]' (the project's extra; or pip install {package}{lighter}; "
                          "or trainer.logger=csv)")


def stage_loggers(cfg: DictConfig, out: Path, stage: str) -> list[Logger]:
    """The CSV logger of `logs/<stage>/metrics.csv`, and the one `trainer.logger` names (see the module's text)."""
    loggers: list[Logger] = [ResumableCSVLogger(out / "logs", name=stage, version="")]
    name, run_name = cfg.trainer.logger, f"{out.name}-{stage}"
    check_logger(name)
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(out / "logs", name=stage, version="tb"))
    elif name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        (out / "logs").mkdir(parents=True, exist_ok=True)
        loggers.append(WandbLogger(name=run_name, project=cfg.experiment, save_dir=str(out / "logs"),
                                   offline=os.environ.get("WANDB_MODE") != "online"))
    elif name == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        loggers.append(MLFlowLogger(experiment_name=cfg.experiment, run_name=run_name,
                                    tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
                                    save_dir=str(out / "logs" / "mlruns")))
    return loggers
