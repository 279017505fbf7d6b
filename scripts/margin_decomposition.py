"""Where a finished run's composition is close to failing: the margin decomposition on its test set.

    python scripts/margin_decomposition.py runs/new_k8_s1          # a run folder
    python scripts/margin_decomposition.py runs/modular_k8_s0/combined   # an export (e.g. compose.combine's)

Loads `<run>/export` and rebuilds the run's compositional test set from `<run>/config.yaml` (the same task,
experts and seed, so the same inputs as `summary.json`); given an export folder, the test set `compose.combine`
evaluates (the task settings and seed its manifest records). At every output position held by one expert's mask it
splits the composed log-odds of the rule's letter over the copied source letter into the owner expert's own
log-odds and the shift the other experts add (`compose.metrics.margin_decomposition`), and prints their
quantiles. Letter task, generative format; runs that composed with earlier exports are not supported (their
export holds only the experts trained in the run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compose import ComposedLM  # noqa: E402
from compose.metrics import margin_decomposition  # noqa: E402
from data.tasks import Task  # noqa: E402
from lightning_modules.pipeline.build import build_task  # noqa: E402
from lightning_modules.pipeline.config import ConfigError, load_config  # noqa: E402

QUANTILES = (0.01, 0.05, 0.5)


def export_task(export: Path) -> tuple[ComposedLM, Task]:
    """An export's composed model and its task (with every expert in play), as `compose.combine` rebuilds it."""
    from compose.frontends.combine import CombineError, check_exports, load_composed

    try:
        combination = check_exports([export])
    except CombineError as e:
        raise SystemExit(f"{export}: {e}") from None
    if combination.settings["name"] != "letters" or combination.settings["format"] != "generative":
        raise SystemExit(f"{export}: only the letter task's generative format has a copied source to compare with")
    return load_composed(export).eval(), combination.task


def run_task(run: Path) -> tuple[ComposedLM, Task]:
    """A run's exported composed model and its own task (held-out inputs avoid its training rows)."""
    cfg, task = config_task(run)
    model = ComposedLM.from_manifest(run / "export").eval()
    if list(model.names) != task.expert_names or model.tokenizer.get_vocab() != task.tokenizer.get_vocab():
        raise SystemExit(f"{run}: the export (experts {model.names}) does not match config.yaml "
                         f"(experts {task.expert_names}, task.alphabet={cfg.task.alphabet})")
    return model, task


def config_task(run: Path) -> tuple[DictConfig, Task]:
    """A run's config and its own task, as `train.py` built it (held-out inputs avoid its training rows,
    regularizer rows included)."""
    try:
        cfg = load_config([str(run / "config.yaml")])
    except ConfigError as e:
        raise SystemExit(f"{run}: {e}") from None
    if cfg.task.name != "letters" or cfg.task.format != "generative":
        raise SystemExit(f"{run}: only the letter task's generative format has a copied source to compare with "
                         f"(task.name={cfg.task.name}, format={cfg.task.get('format')})")
    if cfg.composition.compose_with:
        raise SystemExit(f"{run}: composed with earlier exports; its export holds only this run's experts")
    try:
        return cfg, build_task(cfg)
    except ConfigError as e:
        raise SystemExit(f"{run}: {e}") from None


def main(run: Path) -> None:
    from lightning_modules.pipeline.console import quiet

    quiet()  # library deprecation notices of calls we cannot change
    model, task = export_task(run) if (run / "composition.yaml").is_file() else run_task(run)
    rows = task.compositional_dataset("test")
    batch = task.collator()(list(rows))
    ids, targets = batch["input_ids"], batch["targets"]
    # the copied source at the target position of output letter j is the input letter x[j] (input_ids[1 + j])
    sources = torch.full_like(targets, -100)
    for b, x in enumerate(rows["x"]):
        n = len(x)
        sources[b, n + 1: 2 * n + 1] = ids[b, 1: n + 1]
    lp_b, lp_e = model.component_logprobs(ids, batch["attention_mask"])
    parts = margin_decomposition(lp_b, lp_e, targets, sources, batch["masks"])
    total = parts["owner"] + parts["others"]
    print(f"{run}: {len(total)} mask positions, {int((total < 0).sum())} with a composed margin < 0")
    for name, values in (("owner", parts["owner"]), ("others", parts["others"]), ("composed", total)):
        q = torch.quantile(values, torch.tensor(QUANTILES))
        print(f"  {name:9s}" + "  ".join(f"p{round(100 * p):02d} {v:6.2f}" for p, v in zip(QUANTILES, q.tolist(), strict=True)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a finished run's output_dir (config.yaml, export/), or an export")
    args = parser.parse_args()
    torch.set_num_threads(1)
    main(args.run)
