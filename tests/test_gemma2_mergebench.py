"""scripts/gemma2_mergebench.py end to end with tiny stand-ins: the committed config, with its data root moved to
a temporary folder holding random Llama "Gemma-2-2B" and "MergeBench experts", two HumanEval+-style and two
MBPP+-style problems, and local lm-eval tasks (a GSM8K-like task and a MATH-like group over JSON files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from compose import code_eval  # noqa: E402
from compose.frontends.model_folders import compose_folders  # noqa: E402
from scripts.gemma2_mergebench import load_config, main, mbppplus_problems  # noqa: E402
from tests.tiny_code_models import PROBLEMS, code_tokenizer, tiny_llama, write_problems  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "experiment" / "gemma2_mergebench.yaml"
SYSTEMS = ["background", "coding", "math", "composition", "task_arithmetic"]
LABELS = ["HumanEval+ pass@1", "MBPP+ pass@1", "GSM8K (8-shot)", "MATH (4-shot)"]
MBPP_ROWS = [
    {"task_id": 2, "prompt": "Write a function to add two numbers.", "code": "def add_nums(a, b):\n    return a + b\n",
     "test_list": ["assert add_nums(1, 2) == 3"], "test_imports": [], "source_file": "x",
     "test": "inputs = [[1, 2], [3, 4]]\nresults = [3, 7]\nfor inp, exp in zip(inputs, results):\n"
             "    assert add_nums(*inp) == exp\n"},
    {"task_id": 3, "prompt": "Write a function for the square root.", "source_file": "x",
     "code": "import math\ndef helper(x):\n    return x\ndef root(x):\n    return math.sqrt(helper(x))\n",
     "test_list": ["assert math.isclose(root(4), 2.0)"], "test_imports": ["import math"],
     "test": "assert math.isclose(root(9), 3.0)\n"},
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The script sets these (setdefault) for the offline GPU machine; here they are undone after each test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def write_tasks(folder: Path) -> None:
    """A GSM8K-like task (strict-match filter) and a MATH-like group of two subtasks, over local JSONL."""
    folder.mkdir()
    gsm = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
           {"question": "Ann has 5 pens and loses 2. How many?", "answer": "5 - 2 = 3\n#### 3"}]
    (folder / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    math = [{"problem": "What is $2+2$?", "answer": "4"}, {"problem": "What is $3 \\cdot 3$?", "answer": "9"}]
    (folder / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math))

    def source(name: str) -> str:
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    train: {folder / name}\n"
                f"    test: {folder / name}\ntraining_split: train\nfewshot_split: train\ntest_split: test\n"
                "output_type: generate_until\n")

    (folder / "tiny_gsm8k.yaml").write_text(
        "task: tiny_gsm8k\n" + source("gsm.jsonl") + "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"Question:\"]\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\nfilter_list:\n  - name: strict-match\n    filter:\n"
        "      - function: regex\n        regex_pattern: \"#### (\\\\-?[0-9\\\\.\\\\,]+)\"\n"
        "      - function: take_first\n")
    for part in ("a", "b"):
        (folder / f"tiny_math_{part}.yaml").write_text(
            f"task: tiny_math_{part}\n" + source("math.jsonl") + "doc_to_text: \"Problem: {{problem}}\\nAnswer:\"\n"
            "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"Problem:\"]\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")
    (folder / "tiny_math.yaml").write_text(
        "group: tiny_math\ntask:\n  - tiny_math_a\n  - tiny_math_b\naggregate_metric_list:\n"
        "  - metric: exact_match\n    aggregation: mean\n    weight_by_size: true\n")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """The config's layout: models/, evalplus/, and (ours) tasks/."""
    root = tmp_path_factory.mktemp("mergebench")
    tok = code_tokenizer()
    for seed, name in enumerate(["gemma-2-2b", "gemma-2-2b_coding", "gemma-2-2b_math"]):
        tiny_llama(len(tok), seed).save_pretrained(root / "models" / name)
        if name != "gemma-2-2b_math":  # an expert may ship its tokenizer (it must be the background's) or not
            tok.save_pretrained(root / "models" / name)
    (root / "evalplus").mkdir()
    write_problems(root / "evalplus" / "humanevalplus.jsonl", PROBLEMS[:2])
    (root / "evalplus" / "mbppplus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MBPP_ROWS))
    write_tasks(root / "tasks")
    return root


def argv(root: Path, out: Path, *extra: str) -> list[str]:
    return [str(CONFIG), f"data_root={root}", f"output_dir={out}", "device=cpu", "dtype=float32",
            "attn_implementation=null", "hf_home=null", "max_new_tokens=6", "batch_size=2", "code.workers=1",
            "code.timeout_s=10", f"lm_eval.include_path={root / 'tasks'}", "lm_eval.include_defaults=false", "lm_eval.batch_size=2",
            "lm_eval.tasks.gsm8k.task=tiny_gsm8k", "lm_eval.tasks.gsm8k.num_fewshot=1",
            "lm_eval.tasks.minerva_math.task=tiny_math", *extra]


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_dry_run_writes_the_table_with_every_row_and_column(data_root, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(argv(data_root, out)) == 0
    printed = capsys.readouterr().out
    rows = table_rows((out / "table.md").read_text())
    header, body = rows[0], rows[1:]
    assert header == ["benchmark", "n", "background", "background (paper)", "coding", "coding (paper)", "math",
                      "math (paper)", "composition", "composition (paper)", "task_arithmetic"]
    assert [r[0] for r in body] == LABELS
    paper = load_config(CONFIG, [f"data_root={data_root}"]).paper
    for row, key, n in zip(body, ["humaneval_plus", "mbpp_plus", "gsm8k", "minerva_math"], [2, 2, 2, 4], strict=True):
        assert row[1] == str(n)  # two problems or examples each; the MATH-like group has two subtasks
        cells = dict(zip(header, row, strict=True))
        for system in SYSTEMS:
            assert 0.0 <= float(cells[system]) <= 100.0
            if system != "task_arithmetic":
                assert float(cells[f"{system} (paper)"]) == paper[key][system]
    assert "| HumanEval+ pass@1 | 2 |" in printed and "3.7" in printed
    results = json.loads((out / "results.json").read_text())["scores"]
    assert set(results) == set(SYSTEMS)
    for system in SYSTEMS:
        assert set(results[system]) == {"humaneval_plus", "mbpp_plus", "gsm8k", "minerva_math"}
        assert results[system]["gsm8k"]["metric"] == "exact_match,strict-match"
        samples = code_eval.read_samples(out / "samples" / system / "mbpp_plus.jsonl")
        assert [s["task_id"] for s in samples] == ["Mbpp/2", "Mbpp/3"]
    # A second run reuses every score and loads no model.
    assert main(argv(data_root, out)) == 0
    printed = capsys.readouterr().out
    assert printed.count(": cached ") == 20 and "loading the background" not in printed


def test_the_composition_is_built_from_the_folders(data_root):
    models = data_root / "models"
    composed = compose_folders(models / "gemma-2-2b", {"coding": models / "gemma-2-2b_coding",
                                                        "math": models / "gemma-2-2b_math"}, dtype="float32")
    assert composed.backend == "separate" and composed.names == ["coding", "math"]
    assert composed.tokenizer is not None and len(composed.tokenizer) == 200


def test_mbppplus_rows_become_runnable_problems():
    problems = mbppplus_problems(MBPP_ROWS)
    assert list(problems) == ["Mbpp/2", "Mbpp/3"]
    assert problems["Mbpp/3"]["entry_point"] == "root"  # the function the first assertion calls
    assert problems["Mbpp/2"]["prompt"] == '"""\nWrite a function to add two numbers.\nassert add_nums(1, 2) == 3\n"""\n'
    canonical = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in problems.items()]
    wrong = [{"task_id": "Mbpp/2", "completion": "def add_nums(a, b):\n    return a - b\n"},
             {"task_id": "Mbpp/3", "completion": "def helper(x):\n    return x\n"}]
    evaluation = code_eval.evaluate_samples(canonical + wrong, problems, workers=1, timeout_s=10)
    assert [r["passed"] for r in evaluation["samples"]] == [True, True, False, False]
    with pytest.raises(ValueError, match="lacks"):
        mbppplus_problems([{"task_id": 1, "prompt": "x"}])


@pytest.mark.parametrize("extra, needle", [
    (["experts.math={root}/models/nowhere"], "expert 'math' {root}/models/nowhere: no such folder"),
    (["background={root}/evalplus"], "background {root}/evalplus: not a Hugging Face model folder"),
    (["code.benchmarks.mbpp_plus.problems={root}/missing.jsonl"], "no such file {root}/missing.jsonl"),
    (["lm_eval.tasks.gsm8k.task=no_such_task"], "unknown lm-eval task(s) no_such_task"),
    (["systems=[background,physics]"], "unknown system 'physics'"),
])
def test_bad_input_is_one_line_before_loading(data_root, tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(argv(data_root, out, *[e.format(root=data_root) for e in extra])) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle.format(root=data_root) in lines[0], captured.err
    assert "loading the background" not in captured.out and not out.exists()
