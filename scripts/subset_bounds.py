"""Every pair, triple, ... of a set of experts trained apart, composed on the same rows and checked against each
expert alone: the k-expert bound for every subset, not only for all of them.

    python scripts/subset_bounds.py runs/s4/all_s1/runs/{calc,upper,reverse,translate}/export --sizes 2 3 \
        --composition gated soft --limit 100 --bound 0.9 --batch_size 32 --metrics runs/s4/all_s1/subsets.json

Each expert alone is decoded once on the first `--limit` compositional test rows (`compose.combine --compare
alone`); then every subset of each size in `--sizes`, and the whole set, is composed (`--composition`: one or more
of soft, gated) and decoded on the same rows, teacher-forced passes skipped. For each skill of a subset, its
accuracy inside the composition is divided by the expert's accuracy alone on these rows; a subset meets the bound
when every one of its skills holds at least `--bound` × the expert's accuracy alone. A subset's exact match is left
out: the rows need skills it does not hold. Prints a markdown table (every accuracy with its 95 % Wilson interval)
and writes the results with `--metrics`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_modules.pipeline.report import fraction_interval  # noqa: E402

SKILL = "skill_accuracy"


def skill(metrics: dict, name: str) -> tuple[float | None, int | None]:
    """An expert's skill accuracy in a metrics dict and how many intervals it counts."""
    return metrics.get(f"{name}/{SKILL}"), metrics.get(f"{name}/{SKILL}_n")


def subset_bounds(exports: list[Path], sizes: list[int], compositions: list[str], *, limit: int | None = None,
                  batch_size: int = 32, bound: float = 0.9, test_settings: dict | None = None) -> dict:
    """Compose each subset and check its skills against the experts alone. Returns `{"alone": {name: {accuracy,
    n}}, "subsets": [{experts, composition, skills: {name: {accuracy, n, ratio, meets}}, worst_ratio, meets}],
    "bound", "n_test"}`."""
    from compose.frontends.combine import combine_exports

    k = len(exports)
    bad = [s for s in sizes if not 2 <= s < k]
    if bad:
        raise SystemExit(f"subset_bounds: --sizes {bad}: each must be at least 2 and below the {k} experts given "
                         "(the whole set is always composed)")
    common = {"limit": limit, "batch_size": batch_size, "decode_only": True, "test_settings": test_settings or {}}
    first = combine_exports(exports, composition=compositions[0], compare_with=["alone"], **common)
    names = first["experts"]
    alone = {}
    for name in names:
        value, n = skill(first["compare"][f"alone/{name}"], name)
        if value is None:
            raise SystemExit(f"subset_bounds: expert {name!r} has no {SKILL} on these rows (its skill does not occur "
                             "in them): nothing to compare against")
        alone[name] = {"accuracy": value, "n": n}
    results: dict = {"alone": alone, "subsets": [], "bound": bound, "n_test": first["n_test"]}
    for composition in compositions:
        for size in [*sorted(set(sizes)), k]:
            for chosen in itertools.combinations(range(k), size):
                if size == k and composition == compositions[0]:
                    metrics = first["metrics"]  # the whole set under the first composition: decoded above
                else:
                    metrics = combine_exports([exports[i] for i in chosen], composition=composition,
                                              **common)["metrics"]
                skills = {}
                for i in chosen:
                    value, n = skill(metrics, names[i])
                    own = alone[names[i]]["accuracy"]
                    skills[names[i]] = {"accuracy": value, "n": n, "ratio": value / own if own else None,
                                        "meets": value is not None and value >= bound * own}
                ratios = [s["ratio"] for s in skills.values() if s["ratio"] is not None]
                worst = min(ratios) if ratios else None
                results["subsets"].append({"experts": [names[i] for i in chosen], "composition": composition,
                                           "skills": skills, "worst_ratio": worst,
                                           "meets": all(s["meets"] for s in skills.values())})
                print(f"[subsets] {composition} {'+'.join(names[i] for i in chosen)}: worst skill ratio "
                      f"{'–' if worst is None else f'{worst:.3f}'}", flush=True)
    return results


def table(results: dict) -> str:
    """One row per subset and composition: each skill's accuracy (its ratio to the expert alone)."""
    names = list(results["alone"])

    def cell(value: float | None, n: int | None, ratio: float | None = None) -> str:
        if value is None:
            return "–"
        ci = fraction_interval(value, n) if n else None
        text = f"{value:.3f}" + ("" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]")
        return text if ratio is None else f"{text} ({ratio:.2f}×)"

    head = ["experts", "composition", *(f"`{n}`" for n in names), f"all ≥ {results['bound']} × alone"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| " + " | ".join(["each alone", "–", *(cell(a["accuracy"], a["n"]) for a in results["alone"].values()),
                                "–"]) + " |"]
    for s in results["subsets"]:
        cells = [cell(s["skills"][n]["accuracy"], s["skills"][n]["n"], s["skills"][n]["ratio"]) if n in s["skills"]
                 else "" for n in names]
        lines.append("| " + " | ".join([" + ".join(s["experts"]), s["composition"], *cells,
                                        "yes" if s["meets"] else "no"]) + " |")
    met = sum(s["meets"] for s in results["subsets"])
    return "\n".join(lines) + f"\n\n{met} of {len(results['subsets'])} compositions meet the bound " \
                              f"({results['n_test']} rows)."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exports", nargs="+", type=Path, help="the experts' export folders")
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 3], help="subset sizes (the whole set too)")
    parser.add_argument("--composition", nargs="+", choices=["soft", "gated"], default=["gated"])
    parser.add_argument("--limit", type=int, default=None, help="the first N compositional test rows")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--bound", type=float, default=0.9, help="each skill ≥ this × the expert alone")
    parser.add_argument("--test_setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a task setting of the test split (compose.combine --test_setting)")
    parser.add_argument("--metrics", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    import yaml

    if any("=" not in item for item in args.test_setting):
        parser.error(f"--test_setting: expected KEY=VALUE, got {args.test_setting}")
    settings = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.test_setting)}
    from compose.frontends.combine import CombineError

    try:
        results = subset_bounds(args.exports, args.sizes, args.composition, limit=args.limit,
                                batch_size=args.batch_size, bound=args.bound, test_settings=settings)
    except CombineError as e:
        raise SystemExit(f"subset_bounds: {e}") from None
    print(table(results))
    if args.metrics is not None:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
