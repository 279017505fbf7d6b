"""lm-eval tasks at validation (`composition.lm_eval`): downstream scores of the live models while the experts train.

`check_lm_eval(cfg)` refuses, in one line naming the key, a run whose tasks lm-eval cannot find (before anything
is written). `LMEvalRunner` turns a `ComposedLM` built from the in-training modules into flat metrics
`{"<task>/<metric>": value}` through `lm_eval.simple_evaluate` and the lm-eval model of `compose.frontends.lm_eval`;
the callback `lightning_modules.callbacks.DownstreamEvaluation` calls it on the background, each trained expert
alone and the composition, and logs `val/lm_eval/<task>/<metric>/<model>`.

In a distributed run every rank calls it in step: the model reports lm-eval's `rank` and `world_size`
(`compose.distributed.rank_and_world`), so lm-eval gives rank `r` its share of the requests and gathers the
per-example scores on rank 0; rank 0's metrics then reach every rank (`compose.distributed.agree`). The
evaluation leaves the training's random state as it found it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from compose import ComposedLM
from compose.distributed import agree, rank_and_world
from lightning_modules.pipeline.config import ConfigError

FEWSHOT_SEED = 1234  # lm-eval's own default for the few-shot sampler: the same examples at every validation


def check_lm_eval(cfg: DictConfig) -> None:
    """lm-eval is installed and knows every task of `composition.lm_eval.tasks` (nothing to check without tasks).

    Raises:
        ConfigError: one line naming the key (the missing package, or the unknown tasks and where they were sought).
    """
    if cfg.composition.lm_eval.tasks:
        LMEvalRunner.from_config(cfg)


class LMEvalRunner:
    """`runner(composed)`: lm-eval's scores of a `ComposedLM` on the configured tasks, `{"<task>/<metric>": value}`.

    A metric under a filter other than lm-eval's `none` is named `<metric>.<filter>`; standard errors and
    anything not a finite number are left out.

    Args:
        tasks: lm-eval task names or glob patterns.
        include_path: a folder of task YAMLs (its tasks are loaded from it alone), or None.
        limit: at most this many examples per task (a fraction in (0, 1): that share); None: all.
        batch_size: requests per forward.
    """

    def __init__(self, tasks: Sequence[str], include_path: str | None = None, limit: float | None = None,
                 batch_size: int = 32) -> None:
        try:
            from compose.frontends.lm_eval import resolve_tasks
        except ImportError:
            raise ConfigError("composition.lm_eval needs lm-eval: pip install 'lm-eval>=0.4.13,<0.5' (the eval "
                              "extra: pip install -e '.[eval]')") from None
        with _quiet():
            try:
                self.tasks, self.manager = resolve_tasks(list(tasks), include_path,
                                                         include_defaults=include_path is None)
            except ValueError as err:
                raise ConfigError(f"composition.lm_eval.tasks: {err}") from None
        self.limit, self.batch_size = limit, batch_size

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LMEvalRunner:
        """The runner of `composition.lm_eval` (one per setting in a process: the check before the run and the
        experts stage share it, so lm-eval indexes its tasks once)."""
        node = cfg.composition.lm_eval
        return _runner(tuple(node.tasks), node.include_path, node.limit, node.batch_size)

    def __call__(self, composed: ComposedLM) -> dict[str, float]:
        from lm_eval import simple_evaluate

        lm = _ranked_lm(composed, self.batch_size)
        with _quiet(), _training_rng_kept(composed.device):
            results = simple_evaluate(model=lm, tasks=self.tasks, task_manager=self.manager, limit=self.limit,
                                      bootstrap_iters=0, log_samples=False, random_seed=None, numpy_random_seed=None,
                                      torch_random_seed=None, fewshot_random_seed=FEWSHOT_SEED)
        return agree(lambda: flat_metrics(results["results"]))


@functools.lru_cache(maxsize=4)
def _runner(tasks: tuple[str, ...], include_path: str | None, limit: float | None, batch_size: int) -> LMEvalRunner:
    return LMEvalRunner(tasks, include_path, limit, batch_size)


def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """`{"<task>/<metric>": value}` from lm-eval's `results["results"]` (`{task: {"acc,none": 0.5, ...}}`)."""
    flat = {}
    for task, entry in results.items():
        for key, value in entry.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filter_name = key.split(",", 1)
            if metric.endswith("_stderr") or not math.isfinite(value):
                continue
            flat[f"{task}/{metric if filter_name == 'none' else f'{metric}.{filter_name}'}"] = float(value)
    return flat


def _ranked_lm(composed: ComposedLM, batch_size: int):
    """lm-eval's `composed` model over `composed`, reporting this process's rank and the world size to lm-eval
    and gathering with torch.distributed, its progress bars off."""
    from compose.frontends.lm_eval import ComposedLMEval

    class RankedLMEval(ComposedLMEval):
        def __init__(self) -> None:
            super().__init__(composed=composed, batch_size=batch_size, device=str(composed.device))
            self._rank, self._world_size = rank_and_world()

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor)
            return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

        def gather_object(self, obj: Any, dst: int = 0) -> list | None:
            parts: list = [None] * self.world_size
            dist.all_gather_object(parts, obj)
            return parts if self.rank == dst else None

        def barrier(self) -> None:
            dist.barrier()

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

    return RankedLMEval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's and datasets' notes and progress bars kept off the run's console (shown if the block fails)."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    levels = [logger.level for logger in loggers]
    buffer, stderr = io.StringIO(), sys.stderr
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    sys.stderr = buffer
    try:
        yield
    except BaseException:
        stderr.write(buffer.getvalue())
        raise
    finally:
        sys.stderr = stderr
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _training_rng_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's random states restored after the block (the training draws on)."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
