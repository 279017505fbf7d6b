"""Every script and benchmark builds, for a config, the task and the experts' settings that `train.py` builds
(`lightning_modules.pipeline.build`): the same task settings, experts, seed and regularizer data, and an
`ExpertLM` with the same settings, weights and feature ownership."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data.tasks import settings_node
from lightning_modules.pipeline.build import expert_settings
from lightning_modules.pipeline.config import ConfigError, load_config
from lightning_modules.pipeline.feature_head import merge_factored_head
from lightning_modules.pipeline.models import build_causal_lm
from lightning_modules.pipeline.stages import expert_module, plan_run

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
CONFIGS = {"default": [], "features": ["configs/experiment/features.yaml"],
           "intervals": ["configs/experiment/intervals.yaml"]}


def _script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _what_a_task_is(task, sizes: bool = True) -> dict:
    """Everything a task is built from (split sizes left out with `sizes=False`)."""
    node = settings_node(task)
    if not sizes:
        node = {k: v for k, v in node.items() if k not in ("n_train", "n_test")}
    return {"settings": node, "experts": [(e.name, dict(e.spec), e.weight, tuple(e.data)) for e in task.experts],
            "trained": task.trained, "reg_data": task.reg_data, "seed": task.seed, "overlap": task.allow_overlap,
            "vocab": task.tokenizer.get_vocab()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pipeline(request, tmp_path_factory):
    """What `train.py` builds for the config: its plan (the task) and its experts' module."""
    files = [str(ROOT / f) for f in CONFIGS[request.param]]
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = load_config(files, [f"output_dir={tmp / 'run'}"], base=DEFAULT)
    plan = plan_run(cfg)
    torch.manual_seed(0)
    background = build_causal_lm(cfg.model, plan.tokenizer, plan.task.feature_map)
    merge_factored_head(background)
    background.save_pretrained(tmp / "background")
    saved = tmp / "saved"  # the run folder's config.yaml, as the pipeline writes it
    saved.mkdir()
    (saved / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return request.param, files, cfg, plan, expert_module(cfg, plan, tmp / "background"), saved


def test_train_step_benchmark_builds_the_runs_task_data_and_module(pipeline):
    name, files, cfg, plan, module, _ = pipeline
    bench = _script("benchmarks/train_step.py")
    args = argparse.Namespace(config=[Path(f) for f in files], override=[], batches=1)
    bench_cfg, dm, task, batches = bench.build(args)
    # the benchmark draws only the rows it times (fewer train and test rows), everything else as the run
    assert _what_a_task_is(task, sizes=False) == _what_a_task_is(plan.task, sizes=False)
    assert len(batches) == 1 and dm.batch_size == cfg.data.batch_size * len(plan.trained)
    timed = bench.make_module(bench_cfg, task, cfg.expert.mode, cfg.expert.reg_weight, None)
    assert timed.settings == dataclasses.replace(module.settings, log_every_n_steps=10**9)  # it never logs
    assert timed.settings == dataclasses.replace(expert_settings(cfg), log_every_n_steps=10**9)
    assert (timed.names, timed.weights, timed.frozen_names) == (module.names, module.weights, module.frozen_names)
    assert (timed.feature_map is None) == (module.feature_map is None) == (name != "features")
    if name == "features":
        assert module.settings.regularizer == "features" and torch.equal(timed.owned, module.owned)


def test_background_cache_benchmark_rebuilds_the_runs_task(pipeline):
    _, _, cfg, plan, _, saved = pipeline
    bench_cfg, task = _script("benchmarks/background_cache_error.py").run_task(saved)
    assert _what_a_task_is(task) == _what_a_task_is(plan.task)
    assert expert_settings(bench_cfg) == expert_settings(cfg)


def test_margin_decomposition_rebuilds_the_runs_task(pipeline):
    name, _, cfg, plan, _, saved = pipeline
    script = _script("scripts/margin_decomposition.py")
    if name != "default":  # the letter task's generative format only
        with pytest.raises(SystemExit, match="only the letter task's generative format"):
            script.config_task(saved)
        return
    _, task = script.config_task(saved)
    assert _what_a_task_is(task) == _what_a_task_is(plan.task)
    assert list(task.compositional_dataset("test")["x"]) == list(plan.task.compositional_dataset("test")["x"])


def test_combine_rebuilds_the_runs_compositional_test_set(pipeline, tmp_path):
    """`compose.combine` rebuilds the task from an export's manifest: the same settings, experts and test rows."""
    from peft import LoraConfig, get_peft_model

    from compose.export import export_composition
    from compose.frontends.combine import check_exports

    name, _, cfg, plan, module, _ = pipeline
    if name != "default":
        pytest.skip("one export is enough to show the rebuild")
    model = get_peft_model(build_causal_lm(cfg.model, plan.tokenizer), LoraConfig(r=2, target_modules=["q_proj"]),
                           adapter_name=plan.trained[0])
    for expert in plan.trained[1:]:
        model.add_adapter(expert, LoraConfig(r=2, target_modules=["q_proj"]))
    export_composition(tmp_path / "export", tokenizer=plan.tokenizer, peft_model=model, adapter_names=plan.trained,
                       specs=plan.specs, weights=plan.weights,
                       extra={"task_settings": settings_node(plan.task), "seed": cfg.seed})
    task = check_exports([tmp_path / "export"]).task
    ours = _what_a_task_is(plan.task)
    assert _what_a_task_is(task) == ours | {"trained": [], "experts": [e[:3] + ((),) for e in ours["experts"]]}
    assert list(task.compositional_dataset("test")["x"]) == list(plan.task.compositional_dataset("test")["x"])


def test_config_errors_name_the_keys_of_settings_that_do_not_go_together():
    """`ExpertSettings` holds the rules; the config words them with its own keys."""
    with pytest.raises(ConfigError, match=r"^expert\.position_jump cannot be used with expert\.background_cache"):
        load_config(overrides=["expert.position_jump=2", "expert.background_cache={top_k: 4}"], base=DEFAULT)
    with pytest.raises(ValueError, match=r"^position_jump cannot be used with background_top_k"):
        dataclasses.replace(expert_settings(load_config(base=DEFAULT)), position_jump=2, background_top_k=4)
    # the features regularizer reads the background's full logits, which the cache does not hold
    with pytest.raises(ConfigError, match=r"^expert\.background_cache cannot be used with expert\.regularizer="
                                          r"features: .*; set expert\.background_cache=null$"):
        load_config([str(ROOT / "configs/experiment/features.yaml")], ["expert.background_cache={top_k: 4}"],
                    base=DEFAULT)


def test_expert_defaults_are_the_schemas():
    """The schema's expert keys and `ExpertSettings` agree: building from the bare schema gives its defaults."""
    from lightning_modules.expert import ExpertSettings

    cfg = load_config()  # no default.yaml: the schema alone
    assert expert_settings(cfg) == ExpertSettings(target_modules=expert_settings(cfg).target_modules)
