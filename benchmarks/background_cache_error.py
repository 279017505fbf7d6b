"""How far the cached regularizer (``expert.background_cache``: top-k + tail) is from the exact one, on trained experts.

For a finished run (its ``config.yaml`` and ``export/``), the script rebuilds the experts' training batches (as the
experts stage does, prefix corruption included), runs the exported background and experts on them, and compares, at
the off-mask target positions, the exact regularizer ``mean D(p_i, p_b)`` (``losses.off_mask_divergence``) with the
one read from a cache of the background's top-k logits and tail mass (``losses.background_cache``), for each k:

* ``tail mass``: the background's probability outside its top k, mean over positions (at the temperature);
* ``rel. error``: ``1 − cached / exact`` of the regularizer's value (≥ 0: the bucketed divergence is a lower bound);
* ``grad error``: ``‖g_k − g‖ / ‖g‖`` of its gradient with respect to the expert's logits, and ``cos`` their cosine:
  what training sees.

Usage::

    python benchmarks/background_cache_error.py --run runs/default_s0 [--batches 4] [--ks 8 32 64 256]
                                                [--temperatures 1 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_task(run: Path):
    """The run's config and its task, as `train.py` built it."""
    from lightning_modules.pipeline.build import build_task
    from lightning_modules.pipeline.config import load_config

    cfg = load_config([str(run / "config.yaml")])
    return cfg, build_task(cfg)


def load_run(run: Path):
    """The run's config, task (`run_task`), and the exported background with every expert adapter."""
    from peft import PeftModel

    from compose.export import load_manifest
    from lightning_modules.pipeline.models import load_pretrained

    cfg, task = run_task(run)
    export = run / "export"
    manifest = load_manifest(export)
    background = load_pretrained(export / manifest["background"]["path"], task.tokenizer)
    entries = {e["name"]: e for e in manifest["experts"]}
    names = [e.name for e in cfg.experts]
    model = PeftModel.from_pretrained(background, export / entries[names[0]]["path"], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(export / entries[name]["path"], adapter_name=name)
    return cfg, task, model.eval(), names


def batches_of(cfg, task, n: int) -> list[dict]:
    """The first `n` training batches of the experts stage, with the cache's per-row corruption."""
    from lightning_modules.pipeline.build import build_datamodule

    dm = build_datamodule(cfg, task, "experts", corruption_variants=1)
    out = []
    for batch in dm.train_dataloader():
        out.append(batch)
        if len(out) == n:
            break
    return out


def measure(cfg, model, names, batches, ks, temperatures):
    """Rows of the table: one per (temperature, k)."""
    import torch

    from losses import divergence, region_positions
    from losses.background_cache import BackgroundTopK, topk_divergence

    kind = cfg.expert.divergence
    expert_logits, background_logits = [], []
    with torch.no_grad():
        for batch in batches:
            ids, attn = batch["input_ids"], batch["attention_mask"]
            keep = region_positions(batch["targets"], batch["masks"][:, 0], "off")
            with model.disable_adapter():
                background_logits.append(model(input_ids=ids, attention_mask=attn).logits[keep])
            adapters = [names[i] for i in batch["expert_index"].tolist()]
            expert_logits.append(model(input_ids=ids, attention_mask=attn, adapter_names=adapters).logits[keep])
    expert, background = torch.cat(expert_logits), torch.cat(background_logits)
    vocab = background.shape[-1]
    rows = []
    for t in temperatures:
        x = expert.clone().requires_grad_(True)
        exact = divergence(x, background, kind, temperature=t).mean()
        (grad,) = torch.autograd.grad(exact, x)
        for k in ks:
            cached = BackgroundTopK.from_logits(background, k, (t,))
            x = expert.clone().requires_grad_(True)
            value = topk_divergence(x, cached, kind, temperature=t).mean()
            (grad_k,) = torch.autograd.grad(value, x)
            top, _ = cached.logprobs(t)
            rows.append({
                "T": t, "k": min(k, vocab), "V": vocab, "positions": len(background),
                "bytes": cached.ids.element_size() * cached.k + 4 * cached.k + 4,
                "tail": float((1 - top.exp().sum(-1)).clamp_min(0).mean()),
                "exact": float(exact), "cached": float(value), "rel": float(1 - value / exact),
                "grad": float((grad_k - grad).norm() / grad.norm()),
                "cos": float(torch.nn.functional.cosine_similarity(grad_k.flatten(), grad.flatten(), dim=0)),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run folder (config.yaml, export/)")
    parser.add_argument("--batches", type=int, default=4, help="training batches to measure on")
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 32, 64, 256])
    parser.add_argument("--temperatures", type=float, nargs="+", default=None,
                        help="default: the run's expert.temperature")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    command = "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]])
    t0 = time.perf_counter()

    import logging
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg, task, model, names = load_run(args.run)
    batches = batches_of(cfg, task, args.batches)
    temperatures = args.temperatures or [float(cfg.expert.temperature)]
    rows = measure(cfg, model, names, batches, args.ks, temperatures)
    lines = [f"`{command}`", "",
             f"{args.run}: {cfg.expert.divergence}, {rows[0]['positions']} off-mask positions of {len(batches)} "
             f"training batches (corruption {cfg.expert.corruption_prob}), V = {rows[0]['V']}", "",
             "| T | k | bytes/position | tail mass | regularizer exact | cached | rel. error | grad error | cos |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']:g} | {r['k']}{' (= V)' if r['k'] == r['V'] else ''} | {r['bytes']} | "
                     f"{r['tail']:.3g} | {r['exact']:.4g} | {r['cached']:.4g} | {100 * r['rel']:.2f} % | "
                     f"{100 * r['grad']:.2f} % | {r['cos']:.4f} |")
    lines += ["", f"(exact: float32 logits, 4·V = {4 * rows[0]['V']} bytes per position; total "
                  f"{time.perf_counter() - t0:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
