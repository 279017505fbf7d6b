"""Ablations and baselines on the same task: which ingredient of the recipe does what.

An ablation is a named list of config overrides; each runs as its own sub-run of the pipeline (reusing a
background per background setting) for every k in `ablation_ks`, and its composition results are collected
into the parent summary under `ablations.<variant>.k.<k>`. Baselines (parameter-space merges) are evaluated
on the parent run's own experts, in `composition_stage`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from compose.distributed import agree
from data.collate import corruption_range
from data.tasks import Task, TaskError

# variant -> (what it shows, overrides). Variants that drop the regularizer also drop the compositional
# rows (`reg_data=own`): without it they would still carry a task loss on composed prefixes.
ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("the run's own recipe", []),
    "plain": ("λ = 0: plain fine-tuning on the expert's own data", ["expert.reg_weight=0", "expert.reg_data=own"]),
    "no_corruption": ("no prefix corruption for background and experts",
                      ["background.corruption_prob=0", "expert.corruption_prob=0"]),
    "naive": ("the paper's setting: no regularizer, no prefix corruption, plain RoPE positions",
              ["expert.reg_weight=0", "expert.reg_data=own", "background.corruption_prob=0",
               "expert.corruption_prob=0", "model.position_encoding=rope"]),
    "co_trained": ("compositional rows: every other expert's rule applied to half of each expert's rows",
                   ["expert.reg_data=composition"]),
    "rope": ("plain RoPE positions instead of coupled ones (content-aligned copying)", ["model.position_encoding=rope"]),
    "own_prefixes": ("no composed prefixes: task and regularizer on the expert's own rows only",
                     ["expert.reg_data=own"]),
    "kl_t1": ("forward KL at temperature 1, λ = 1 (the tail of p_b barely counts)",
              ["expert.temperature=1", "expert.reg_weight=1"]),
    "own_kl_t1": ("both of the above (the first recipe: own rows, KL at T = 1, λ = 1)",
                  ["expert.reg_data=own", "expert.temperature=1", "expert.reg_weight=1"]),
    "log_ratio": ("tail-aware log-ratio divergence (T = 1, λ = 1)",
                  ["expert.divergence=log_ratio", "expert.temperature=1", "expert.reg_weight=1",
                   "expert.background_cache=null"]),  # the cache cannot serve log_ratio
    "background_data": ("regularizer on background (copy) data instead of composed prefixes",
                        ["expert.reg_data=own+background"]),
    "random_rules": ("modular: prefixes rewritten by random rules drawn per row, no other expert's rules",
                     ["expert.reg_data=random_rules"]),
}

RunFn = Callable[[DictConfig], dict]


def check_ablations(cfg: DictConfig, task: Task) -> None:
    """Unknown variants, or ks the task cannot make experts for, are config errors."""
    from lightning_modules.pipeline.config import ConfigError

    unknown = [a for a in cfg.ablations if a not in ABLATIONS]
    if unknown:
        raise ConfigError(f"ablations: unknown variant(s) {', '.join(unknown)}; known: {', '.join(ABLATIONS)}")
    for k in cfg.ablation_ks:
        try:
            task.standard_experts(int(k))
        except TaskError as e:
            raise ConfigError(f"ablation_ks: {e}") from None


def run_ablations(cfg: DictConfig, out: Path, background_path: Path, task: Task, run: RunFn) -> dict:
    """Run every variant of `cfg.ablations` at every k of `cfg.ablation_ks` (default: the run's own k).

    `run` is the pipeline's own entry point (`stages.run`), passed in so this module does not import it.
    """
    ks = [int(k) for k in cfg.ablation_ks] or [len(cfg.experts)]
    backgrounds: dict[str, Path] = {_background_key(cfg): background_path}
    resuming = cfg.ckpt_path == "last"
    results: dict = {}
    for variant in cfg.ablations:
        description, overrides = ABLATIONS[variant]
        results[variant] = {"description": description, "overrides": overrides, "k": {}}
        for k in ks:
            sub = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
            if k != len(cfg.experts):
                sub = OmegaConf.merge(sub, {"experts": task.standard_experts(k)})
            sub.ablations, sub.ablation_ks, sub.baselines, sub.report = [], [], [], False
            key = _background_key(sub)
            if key not in backgrounds and not cfg.background.path:
                bg_cfg = OmegaConf.merge(sub, {"experts": [], "output_dir": str(out / "ablations" / f"background_{key}")})
                print(f"[ablations] training background {key}")
                backgrounds[key] = Path(_run_or_resume(bg_cfg, resuming, run)["output_dir"]) / "background"
            sub.background.path = str(backgrounds.get(key, background_path))
            sub.output_dir = str(out / "ablations" / f"{variant}_k{k}")
            print(f"[ablations] {variant}, k={k}: {' '.join(overrides) or '(no overrides)'}")
            s = _run_or_resume(sub, resuming, run)
            experts = s.get("experts", {}).values()
            results[variant]["k"][str(k)] = {
                "exact_match": s["composition"]["exact_match"],
                "off_mask_kl": sum(e["off_mask_kl"] for e in experts) / max(len(experts), 1),
                "max_off_mask_log_ratio": max((e["max_off_mask_log_ratio"] for e in experts), default=0.0),
                "experts_min_exact_match": min((e["exact_match"] for e in experts if "exact_match" in e), default=None),
                "failures": s["composition"].get("failures", {}),
                "output_dir": s["output_dir"],
            }
    return results


def _run_or_resume(sub: DictConfig, resuming: bool, run: RunFn) -> dict:
    """A sub-run; when the parent resumes, a finished sub-run is read back and an unfinished one resumed."""
    folder = Path(sub.output_dir)
    # Rank 0's reading of the folder (a distributed run's ranks may be at different points of it).
    finished, started = agree(lambda: (
        json.loads((folder / "summary.json").read_text()) if resuming and (folder / "summary.json").is_file()
        else None, folder.exists()))
    if finished is not None:
        return finished
    sub.ckpt_path = "last" if resuming and started else None
    return run(sub)


def _background_key(cfg: DictConfig) -> str:
    b = cfg.background
    rho = "-".join(f"{r:g}" for r in dict.fromkeys(corruption_range(b.corruption_prob)))  # "0.2", or "0-0.8"
    return f"rho{rho}_steps{b.max_steps}_{cfg.model.position_encoding}"
