"""The pipeline `train.py` runs: background → experts → composition, each a Lightning fit or evaluation.

Everything a run writes lands in its `output_dir`: `config.yaml`, `background/` (HF folder), `tokenizer/`,
`checkpoints/<stage>/`, `logs/<stage>/` (CSV, TensorBoard when installed), `export/` (for composition)
and `summary.json`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from compose import ComposedLM
from compose.export import load_manifest
from compose.merges import max_logprob_gap, merge_adapters, task_arithmetic
from data.datamodules import BackgroundDataModule, ExpertDataModule, LettersDataConfig
from data.letters import LettersCollator, RuleSet, validate_rule_sets
from data.tokenizer import build_char_tokenizer
from lightning_modules.ablations import check_ablations, run_ablations
from lightning_modules.background import BackgroundLM
from lightning_modules.callbacks import CompositionEvaluation, ExportForComposition
from lightning_modules.config import ConfigError
from lightning_modules.evaluation import evaluate_composition, exact_match
from lightning_modules.expert import ExpertLM
from lightning_modules.models import build_causal_lm, count_parameters, load_pretrained
from lightning_modules.report import write_report
from losses import divergence


@dataclass
class Plan:
    """What a run will do, checked in full before anything is written."""

    out: Path
    tokenizer: object
    trained: list[RuleSet]                 # experts trained in this run
    frozen: list[RuleSet]                  # experts from earlier exports (compose_with)
    frozen_adapters: dict[str, str] = field(default_factory=dict)
    frozen_weights: dict[str, float] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)

    @property
    def in_play(self) -> list[RuleSet]:
        return self.trained + self.frozen


def plan_run(cfg: DictConfig) -> Plan:
    """Validate everything the config names (rules, files, exports, tokenizers) without writing anything."""
    resuming = cfg.ckpt_path == "last"
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        if out.exists() and any(out.iterdir()) and not resuming:
            raise ConfigError(f"output_dir {out} exists and is not empty: pass ckpt_path=last to resume it, "
                              "or choose another output_dir")
    else:
        if resuming:
            raise ConfigError("ckpt_path=last needs output_dir= naming the run to resume")
        out = Path("runs") / cfg.experiment / datetime.now().strftime("%Y%m%d-%H%M%S")
    if resuming and not out.exists():
        raise ConfigError(f"ckpt_path=last: output_dir {out} does not exist")

    tokenizer = build_char_tokenizer(cfg.data.alphabet)
    trained = [RuleSet(e.name, dict(e.rules)) for e in cfg.experts]
    frozen, frozen_adapters, frozen_weights = [], {}, {}
    for export in cfg.composition.compose_with:
        try:
            manifest = load_manifest(export)
        except (OSError, ValueError) as e:
            raise ConfigError(f"composition.compose_with: {export}: {e}") from None
        _check_same_vocab(manifest, tokenizer, export)
        _check_same_background(manifest, export, cfg.background.path)
        for expert in manifest["experts"]:
            if expert.get("kind", "lora") != "lora":
                raise ConfigError(f"composition.compose_with: {export}: expert '{expert['name']}' is not a LoRA adapter")
            frozen.append(RuleSet(expert["name"], dict((expert.get("spec") or {}).get("rules", {}))))
            frozen_adapters[expert["name"]] = str(Path(export) / expert["path"])
            frozen_weights[expert["name"]] = float(expert.get("weight", 1.0))
    try:
        overlaps = validate_rule_sets(trained + frozen, cfg.data.alphabet, allow_overlap=cfg.composition.allow_overlap)
    except ValueError as e:
        raise ConfigError(f"experts: {e}") from None
    if cfg.background.path:
        load_pretrained(cfg.background.path, tokenizer)  # fails early on a missing folder or a vocabulary mismatch
    return Plan(out, tokenizer, trained, frozen, frozen_adapters, frozen_weights, overlaps)


def _check_same_vocab(manifest: dict, tokenizer, export: str) -> None:
    from transformers import AutoTokenizer

    tok_dir = Path(export) / manifest.get("tokenizer", "tokenizer")
    try:
        theirs = AutoTokenizer.from_pretrained(tok_dir)
    except Exception as e:
        raise ConfigError(f"composition.compose_with: cannot read tokenizer of {export}: {str(e).splitlines()[0]}") from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"composition.compose_with: the tokenizer of {export} differs from this run's "
                          f"(data.alphabet={tokenizer.name_or_path or 'this run'})")


def _check_same_background(manifest: dict, export: str, background_path: str | None) -> None:
    """Adapters only mean something on the background they were trained on: require that one."""
    entry = manifest["background"]
    theirs = Path(export) / entry["path"] if "path" in entry else Path(export) / entry["ref"]
    if not background_path:
        raise ConfigError(f"composition.compose_with: set background.path to the background the experts of "
                          f"{export} were trained on (e.g. background.path={theirs})")
    if not _same_weights(Path(background_path), theirs):
        raise ConfigError(f"composition.compose_with: the background of {export} ({theirs}) differs from "
                          f"background.path={background_path}")


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    files_a, files_b = sorted(a.glob("*.safetensors")), sorted(b.glob("*.safetensors"))
    if [f.name for f in files_a] != [f.name for f in files_b] or not files_a:
        return False
    for fa, fb in zip(files_a, files_b, strict=True):
        ta, tb = load_file(fa), load_file(fb)
        if ta.keys() != tb.keys() or any(not torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def data_config(cfg: DictConfig, corruption_prob: float, reg_data: str = "own", n_experts: int = 1) -> LettersDataConfig:
    """`data.batch_size` and the split sizes count rows per expert: k experts train on k × batch_size rows."""
    d = cfg.data
    return LettersDataConfig(alphabet=d.alphabet, min_len=d.min_len, max_len=d.max_len, format=d.format,
                             n_train=d.n_train,
                             n_val=d.n_val, n_test=d.n_test, batch_size=d.batch_size * n_experts,
                             corruption_prob=corruption_prob,
                             source_prob=d.source_prob, compositional_min_experts=d.compositional_min_experts,
                             reg_data=reg_data, num_workers=d.num_workers, seed=cfg.seed)


def make_trainer(cfg: DictConfig, out: Path, stage: str, max_steps: int, callbacks: list) -> pl.Trainer:
    t = cfg.trainer
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints" / stage, filename="step{step}", save_last=True,
                                 every_n_train_steps=t.val_check_interval, save_top_k=1, auto_insert_metric_name=False)
    loggers = [CSVLogger(out / "logs", name=stage, version="")]
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(out / "logs", name=stage, version="tb"))
    except ImportError:
        pass
    return pl.Trainer(
        max_steps=max_steps, accelerator=t.accelerator, devices=t.devices, strategy=t.strategy,
        precision=t.precision, val_check_interval=min(t.val_check_interval, max_steps),
        check_val_every_n_epoch=None, log_every_n_steps=t.log_every_n_steps,
        limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.num_sanity_val_steps,
        enable_progress_bar=t.enable_progress_bar, enable_model_summary=False,
        callbacks=[checkpoint, LearningRateMonitor(logging_interval="step"), *callbacks],
        logger=loggers, default_root_dir=out,
    )


def _fit(trainer: pl.Trainer, module, datamodule, cfg: DictConfig, out: Path, stage: str) -> None:
    ckpt = None
    if cfg.ckpt_path == "last":
        last = out / "checkpoints" / stage / "last.ckpt"
        ckpt = str(last) if last.is_file() else None
    elif cfg.ckpt_path:
        ckpt = cfg.ckpt_path
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
    except RuntimeError as e:
        if ckpt and ("size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e)):
            raise ConfigError(f"checkpoint {ckpt} does not match the config ({str(e).splitlines()[0][:200]})") from None
        raise
    # ModelCheckpoint saves every N steps; make `last.ckpt` the state at the end of the stage as well.
    trainer.save_checkpoint(out / "checkpoints" / stage / "last.ckpt")


def background_stage(cfg: DictConfig, plan: Plan) -> Path:
    """Train (or take) the background; return its HF folder."""
    if cfg.background.path:
        return Path(cfg.background.path)
    path = plan.out / "background"
    if (path / "config.json").is_file():  # finished earlier (resumed run)
        return path
    b = cfg.background
    model = build_causal_lm(cfg.model, plan.tokenizer)
    print(f"[background] {count_parameters(model):,} parameters, {b.max_steps} steps, corruption ρ={b.corruption_prob}")
    module = BackgroundLM(model, lr=b.optim.lr, weight_decay=b.optim.weight_decay,
                          warmup_ratio=b.optim.warmup_ratio, max_steps=b.max_steps)
    dm = BackgroundDataModule(plan.tokenizer, data_config(cfg, b.corruption_prob))
    _fit(make_trainer(cfg, plan.out, "background", b.max_steps, []), module, dm, cfg, plan.out, "background")
    _atomic_save(lambda tmp: model.save_pretrained(tmp, safe_serialization=True), path)
    return path


def expert_module(cfg: DictConfig, plan: Plan, background_path: Path) -> ExpertLM:
    e = cfg.expert
    target = e.lora.target_modules
    weights = {s.name: float(s.weight) for s in cfg.experts} | plan.frozen_weights
    return ExpertLM(
        load_pretrained(background_path, plan.tokenizer), [r.name for r in plan.trained], mode=e.mode,
        lora_r=e.lora.r, lora_alpha=e.lora.alpha,
        target_modules=target if isinstance(target, str) else list(target),
        reg_weight=e.reg_weight, divergence=e.divergence, jsd_beta=e.jsd_beta, temperature=e.temperature,
        task_loss_on_mask_only=e.task_loss_on_mask_only, lr=e.optim.lr, weight_decay=e.optim.weight_decay,
        warmup_ratio=e.optim.warmup_ratio, max_steps=e.max_steps, frozen_adapters=plan.frozen_adapters,
        weights=weights, active_threshold=cfg.composition.active_threshold,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
    )


def experts_stage(cfg: DictConfig, plan: Plan, background_path: Path) -> tuple[ExpertLM, ExpertDataModule]:
    """Train every expert of `cfg.experts` at once; composition is evaluated at each validation."""
    e = cfg.expert
    dm = ExpertDataModule(plan.tokenizer, data_config(cfg, e.corruption_prob, e.reg_data, len(plan.trained)), plan.trained,
                          composition_experts=plan.in_play, allow_overlap=cfg.composition.allow_overlap)
    dm.setup("fit")
    module = expert_module(cfg, plan, background_path)
    print(f"[experts] {', '.join(r.name for r in plan.trained)}: {e.mode}, λ={e.reg_weight} ({e.divergence}, T={e.temperature}), "
          f"reg data={e.reg_data}, {e.max_steps} steps, corruption ρ={e.corruption_prob}")
    collate = LettersCollator(plan.tokenizer, cfg.data.alphabet)
    c = cfg.composition
    callbacks = [
        CompositionEvaluation(lambda: dm.compositional_dataset("val"), plan.in_play, collate, plan.tokenizer,
                              batch_size=c.eval_batch_size, limit=c.val_limit, active_threshold=c.active_threshold,
                              format=cfg.data.format),
        ExportForComposition(plan.out / "export", plan.tokenizer,
                             specs={r.name: {"rules": dict(r.rules)} for r in plan.trained},
                             weights={s.name: float(s.weight) for s in cfg.experts}, background_path=background_path,
                             extra={"experiment": cfg.experiment, "seed": cfg.seed}, overwrite=cfg.ckpt_path == "last"),
    ]
    export = plan.out / "export" / "composition.yaml"
    if cfg.ckpt_path == "last" and export.is_file():  # finished earlier: reload the trained adapters
        state = torch.load(plan.out / "checkpoints" / "experts" / "last.ckpt", map_location="cpu", weights_only=True)
        module.load_state_dict(state["state_dict"])
        return module, dm
    _fit(make_trainer(cfg, plan.out, "experts", e.max_steps, callbacks), module, dm, cfg, plan.out, "experts")
    return module, dm


def composition_stage(cfg: DictConfig, plan: Plan, background_path: Path, module: ExpertLM | None,
                      dm: ExpertDataModule | None) -> dict:
    """Final evaluation on the test split: background, each expert alone, and the composition."""
    tok, bs, fmt = plan.tokenizer, cfg.composition.eval_batch_size, cfg.data.format
    summary: dict = {}
    background = load_pretrained(background_path, tok).eval()
    bg_dm = BackgroundDataModule(tok, data_config(cfg, 0.0))
    bg_dm.setup("test")
    summary["background"] = {"exact_match": exact_match(ComposedLM(background, tokenizer=tok), tok,
                                                        bg_dm.copy_eval_inputs("test"), [], bs, format=fmt)}
    if module is None:
        return summary
    module.eval()
    summary["experts"] = {}
    for i, rs in enumerate(plan.trained):
        alone = module.composed_model(tok, names=[rs.name])
        summary["experts"][rs.name] = {"exact_match": exact_match(alone, tok, dm.expert_eval_inputs(i, "test"), [rs], bs,
                                                                  format=fmt)}
    collate = LettersCollator(tok, cfg.data.alphabet)
    results = evaluate_composition(module.composed_model(tok), tok, dm.compositional_dataset("test"), plan.in_play,
                                   collate, bs, cfg.composition.active_threshold, format=fmt)
    for rs in plan.in_play:
        entry = summary["experts"].setdefault(rs.name, {"trained_in": "compose_with"})
        for key in ("off_mask_kl", "on_mask_kl", "max_off_mask_log_ratio", "skill_accuracy"):
            entry[key] = results.pop(f"{rs.name}/{key}")
    summary["composition"] = {
        "exact_match": results.pop("exact_match"),
        "k": len(plan.in_play),
        "n_test": len(dm.compositional_dataset("test")),
        "failures": {k.split("/", 1)[1]: results.pop(k) for k in list(results) if k.startswith("failures/")},
        "overlap": {k.split("/", 1)[1]: results.pop(k) for k in list(results) if k.startswith("overlap/")},
        **results,
    }
    if plan.overlaps:
        summary["composition"]["overlapping_sources"] = plan.overlaps
    test_set = dm.compositional_dataset("test")
    write_divergence_map(module.composed_model(tok), test_set.select(range(min(4, len(test_set)))), collate,
                         plan.out / "divergence_map.json")
    if cfg.baselines:
        summary["baselines"] = merge_baselines(cfg, plan, module, test_set, collate)
    return summary


def merge_baselines(cfg: DictConfig, plan: Plan, module: ExpertLM, test_set, collate) -> dict:
    """The same experts merged in parameter space, scored on the compositional test set.

    Also records how far task arithmetic's log-probs are from the composition's (METHOD.md §2: equal in
    the linear setting, apart elsewhere).
    """
    tok, bs, names = plan.tokenizer, cfg.composition.eval_batch_size, [r.name for r in plan.in_play]
    composed = module.composed_model(tok)
    batch = collate([test_set[i] for i in range(min(len(test_set), bs))])
    valid = batch["targets"] != -100
    composed_lp = composed.score(batch["input_ids"], batch["attention_mask"])
    results = {}
    for method in cfg.baselines:
        if module.hparams.mode == "lora":
            merged_name = merge_adapters(module.peft_model, names, method, weights=composed.weights, seed=cfg.seed)
            merged = ComposedLM.from_peft(module.peft_model, [merged_name], tokenizer=tok)
        elif method == "task_arithmetic":
            merged = ComposedLM(task_arithmetic(module.background, [module.experts[n] for n in names],
                                                composed.weights), tokenizer=tok)
        else:
            continue  # TIES and DARE are implemented for LoRA adapters (peft) only
        merged_lp = merged.score(batch["input_ids"], batch["attention_mask"])
        results[method] = {
            "exact_match": exact_match(merged, tok, list(test_set["x"]), plan.in_play, bs, format=cfg.data.format),
            "max_logprob_gap_vs_composed": max_logprob_gap(merged_lp, composed_lp, valid),
        }
        if module.hparams.mode == "lora":
            module.peft_model.delete_adapter(merged_name)
    return results


@torch.no_grad()
def write_divergence_map(composed: ComposedLM, rows, collate, path: Path) -> None:
    """Per output position, KL(p_b ‖ p_i) of each expert on a few test inputs, with its mask (for the heatmap)."""
    batch = collate([rows[i] for i in range(len(rows))])
    lp_b, lp_e = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
    kl = divergence(lp_e, lp_b.expand_as(lp_e), "forward_kl")  # [k, B, T]
    out = {"experts": list(composed.names), "inputs": list(rows["x"]), "outputs": list(rows["y"]),
           "divergence": [], "masks": []}
    for i in range(len(composed.names)):
        out["divergence"].append([kl[i, b][batch["targets"][b] != -100].tolist() for b in range(len(rows))])
        out["masks"].append([batch["masks"][b, i][batch["targets"][b] != -100].int().tolist() for b in range(len(rows))])
    _atomic_write_text(path, json.dumps(out))


def run(cfg: DictConfig, command: str | None = None) -> dict:
    """Run the whole pipeline for `cfg`; returns the summary (also written to `summary.json`)."""
    t0 = time.time()
    check_ablations(cfg)
    plan = plan_run(cfg)
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")
    if not (plan.out / "tokenizer").is_dir():
        _atomic_save(plan.tokenizer.save_pretrained, plan.out / "tokenizer")

    background_path = background_stage(cfg, plan)
    timing = {"background_s": time.time() - t0}
    module = dm = None
    if plan.trained:
        module, dm = experts_stage(cfg, plan, background_path)
    timing["experts_s"] = time.time() - t0 - timing["background_s"]
    summary = {"experiment": cfg.experiment, "seed": cfg.seed, "command": command,
               **composition_stage(cfg, plan, background_path, module, dm)}
    timing["composition_s"] = time.time() - t0 - timing["background_s"] - timing["experts_s"]
    if cfg.ablations:
        summary["ablations"] = run_ablations(cfg, plan.out, background_path)
        timing["ablations_s"] = time.time() - t0 - sum(timing.values())
    timing["total_s"] = time.time() - t0
    summary["timing"] = {k: round(v, 1) for k, v in timing.items()}
    summary["output_dir"] = str(plan.out)
    summary["export"] = str(plan.out / "export") if plan.trained else None
    _atomic_write_text(plan.out / "summary.json", json.dumps(summary, indent=2))
    if cfg.report:
        summary["report"] = str(write_report(summary, plan.out))
    return summary


def _atomic_save(save_fn, path: Path) -> None:
    """Write a folder through `save_fn(tmp)` and move it into place only once complete."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_fn(tmp)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
