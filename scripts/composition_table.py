"""The real-model targets of experts trained apart, as a table: one row per way of using the experts, each fraction
with its 95 % Wilson interval, and each target checked.

    python scripts/composition_table.py runs/s4/all_s0 [--composition 0] [--skill-bound 0.95] [--ppl-bound 1.02]

Reads `OUT/separate.json` of `scripts/train_separately.py ... --compare background,gated,alone,task_arithmetic,
ties,dare` (or a `compose.combine --metrics` file): the composition's metrics and those of each compared method,
all on the same compositional test rows. `--composition I` picks the I-th composition of `separate.json` (0: all
the experts; -1: the late one). Prints a markdown table and the targets:

- per skill, soft composition's accuracy ≥ `--skill-bound` × the expert's alone on the same rows;
- soft exact match above every merge beyond the 95 % intervals (the intervals do not overlap);
- soft exact match at or above gated's within its interval (soft ≥ gated's lower bound);
- general perplexity ≤ `--ppl-bound` × the background's (the same held-out general rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compose.merges import MERGE_METHODS  # noqa: E402
from lightning_modules.pipeline.report import fraction_count, fraction_interval  # noqa: E402


def load(path: Path, index: int) -> tuple[dict, dict]:
    """`(soft metrics, {method: metrics})` of a `separate.json` composition or a combine metrics file."""
    file = (path / "separate.json") if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"composition_table: {file}: no such file (a train_separately.py output folder or a "
                         "compose.combine --metrics file)")
    data = json.loads(file.read_text())
    if "compositions" in data:
        data = data["compositions"][index]
        if "compare" not in data:
            raise SystemExit(f"composition_table: {path}: composition {index} has no compared methods "
                             "(train_separately.py --compare)")
        return {"exact_match_n": data["n_test"], **data["metrics"]}, data["compare"]
    return {**data["metrics"], "exact_match_n": data["n_test"], "composition": data.get("composition", "soft")}, \
        data.get("compare", {})


def fraction(entry: dict, key: str) -> str:
    value = entry.get(key)
    if value is None:
        return "–"
    ci = fraction_interval(value, fraction_count(entry, key))
    return f"{value:.3f}" if ci is None else f"{value:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def ci(entry: dict) -> tuple[float, float]:
    """The 95 % interval of the entry's exact match."""
    return fraction_interval(entry["exact_match"], fraction_count(entry, "exact_match"))


def table(soft: dict, compared: dict, skills: list[str]) -> str:
    rows = {f"{soft.get('composition', 'soft')} composition": soft,
            **{(k.removeprefix("alone/") + " alone" if k.startswith("alone/") else k): v
               for k, v in compared.items() if k != "soft"}}
    head = ["", "exact match", *(f"`{s}` skill accuracy" for s in skills), "off-interval KL", "general perplexity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in rows.items():
        ppl = e.get("general_perplexity")
        kl = e.get("off_interval_kl")
        lines.append("| " + " | ".join([name, fraction(e, "exact_match"), *(fraction(e, f"{s}/skill_accuracy")
                                                                             for s in skills),
                                        "–" if kl is None else f"{kl:.3f}",
                                        "–" if ppl is None else f"{ppl:.3f}"]) + " |")
    return "\n".join(lines)


def targets(soft: dict, compared: dict, skills: list[str], skill_bound: float, ppl_bound: float) -> list[str]:
    out = []
    for s in skills:
        alone = compared.get(f"alone/{s}", {}).get(f"{s}/skill_accuracy")
        mine = soft.get(f"{s}/skill_accuracy")
        if alone and mine is not None:
            ratio = mine / alone
            missing = [e.get(f"{s}/intervals_missing") for e in (soft, compared[f"alone/{s}"])]
            out.append(f"- `{s}`: soft {mine:.3f} / alone {alone:.3f} = {ratio:.3f} "
                       f"({'meets' if ratio >= skill_bound else 'misses'} ≥ {skill_bound})"
                       + ("" if None in missing else  # how many of its intervals were not written at all
                          f"; not written: soft {missing[0]:.1%}, alone {missing[1]:.1%}"))
    lo, hi = ci(soft)
    for m in MERGE_METHODS:
        if m in compared:
            m_lo, m_hi = ci(compared[m])
            verdict = "above beyond the intervals" if lo > m_hi else ("above, intervals overlap"
                                                                      if soft["exact_match"] > compared[m]["exact_match"]
                                                                      else "not above")
            out.append(f"- soft vs {m}: {soft['exact_match']:.3f} [{lo:.2f}, {hi:.2f}] vs "
                       f"{compared[m]['exact_match']:.3f} [{m_lo:.2f}, {m_hi:.2f}]: {verdict}")
    if "gated" in compared:
        g_lo, _ = ci(compared["gated"])
        out.append(f"- soft vs gated: {soft['exact_match']:.3f} vs {compared['gated']['exact_match']:.3f} "
                   f"(lower bound {g_lo:.2f}): {'meets' if soft['exact_match'] >= g_lo else 'misses'}")
    bg = compared.get("background", {}).get("general_perplexity")
    if bg and soft.get("general_perplexity"):
        ratio = soft["general_perplexity"] / bg
        out.append(f"- general perplexity: {soft['general_perplexity']:.3f} / background {bg:.3f} = {ratio:.3f} "
                   f"({'meets' if ratio <= ppl_bound else 'misses'} ≤ {ppl_bound})")
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a train_separately.py output folder or a combine metrics file")
    parser.add_argument("--composition", type=int, default=0, help="which composition of separate.json")
    parser.add_argument("--skill-bound", type=float, default=0.95)
    parser.add_argument("--ppl-bound", type=float, default=1.02)
    args = parser.parse_args(argv)
    soft, compared = load(args.source, args.composition)
    skills = sorted({k.split("/")[0] for k in soft if k.endswith("/skill_accuracy")})
    text = table(soft, compared, skills) + "\n\n" + "\n".join(targets(soft, compared, skills, args.skill_bound,
                                                                      args.ppl_bound))
    print(text)
    return text


if __name__ == "__main__":
    main()
