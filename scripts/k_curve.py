"""Composed exact match against the number of experts k, one line per recipe, and decoding time per token against
k beside it (docs/results/separate.md).

    python scripts/k_curve.py --curve modular=runs/sep_k16_s0,runs/sep_k16_s1 \
        --curve co-trained=runs/cot_k2,runs/cot_k4,runs/cot_k16 --timing runs/sep_k16_s0/combined \
        --out docs/accuracy_vs_k.png

A curve's sources are run folders, comma-separated:
- a `scripts/train_separately.py` output (`separate.json`): every composition it evaluated (the combined one and
  its `--subsets`; not the `--late` one) at its k, and each expert alone at k = 1;
- a `train.py` run (`summary.json`): its composition at its k, and each expert alone at k = 1.
Points at the same k are averaged; the band spans their lowest and highest value. `--points NAME=K:EM,K:EM...`
adds figures measured elsewhere (say, a README table) to the curve NAME.

`--timing EXPORT`: an export holding at least the largest k experts; greedy decoding of the composition of its
first k experts (adapters backend, batch 1, 8 letter prompts of 12 letters), median ms per generated token.
Writes the plot and `<out>.json` with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def points(folder: Path) -> list[tuple[int, float]]:
    """(k, composed exact match) pairs a run folder holds (see the module docstring)."""
    separate, summary = folder / "separate.json", folder / "summary.json"
    if separate.is_file():
        r = json.loads(separate.read_text())
        late = (r.get("late") or {}).get("name")  # the expert that joined later: not a point of the k-curve
        return ([(1, float(v)) for n, v in r["alone"].items() if n != late]
                + [(c["k"], float(c["exact_match"])) for c in r["compositions"] if late not in c["experts"]])
    if summary.is_file():
        s = json.loads(summary.read_text())
        alone = [(1, float(e["exact_match"])) for e in s["experts"].values()]
        return alone if len(alone) == 1 else alone + [(int(s["composition"]["k"]),
                                                       float(s["composition"]["exact_match"]))]
    raise SystemExit(f"k_curve: {folder} holds neither separate.json (train_separately.py) nor summary.json")


def curve(folders: list[Path], extra: list[tuple[int, float]] = ()) -> dict[int, dict[str, float]]:
    """Mean, min, max and count of the composed exact match per k over `folders` and the `extra` points."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for k, em in [pair for folder in folders for pair in points(folder)] + list(extra):
        by_k[k].append(em)
    return {k: {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)}
            for k, v in sorted(by_k.items())}


def decode_ms_per_token(export: Path, ks: list[int], prompts: int = 8, length: int = 12) -> dict[int, float]:
    """Median ms per generated token of the composition of the export's first k experts (batch 1, greedy)."""
    import random

    import torch

    from compose import ComposedLM
    from lightning_modules.pipeline.console import quiet

    quiet()
    full = ComposedLM.from_manifest(export)
    tok = full.tokenizer
    if max(ks) > full.num_experts:
        raise SystemExit(f"k_curve: --timing {export} holds {full.num_experts} experts, fewer than k={max(ks)}")
    letters = [t for t in tok.convert_ids_to_tokens(range(len(tok))) if len(t) == 1 and t.isalpha()]
    rng = random.Random(0)
    rows = [torch.tensor([[tok.bos_token_id, *tok.convert_tokens_to_ids(rng.choices(letters, k=length)),
                           tok.sep_token_id]]) for _ in range(prompts)]
    out = {}
    for k in ks:
        lm = ComposedLM.from_peft(full.model, full.names[:k], tokenizer=tok)
        lm.generate(rows[0], max_new_tokens=4)  # warm-up
        per_token = []
        for ids in rows:
            start = time.perf_counter()
            generated = lm.generate(ids, max_new_tokens=length + 2).shape[1] - ids.shape[1]
            per_token.append(1000 * (time.perf_counter() - start) / generated)
        out[k] = statistics.median(per_token)
        print(f"[k_curve] decode k={k}: {out[k]:.2f} ms/token", flush=True)
    return out


def plot(curves: dict[str, dict[int, dict[str, float]]], timing: dict[int, float] | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if timing else 1, figsize=(10 if timing else 5.5, 4), squeeze=False)
    all_ks = sorted({k for c in curves.values() for k in c} | set(timing or {}))
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.set_xlabel("experts composed (k)")
    ax = axes[0, 0]
    for name, c in curves.items():
        ks = list(c)
        ax.plot(ks, [c[k]["mean"] for k in ks], marker="o", label=name)
        ax.fill_between(ks, [c[k]["min"] for k in ks], [c[k]["max"] for k in ks], alpha=0.2)
    ax.set_ylabel("composed exact match")
    ax.axhline(0.99, color="grey", lw=0.8, ls="--")
    ax.legend()
    if timing:
        ax = axes[0, 1]
        ax.plot(list(timing), list(timing.values()), marker="o", color="black")
        ax.set_ylabel("decoding time (ms per token, batch 1)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--curve", action="append", default=[], metavar="NAME=RUN[,RUN...]")
    parser.add_argument("--points", action="append", default=[], metavar="NAME=K:EM[,K:EM...]")
    parser.add_argument("--timing", type=Path, default=None, help="an export to time decoding against k")
    parser.add_argument("--ks", default="1,2,4,8,16", help="the k of the timing panel")
    parser.add_argument("--out", type=Path, default=Path("docs/accuracy_vs_k.png"))
    args = parser.parse_args(argv)
    folders: dict[str, list[Path]] = defaultdict(list)
    extra: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for flag, items in (("--curve", args.curve), ("--points", args.points)):
        for item in items:
            name, sep, values = item.partition("=")
            try:
                if not sep or not values:
                    raise ValueError
                for value in values.split(","):
                    if flag == "--curve":
                        folders[name].append(Path(value))
                    else:
                        k, em = value.split(":")
                        extra[name].append((int(k), float(em)))
            except ValueError:
                parser.error(f"{flag} {item!r}: expected " + ("NAME=RUN[,RUN...]" if flag == "--curve"
                                                               else "NAME=K:EM[,K:EM...]"))
    if not folders and not extra:
        parser.error("give at least one --curve or --points")
    curves = {name: curve(folders[name], extra[name]) for name in dict.fromkeys([*folders, *extra])}
    timing = decode_ms_per_token(args.timing, [int(k) for k in args.ks.split(",")]) if args.timing else None
    for name, c in curves.items():
        print(f"[k_curve] {name}: " + ", ".join(f"k={k} {v['mean']:.4f} (n={v['n']}, min {v['min']:.4f})"
                                               for k, v in c.items()))
    plot(curves, timing, args.out)
    result = {"curves": {n: {str(k): v for k, v in c.items()} for n, c in curves.items()},
              "decode_ms_per_token": None if timing is None else {str(k): v for k, v in timing.items()}}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[k_curve] wrote {args.out} and {args.out.with_suffix('.json')}")
    return result


if __name__ == "__main__":
    main()
