"""Expert training-step cost: plain fine-tuning vs the off-mask regularizer, side by side in one run.

The default experiment's set-up (``configs/default.yaml``): a Llama background (hidden 64, 2 layers, 4
heads, intermediate 256, the A–Z character vocabulary), two experts A→B and C→D trained at once, 64 rows
per expert (128 rows a step), inputs of 8–16 letters with prefix corruption 0.2. Rows of the table:

* ``plain`` — ``reg_weight=0`` (``ExpertSettings``): one expert forward (LoRA: one mixed-adapter forward) +
  backward + AdamW step. ``log_every_n_steps`` is set huge, so the background logits that the λ=0 path
  computes for logging (every ``log_every_n_steps`` steps) are never computed on a timed step; the
  script counts background forwards on timed steps and prints the count.
* ``regularized`` — the default recipe's regularizer (``expert.reg_weight``, ``divergence``,
  ``temperature`` and ``reg_data`` of ``configs/default.yaml``): adds one no-grad background forward
  (peft ``disable_adapter()``; the frozen copy in full fine-tuning). Every row of the table trains on the
  same batches, built with the recipe's ``reg_data``.
* ``cached bg`` — the regularized step with the background cache on (``expert.background_cache``:
  ``background_top_k=--top-k``, batches keyed by row and corruption variant): every timed batch
  was seen before (its rows hit the cache), as in every epoch from the ``variants``-th on. The cache is
  filled before the first repetition; the fill is timed apart (the line under the table).
* ``cached bg, first sight`` — the same with an empty cache at the start of each fit: every batch misses,
  runs the background forward and stores its top-k (the step of the first ``variants`` epochs).

Every row trains on the same batches, collated with the cache's per-row corruption
(``corruption_variants=1``); the rows without the cache ignore the key columns.

Each step runs through Lightning (``Trainer.fit`` with automatic optimization, no logger, no
checkpointing, no validation), timed from one ``on_train_batch_start`` to the next, so the figure is a
whole loop iteration as the framework runs it. Every repetition fits every configuration in turn
(interleaved) for ``--warmup`` + ``--steps`` steps on the same pre-collated batches and keeps the median of
the timed steps; the table gives the median over repetitions.

The composition line times what ``CompositionEvaluation`` does at each validation (compose the background
with both experts, ``Task.composition_metrics`` on ``composition.val_limit`` = 200 compositional validation
inputs: greedy decoding + teacher-forced metrics) and compares it with the ``trainer.val_check_interval``
= 50 regularized LoRA steps between two validations. The background is untrained (random weights) unless
``--background`` names a trained HF folder; an untrained model rarely emits ``<eos>``, so its decoding
runs to ``max_new_tokens`` (the longest input + 2), one or two tokens more than a trained copy model.

Usage::

    python benchmarks/train_step.py [--reps 5] [--steps 5] [--warmup 2] [--threads N] [--no-full]
                                    [--background HF_FOLDER] [--top-k 64] [--no-validation]
                                    [--config configs/experiment/smollm2_skills.yaml] [--override KEY=VALUE]
                                    [--no-first-sight]
                                    [--out benchmarks/RESULTS_train_step.md]

``--config`` loads an experiment over the defaults (its model, task, batch size and recipe), e.g. SmolLM2-135M
with its skill experts: ``--config configs/experiment/smollm2_skills.yaml --no-full --no-validation``.

Before timing, the script reads the load average: above ``--max-load`` (1.0) it waits, polling every 15 s
for up to ``--wait`` (180) s, and if the machine stays loaded it runs with 1 intra-op thread (unless
``--threads`` was given): on a loaded 2-core machine torch's 2 threads wait on each other at every op.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"regularized": 1.4, "cached bg": 1.1}  # DESIGN.md: ratio to the plain step
CACHED, FIRST_SIGHT = "cached bg", "cached bg, first sight"


def wait_for_quiet(max_load: float, wait_s: float, poll_s: float = 15.0) -> tuple[float, float, bool]:
    """Wait (up to ``wait_s``) for the 1-minute load average to drop to ``max_load``.

    Returns the load when called, the load when done, and whether it dropped.
    """
    first = load = os.getloadavg()[0]
    deadline = time.monotonic() + wait_s
    while load > max_load and time.monotonic() < deadline:
        print(f"load average {load:.2f} > {max_load}: waiting {poll_s:.0f} s ...", flush=True)
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    return first, load, load <= max_load


def build(args):
    """The default experiment's config, its task, the experts' data module and fixed training batches."""
    import lightning.pytorch as pl

    from lightning_modules.pipeline.build import build_datamodule, build_task
    from lightning_modules.pipeline.config import load_config

    cfg = load_config([str(c) for c in args.config], args.override, base=ROOT / "configs" / "default.yaml")
    if "n_train" in cfg.task:  # a synthetic task: enough rows per expert for the fixed batches
        cfg.task.n_train = args.batches * cfg.data.batch_size
        cfg.task.n_test = 1
    pl.seed_everything(cfg.seed, verbose=False)
    # as the experts stage builds them: every expert trained, `data.batch_size` rows per expert per step
    task = build_task(cfg)
    dm = build_datamodule(cfg, task, "experts", corruption_variants=1)
    batches = []
    for batch in dm.train_dataloader():
        batches.append(batch)
        if len(batches) == args.batches:
            break
    return cfg, dm, task, batches


def make_module(cfg, task, mode: str, reg_weight: float, background_path: str | None,
                top_k: int | None = None):
    """The experiment's ``ExpertLM`` as the experts stage builds it (``pipeline.build.build_expert``), in ``mode``
    with ``reg_weight`` and ``top_k`` (the background cache, ``background_top_k``), logging never, and with a
    counter of background forwards."""
    import dataclasses

    import torch

    from lightning_modules.expert import ExpertLM
    from lightning_modules.pipeline.build import build_expert, expert_background, expert_settings
    from lightning_modules.pipeline.models import build_causal_lm, pretrained_folder

    class BenchExpertLM(ExpertLM):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.background_calls = 0

        def background_logits(self, *args, **kwargs):
            self.background_calls += 1
            return super().background_logits(*args, **kwargs)

    torch.manual_seed(cfg.seed)
    background_path = background_path or cfg.background.path
    if background_path:
        background = expert_background(cfg, pretrained_folder(background_path, "background.path"), task.tokenizer,
                                       mode)
    else:
        background = build_causal_lm(cfg.model, task.tokenizer, task.feature_map)
    settings = dataclasses.replace(expert_settings(cfg), mode=mode, reg_weight=reg_weight, background_top_k=top_k,
                                   log_every_n_steps=10**9)
    return build_expert(cfg, task, background, settings=settings, module_class=BenchExpertLM)


def _targets(modules) -> str:
    return f"{len(modules)} linear layers per block" if not isinstance(modules, str) else f"{modules} layers"


def fill_cost(module, batches) -> tuple[float, float, int, int]:
    """Fill the module's (empty) cache with every fixed batch: the ms per batch of that fill, of a plain
    background forward of the same batch, the bytes the cache holds after it, and the vocabulary size."""
    import torch

    module.eval()
    with torch.no_grad():
        start = time.perf_counter()
        for batch in batches:
            module.background_logits(batch["input_ids"], batch["attention_mask"])
        forward = (time.perf_counter() - start) * 1e3 / len(batches)
        start = time.perf_counter()
        for batch in batches:
            entry = module.cached_background(batch)
        fill = (time.perf_counter() - start) * 1e3 / len(batches)
    module.train()
    module.background_calls = 0
    return fill, forward, module.background_cache.nbytes(), entry.vocab_size


def empty_cache(module) -> None:
    """Forget every cached entry (the next fit sees each batch for the first time)."""
    from losses.background_cache import BackgroundCache

    old = module.background_cache
    module.background_cache = BackgroundCache(old.top_k, old.temperatures)


def timed_fit(module, batches, warmup: int, steps: int) -> tuple[float, int]:
    """Fit ``warmup + steps + 1`` steps; return the median ms of the timed steps (each from its
    ``on_train_batch_start`` to the next one's) and the background forwards made on them."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.calls: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())
            self.calls.append(pl_module.background_calls)

    timer = StepTimer()
    trainer = pl.Trainer(
        max_steps=warmup + steps + 1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=10**9, callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches[: warmup + steps + 1], batch_size=None))
    times = [(b - a) * 1e3 for a, b in zip(timer.starts[warmup:-1], timer.starts[warmup + 1:], strict=True)]
    assert len(times) == steps, (len(times), steps)
    return statistics.median(times), timer.calls[-1] - timer.calls[warmup]


def time_validation(module, dm, task, cfg) -> tuple[float, float, dict]:
    """One validation as the experts stage runs it: ``Trainer.validate`` on the per-expert validation
    loader with the ``CompositionEvaluation`` callback (``composition.val_limit`` compositional inputs).

    Returns the ms of the callback's ``on_validation_epoch_end`` (the composition), the ms of the whole
    validation, and the callback's results.
    """
    import lightning.pytorch as pl

    from lightning_modules.callbacks import CompositionEvaluation

    class TimedCompositionEvaluation(CompositionEvaluation):
        elapsed_ms = 0.0

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            start = time.perf_counter()
            super().on_validation_epoch_end(trainer, pl_module)
            self.elapsed_ms = (time.perf_counter() - start) * 1e3

    c = cfg.composition
    callback = TimedCompositionEvaluation(task, batch_size=c.eval_batch_size, limit=c.val_limit,
                                          active_threshold=c.active_threshold)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    loader = dm.val_dataloader()
    start = time.perf_counter()
    trainer.validate(module, dataloaders=loader, verbose=False)
    total_ms = (time.perf_counter() - start) * 1e3
    n = min(len(task.compositional_dataset("val")), c.val_limit or 10**9)
    return callback.elapsed_ms, total_ms, {"n": n, "val_rows": len(loader.dataset), **callback.last}


def time_steps(args: argparse.Namespace, cfg, dm, task, batches) -> tuple:
    """Every configuration fitted in turn, ``args.reps`` times: the modules, ms per step of each, background
    forwards on timed steps, the cache fill costs, and the validation timings with the composition's results."""
    modes = ["lora"] if args.no_full else ["lora", "full"]
    lam = cfg.expert.reg_weight
    kinds = {"plain": (0.0, None), "regularized": (lam, None), CACHED: (lam, args.top_k), FIRST_SIGHT: (lam, args.top_k)}
    if args.no_first_sight:
        del kinds[FIRST_SIGHT]
    refused = cache_refused(cfg, args.top_k)
    if refused:
        print(f"no background-cache rows: {refused}", flush=True)
        kinds = {k: v for k, v in kinds.items() if v[1] is None}
    modules, fills = {}, {}
    for mode in modes:
        for kind, (weight, top_k) in kinds.items():
            module = make_module(cfg, task, mode, weight, args.background, top_k)
            if kind == CACHED:
                fills[mode] = fill_cost(module, batches)
            modules[mode, kind] = module

    # Validation is timed on a module of its own: composing it for evaluation must not change the timed ones.
    val_module = None if args.no_validation else make_module(cfg, task, "lora", lam, args.background)
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in modules}
    bg_calls: dict[tuple[str, str], int] = dict.fromkeys(modules, 0)
    comp_ms: list[float] = []
    val_ms: list[float] = []
    comp_results: dict = {}
    timed_fit(modules["lora", "plain"], batches, 1, 1)  # first-fit warm-up (allocator, lazy imports)
    for _ in range(args.reps):
        for key, module in modules.items():
            if key[1] == FIRST_SIGHT:
                empty_cache(module)
            ms, calls = timed_fit(module, batches, args.warmup, args.steps)
            samples[key].append(ms)
            bg_calls[key] += calls
        if not args.no_validation:
            ms, total, comp_results = time_validation(val_module, dm, task, cfg)
            comp_ms.append(ms)
            val_ms.append(total)

    return modules, samples, bg_calls, fills, comp_ms, val_ms, comp_results


def cache_refused(cfg, top_k: int) -> str | None:
    """Why the experiment's settings cannot take the background cache (e.g. the features regularizer), or None."""
    import dataclasses

    from lightning_modules.pipeline.build import expert_settings

    try:
        dataclasses.replace(expert_settings(cfg), background_top_k=top_k)
    except ValueError as e:
        return str(e)
    return None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median reported)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and repetition")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them in each fit")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-full", action="store_true", help="skip the full fine-tuning rows")
    parser.add_argument("--background", default=None, help="a trained background HF folder (default: random)")
    parser.add_argument("--config", type=Path, action="append", default=[],
                        help="an experiment YAML merged over the defaults (repeatable)")
    parser.add_argument("--override", action="append", default=[], help="a dotted.key=value config override")
    parser.add_argument("--top-k", type=int, default=64, help="tokens per position in the background cache")
    parser.add_argument("--no-first-sight", action="store_true", help="skip the `cached bg, first sight` rows")
    parser.add_argument("--no-validation", action="store_true", help="skip timing the validation/composition")
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=180.0, help="seconds to wait for the load to drop")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    if min(args.reps, args.steps) < 1 or args.warmup < 1:
        parser.error("--reps and --steps must be >= 1, --warmup >= 1 (step 0 logs and builds AdamW state)")
    args.batches = args.warmup + args.steps + 1
    return args


def step_table(args: argparse.Namespace, batches, modules, med, bg_calls, fills) -> list[str]:
    """The table of ms per step (ratios to the plain step, targets, background forwards) and the cache fills."""
    lines = ["| mode | step | ms/step | ratio to plain | target | bg forwards on timed steps |",
             "|---|---|---|---|---|---|"]
    for mode, kind in modules:
        ratio = med[mode, kind] / med[mode, "plain"]
        target = TARGETS.get(kind)
        verdict = "" if target is None else f"≤ {target}× ({'met' if ratio <= target else 'missed'})"
        lines.append(f"| {mode} | {kind} | {med[mode, kind]:.1f} | {ratio:.2f}× | {verdict} | "
                     f"{bg_calls[mode, kind]} |")
    for mode, (fill, forward, nbytes, vocab) in fills.items():
        k = min(args.top_k, vocab)
        rows = sum(len(b["input_ids"]) for b in batches)
        lines += ["", f"{mode}: filling the cache (top-k = {k} of V = {vocab}{', exact' if k == vocab else ''}) "
                      f"takes {fill:.1f} ms per batch against {forward:.1f} ms for the background forward alone "
                      f"({fill / forward:.2f}×); it holds {nbytes / rows / 1e3:.1f} kB per row "
                      f"({nbytes / 1e6:.2f} MB for {rows} rows)"]
    return lines


def validation_lines(every: int, med, comp_ms: list[float], val_ms: list[float], comp_results: dict) -> list[str]:
    """What one validation (the composition, and the whole of it) adds to `every` training steps."""
    comp, val = statistics.median(comp_ms), statistics.median(val_ms)
    reg_window = every * med["lora", "regularized"]
    plain_window = every * med["lora", "plain"]
    return [
        "",
        f"composition eval (`CompositionEvaluation` → `Task.composition_metrics` on {comp_results['n']} compositional "
        f"val inputs): {comp / 1e3:.2f} s (median of {len(comp_ms)}) vs {every} regularized LoRA steps "
        f"{reg_window / 1e3:.2f} s → **composition eval adds {100 * comp / reg_window:.0f} % per {every} steps** "
        f"({100 * comp / plain_window:.0f} % of {every} plain steps)",
        "",
        f"whole validation (`Trainer.validate`: per-expert loop on {comp_results['val_rows']} val rows + the "
        f"composition): {val / 1e3:.2f} s → adds {100 * val / reg_window:.0f} % per {every} regularized steps",
    ]


def main() -> None:
    args = parse_args()
    command = "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]])

    t0 = time.perf_counter()
    load_start, load_ready, quiet = wait_for_quiet(args.max_load, args.wait)
    waited = time.perf_counter() - t0
    threads_note = ""
    if args.threads is None and not quiet:
        args.threads = 1
        threads_note = f" (forced: load {load_ready:.2f} > {args.max_load} after waiting)"

    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (sets its loggers' levels on import; quiet them after)
    import torch

    sys.path.insert(0, str(ROOT))
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    cfg, dm, task, batches = build(args)
    modules, samples, bg_calls, fills, comp_ms, val_ms, comp_results = time_steps(args, cfg, dm, task, batches)
    med = {key: statistics.median(v) for key, v in samples.items()}
    lines = step_table(args, batches, modules, med, bg_calls, fills)
    every = cfg.trainer.val_check_interval
    n_tokens = len(batches[0]["input_ids"]) * batches[0]["input_ids"].shape[1]
    if not args.no_validation:
        lines += validation_lines(every, med, comp_ms, val_ms, comp_results)
    load_end = os.getloadavg()[0]
    exact_note = "" if args.no_validation else f"; composed exact match at the last eval {comp_results['exact_match']:.3f}"
    lines += [
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads{threads_note} on {os.cpu_count()} CPUs "
        f"(load average {load_start:.2f} at start, {load_ready:.2f} when timing began, {load_end:.2f} at end), "
        f"{platform.machine()}; batch {len(batches[0]['input_ids'])} rows × {batches[0]['input_ids'].shape[1]} "
        f"tokens (first batch, {n_tokens} positions); LoRA r={cfg.expert.lora.r} on "
        f"{_targets(cfg.expert.lora.target_modules)}; regularizer λ={cfg.expert.reg_weight:g} · "
        f"{cfg.expert.divergence} at T={cfg.expert.temperature:g}, reg_data={cfg.expert.reg_data}, "
        f"{cfg.expert.regularizer} regularizer; "
        f"median of {args.steps} steps after "
        f"{args.warmup} warm-up, median of {args.reps} interleaved reps; background "
        f"{args.background or cfg.background.path or 'untrained (random init)'}"
        f"{exact_note}; total {time.perf_counter() - t0:.0f} s "
        f"({waited:.0f} s of it waiting for the load to drop)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(f"# Expert training-step benchmark\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
