"""What a user's own script sees: loading an export prints nothing (`compose.quiet`), other warnings stay; a short
stage's logging interval follows its length; `trainer.threads` sets torch's threads for the run only."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from tiny_models import char_tokenizer, tiny_peft

from compose import ComposedLM, export_composition
from compose.quiet import quiet_loading


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("quiet") / "export"
    with quiet_loading():
        export_composition(path, tokenizer=char_tokenizer(), peft_model=tiny_peft(names=("a2b", "c2d")),
                           adapter_names=["a2b", "c2d"], specs={}, weights={"a2b": 1.0, "c2d": 1.0})
    return path


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_from_manifest_prints_and_warns_nothing(export, capfd, backend):
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        composed = ComposedLM.from_manifest(export, backend=backend)
    out, err = capfd.readouterr()
    assert composed.names == ["a2b", "c2d"]
    assert (out, err) == ("", ""), (out, err)
    assert [str(w.message) for w in caught] == []


def test_quiet_loading_keeps_other_warnings_and_restores_the_progress_bars():
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_loading():
            assert not hf_logging.is_progress_bar_enabled()
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed", FutureWarning, stacklevel=1)
            warnings.warn("a real problem", UserWarning, stacklevel=1)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real problem",
                                                "`is_gradient_checkpointing` is deprecated and will be removed"]
    assert hf_logging.is_progress_bar_enabled()


def test_the_logging_interval_follows_a_short_stage_unless_set():
    from pathlib import Path

    from lightning_modules.pipeline.build import build_datamodule, build_task
    from lightning_modules.pipeline.config import load_config
    from lightning_modules.pipeline.stages import logging_interval

    root = Path(__file__).resolve().parents[1]
    cfg = load_config([str(root / "configs/debug/fast.yaml")], ["trainer.log_every_n_steps=null", "task.n_train=64"],
                      base=root / "configs/default.yaml")
    task = build_task(cfg)
    dm = build_datamodule(cfg, task, "experts")  # 64 rows per expert, 2 x 32 rows a step: 2 batches an epoch
    assert len(dm.dataset("train")) == 128 and dm.batch_size == 64
    assert logging_interval(cfg, dm, max_steps=100) == 2
    assert logging_interval(cfg, build_datamodule(cfg, task, "background"), max_steps=100) == 2
    cfg.task.n_train = 10_000
    assert logging_interval(cfg, build_datamodule(cfg, build_task(cfg), "experts"), max_steps=3) == 3
    assert logging_interval(cfg, build_datamodule(cfg, build_task(cfg), "experts"), max_steps=1000) == 25
    cfg.trainer.log_every_n_steps = 50  # set: kept
    assert logging_interval(cfg, dm, max_steps=2) == 50


def test_threads_hold_for_the_block_only(monkeypatch):
    from lightning_modules.pipeline.stages import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    with cpu_threads(None) as n:
        assert n == before and "OMP_NUM_THREADS" not in os.environ
    with cpu_threads(1) as n:
        assert n == 1 == torch.get_num_threads() and os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
