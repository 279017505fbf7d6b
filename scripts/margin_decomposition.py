"""Where a finished run's composition is close to failing: the margin decomposition on its test set.

    python scripts/margin_decomposition.py runs/new_k8_s1

Loads `<run>/export` and rebuilds the run's compositional test set from `<run>/config.yaml` (the same seed, so
the same inputs as `summary.json`). At every output position held by one expert's mask it splits the composed
log-odds of the rule's letter over the copied source letter into the owner expert's own log-odds and the shift
the other experts add (`compose.metrics.margin_decomposition`), and prints their quantiles. Generative format.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compose import ComposedLM, load_manifest  # noqa: E402
from compose.metrics import margin_decomposition  # noqa: E402
from data.datamodules import ExpertDataModule  # noqa: E402
from data.letters import LettersCollator, RuleSet  # noqa: E402
from lightning_modules.stages import data_config  # noqa: E402

QUANTILES = (0.01, 0.05, 0.5)


def main(run: Path) -> None:
    cfg = OmegaConf.load(run / "config.yaml")
    if cfg.data.format != "generative":
        raise SystemExit(f"{run}: only the generative format has a copied source to compare with")
    model = ComposedLM.from_manifest(run / "export").eval()
    rules = [RuleSet(e["name"], dict((e.get("spec") or {}).get("rules", {})))
             for e in load_manifest(run / "export")["experts"]]
    # the run's own data settings: held-out inputs avoid its training rows, regularizer rows included
    dm = ExpertDataModule(model.tokenizer, data_config(cfg, 0.0, cfg.expert.reg_data, len(rules)), rules)
    dm.setup("test")
    rows = list(dm.compositional_dataset("test"))
    batch = LettersCollator(model.tokenizer, cfg.data.alphabet)(rows)
    ids, targets = batch["input_ids"], batch["targets"]
    # the copied source at the target position of output letter j is the input letter x[j] (input_ids[1 + j])
    sources = torch.full_like(targets, -100)
    for b, row in enumerate(rows):
        n = len(row["x"])
        sources[b, n + 1: 2 * n + 1] = ids[b, 1: n + 1]
    lp_b, lp_e = model.component_logprobs(ids, batch["attention_mask"])
    parts = margin_decomposition(lp_b, lp_e, targets, sources, batch["masks"])
    total = parts["owner"] + parts["others"]
    print(f"{run}: {len(total)} mask positions, {int((total < 0).sum())} with a composed margin < 0")
    for name, values in (("owner", parts["owner"]), ("others", parts["others"]), ("composed", total)):
        q = torch.quantile(values, torch.tensor(QUANTILES))
        print(f"  {name:9s}" + "  ".join(f"p{round(100 * p):02d} {v:6.2f}" for p, v in zip(QUANTILES, q.tolist(), strict=True)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
