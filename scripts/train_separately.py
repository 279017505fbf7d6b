"""Experts that never met: train each expert of a config in its own run and process, then compose the exports.

    python scripts/train_separately.py configs/experiment/letters_k8.yaml --out runs/modular_k8_s0 seed=0 \
        [--subsets 2,4 --draws 3] [--late "{name: Q_to_R, rules: {Q: R}}" --late_seed 100] [KEY=VALUE ...]

1. The first expert's run trains the background (`python train.py CONFIG experts=[<first>] output_dir=OUT/runs/
   <first>`); every other expert gets a run of its own that loads it (`background.path=OUT/runs/<first>/
   background`). A config whose `background.path` names a pretrained background gives it to every run as is. Each run sees only the background, its own rule and the config's data settings: no
   `compose_with`, no other expert's rules (`expert.reg_data=composition` is refused: it would apply them).
2. `compose.combine` checks the exports fit together and evaluates their composition on the task's compositional
   test set; the combined export is written to `OUT/combined`. `--compare gated,alone,task_arithmetic,ties,dare`
   decodes the same rows with each of these too (`compose.combine --compare`). `--train_only` stops after the
   runs; `--run_test_limit N` lets each one-expert run decode only N compositional rows (the combination decodes
   them all); `--jobs N` trains N runs at once (the first alone when it trains the background).
3. `--subsets 2,4`: `--draws` random subsets of each size (seeded by the seed), each composed and evaluated.
4. `--late SPEC`: an expert trained afterwards, in a new run with `seed=--late_seed`, joins the combined
   export (`OUT/combined_late`), as an expert trained a week later would; `--late_test_setting
   compositional=[FILE]` tests that composition on rows needing its skill too.

Runs that finished (their `summary.json` exists) are not trained again, so an interrupted call resumes. Prints a
table and writes `OUT/separate.json`: each expert alone (exact match on its own test rows), and every
composition's exact match.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def expert_node(spec: dict) -> str:
    """An expert as a one-item `experts=[...]` override."""
    return "experts=[" + yaml.safe_dump(spec, default_flow_style=True, width=10**6).strip() + "]"


def _say(line: str) -> None:
    """One whole console line: runs trained at once print from threads, and `print` writes its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train_one(config: str, overrides: list[str], spec: dict, out: Path, background: Path | None,
              seed: int | None = None, test_limit: int | None = None, log: bool = False) -> dict:
    """One expert, one run, one process; returns its `summary.json`. `log`: its console goes to `OUT.log` beside
    the run (runs trained at once would interleave theirs)."""
    summary = out / "summary.json"
    if not summary.is_file():
        cmd = [sys.executable, str(ROOT / "train.py"), config, *overrides, expert_node(spec), f"output_dir={out}",
               "ablations=[]", "baselines=[]", "composition.compose_with=[]", "composition.gated=false",
               *([f"composition.test_limit={test_limit}"] if test_limit else [])]
        if background is not None:
            cmd.append(f"background.path={background}")
        if seed is not None:
            cmd.append(f"seed={seed}")
        _say(f"[separately] {spec['name']}: {' '.join(cmd[1:])}")
        if not log:
            subprocess.run(cmd, check=True, cwd=ROOT)
            return json.loads(summary.read_text())
        path = out.parent / f"{out.name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        _say(f"[separately] {spec['name']}: console in {path}")
        with open(path, "a") as console:
            code = subprocess.run(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT).returncode
        if code:
            tail = path.read_text(errors="replace").strip().splitlines()[-5:]
            raise SystemExit(f"train_separately: the run of {spec['name']!r} failed (exit {code}); the end of its "
                             f"console ({path}):\n" + "\n".join(tail))
    return json.loads(summary.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="a train.py config whose `experts` are trained one per run")
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs, exports and results")
    parser.add_argument("--subsets", default="", help="comma-separated subset sizes to compose as well")
    parser.add_argument("--draws", type=int, default=3, help="random subsets per size")
    parser.add_argument("--late", default=None, help="an expert (YAML mapping) trained afterwards that joins")
    parser.add_argument("--late_seed", type=int, default=None, help="its run's seed (default: the seed + 1000)")
    parser.add_argument("--late_test_setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a task setting of the late composition's test split (compose.combine --test_setting), "
                             "e.g. compositional=[rows needing the late expert's skill too]")
    parser.add_argument("--limit", type=int, default=None, help="compositional test rows to evaluate (default all)")
    parser.add_argument("--compare", default="", metavar="M1,M2",
                        help="comma-separated: also decode the combination's test rows with these (compose.combine "
                             "--compare: gated, alone, background, task_arithmetic, ties, dare)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, each its own process (give each trainer.threads=1 on a small "
                             "CPU)")
    parser.add_argument("--train_only", action="store_true",
                        help="train (or find) the runs and stop: compose them later with compose.combine")
    parser.add_argument("--run_test_limit", type=int, default=None,
                        help="compositional test rows each one-expert run decodes (composition.test_limit; "
                             "default all): the combination is evaluated on all of them")
    args, overrides = parser.parse_known_args(argv)
    args.compare = [m for m in args.compare.split(",") if m]
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1")
    if any("=" not in o for o in overrides):
        parser.error(f"unrecognized arguments: {' '.join(o for o in overrides if '=' not in o)} (overrides are KEY=VALUE)")

    from compose.frontends.combine import COMPARE_METHODS, combine_exports

    if any(not item.partition("=")[0] or "=" not in item for item in args.late_test_setting):
        parser.error(f"--late_test_setting: expected KEY=VALUE, got {args.late_test_setting}")
    unknown = [m for m in args.compare if m not in COMPARE_METHODS]
    if unknown:
        parser.error(f"--compare: unknown method(s) {', '.join(unknown)}; known: {', '.join(COMPARE_METHODS)}")
    from lightning_modules.pipeline.config import ConfigError, load_config

    try:
        cfg = load_config([args.config], overrides, base=ROOT / "configs" / "default.yaml")
    except ConfigError as e:
        raise SystemExit(f"train_separately: {e}") from None
    if cfg.expert.reg_data == "composition":
        raise SystemExit("train_separately: expert.reg_data=composition applies every expert's rules to each "
                         "expert's rows; experts trained separately must not see them (use own, background or "
                         "own+background)")
    from omegaconf import OmegaConf

    specs = [{k: v for k, v in OmegaConf.to_container(e).items() if v not in (None, [])} for e in cfg.experts]
    runs = args.out / "runs"
    first = runs / specs[0]["name"]
    trained_background = not cfg.background.path  # a pretrained background (background.path) is every run's own

    def train(spec: dict) -> dict:
        out = runs / spec["name"]
        return train_one(args.config, overrides, spec, out,
                         first / "background" if trained_background and out != first else None,
                         test_limit=args.run_test_limit, log=args.jobs > 1)

    # The first run trains the background the others load: it goes alone; the rest, `--jobs` at a time.
    done = [train(specs[0])] if trained_background else []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done += list(pool.map(train, specs[len(done):]))
    summaries = {spec["name"]: summary for spec, summary in zip(specs, done, strict=True)}
    if args.train_only:
        print(f"[separately] trained: {', '.join(summaries)} (runs in {runs})")
        return {"alone": {n: s["experts"][n]["exact_match"] for n, s in summaries.items()}}
    exports = {name: runs / name / "export" for name in summaries}
    results: dict = {"config": args.config, "overrides": overrides, "seed": cfg.seed,
                     "alone": {n: s["experts"][n]["exact_match"] for n, s in summaries.items()},
                     "alone_skill_accuracy": {n: s["experts"][n].get("skill_accuracy_alone")
                                              for n, s in summaries.items()}, "compositions": []}

    def compose(names: list[str], paths: list[Path], out: Path | None = None, compare: list[str] = (),
                test_settings: dict | None = None) -> float:
        kwargs: dict = {"overwrite": True} if out is not None else {}
        if compare:
            kwargs["compare_with"] = compare
        if test_settings:
            kwargs["test_settings"] = dict(test_settings)
        min_len = OmegaConf.select(cfg, "task.min_len")
        if min_len is not None and len(names) > min_len and OmegaConf.select(cfg, "task.compositional_min_experts") \
                is None:  # every expert's source in every test input: the shortest inputs must hold them all
            kwargs["test_settings"] = {**kwargs.get("test_settings", {}), "min_len": len(names)}
            print(f"[separately] k={len(names)}: test inputs of {len(names)}–{cfg.task.max_len} letters "
                  f"(task.min_len={min_len} cannot hold {len(names)} sources)", flush=True)
        r = combine_exports(paths, out, limit=args.limit, **kwargs)
        em = r["metrics"]["exact_match"]
        results["compositions"].append({"experts": names, "k": len(names), "exact_match": em, "n_test": r["n_test"],
                                        **({"test_settings": kwargs["test_settings"]} if "test_settings" in kwargs
                                           else {}), "metrics": r["metrics"],
                                        **({"compare": r["compare"]} if "compare" in r else {})})
        print(f"[separately] k={len(names)} {'+'.join(names)}: exact_match={em:.4f} (n={r['n_test']})", flush=True)
        return em

    combined = args.out / "combined"
    compose(list(exports), list(exports.values()), combined, args.compare)
    rng = random.Random(cfg.seed)
    for size in [int(s) for s in args.subsets.split(",") if s]:
        for _ in range(args.draws):
            names = sorted(rng.sample(list(exports), size), key=list(exports).index)
            compose(names, [exports[n] for n in names])
    if args.late:
        spec = yaml.safe_load(args.late)
        late_seed = cfg.seed + 1000 if args.late_seed is None else args.late_seed
        s = train_one(args.config, overrides, spec, runs / spec["name"],
                      first / "background" if trained_background else None, late_seed, args.run_test_limit)
        results["alone"][spec["name"]] = s["experts"][spec["name"]]["exact_match"]
        results["alone_skill_accuracy"][spec["name"]] = s["experts"][spec["name"]].get("skill_accuracy_alone")
        results["late"] = {"name": spec["name"], "seed": late_seed}
        late_settings = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.late_test_setting)}
        compose([*exports, spec["name"]], [combined, runs / spec["name"] / "export"], args.out / "combined_late",
                args.compare, late_settings)
    (args.out / "separate.json").write_text(json.dumps(results, indent=2) + "\n")
    print("[separately] alone: " + ", ".join(f"{n} {v:.4f}" for n, v in results["alone"].items()))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
