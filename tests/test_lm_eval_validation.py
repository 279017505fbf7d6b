"""composition.lm_eval (lm-eval tasks at validation), the report's curves of them, and the model cards of exports.

A fast run (configs/debug/fast.yaml) with the local letter tasks of configs/lm_eval; the runner itself on a tiny
model, in one process and split over two gloo ranks.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from compose import ComposedLM  # noqa: E402
from compose.export import verify_export  # noqa: E402
from lightning_modules.pipeline.config import ConfigError, load_config  # noqa: E402
from lightning_modules.pipeline.downstream import LMEvalRunner, flat_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "configs" / "debug" / "fast.yaml"
TASKS = ROOT / "configs" / "lm_eval"
LM_EVAL = ["composition.lm_eval.tasks=[letters_choice,letters_compose]", f"composition.lm_eval.include_path={TASKS}"]
MODELS = ("background", "A_to_B", "C_to_D", "composed")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm_eval_run") / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), str(FAST), f"output_dir={out}", "ablations=[]",
                           "baselines=[]", *LM_EVAL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "letters_choice" not in proc.stdout + proc.stderr  # lm-eval's notes and bars stay off the console
    return out


def logged(out: Path) -> dict[str, list[tuple[int, float]]]:
    with open(out / "logs" / "experts" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("val/lm_eval/") and value:
                series.setdefault(key, []).append((int(row["step"]), float(value)))
    return series


def test_validation_logs_every_task_metric_and_model_at_each_validation(run):
    series = logged(run)
    expected = {f"val/lm_eval/{name}/{model}" for name in ("letters_choice/acc", "letters_compose/acc",
                                                           "letters_compose/perplexity") for model in MODELS}
    assert set(series) == expected
    # fast.yaml: 6 expert steps, validation every 3: the same two steps for every key, beside the composition's
    assert {tuple(step for step, _ in points) for points in series.values()} == {(2, 5)}
    for key, points in series.items():
        for _, value in points:
            assert 0.0 <= value <= 1.0 if key.split("/")[3] == "acc" else value >= 1.0, (key, value)
    header = (run / "logs/experts/metrics.csv").read_text().splitlines()[0]
    assert "val/composed/exact_match" in header and "val/A_to_B/off_mask_kl" in header


def test_logged_scores_are_lm_evals_on_the_final_models(run):
    """The last validation ran after the last step: its scores are lm-eval's on the exported models."""
    export = ComposedLM.from_manifest(run / "export")
    runner = LMEvalRunner(["letters_choice", "letters_compose"], str(TASKS))
    final = {name: points[-1][1] for name, points in logged(run).items()}
    for model, names in (("background", []), ("A_to_B", ["A_to_B"]), ("composed", ["A_to_B", "C_to_D"])):
        composed = ComposedLM.from_peft(export.model, names, tokenizer=export.tokenizer)
        for key, value in runner(composed).items():
            assert final[f"val/lm_eval/{key}/{model}"] == pytest.approx(value, rel=1e-4), (key, model)


def test_report_holds_the_curves(run):
    report = (run / "report.md").read_text()
    assert "## Downstream tasks during training (lm-eval)" in report
    section = report.split("### letters_choice/acc", 1)[1].split("###", 1)[0]
    assert "| step | background | A_to_B | C_to_D | composed |" in section
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()] \
        == ["| 2", "| 5"]
    assert (run / "lm_eval_curves.png").stat().st_size > 0


def shown(value: float | int) -> str:
    """A number as the model card's table shows it."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def test_export_has_a_model_card_and_still_verifies_and_loads(run):
    card = (run / "export" / "README.md").read_text()
    assert card.startswith("---\n") and "\n---\n" in card[4:]
    front = card.split("---\n")[1]
    assert "library_name: peft" in front and "composable-experts" in front
    summary = json.loads((run / "summary.json").read_text())
    assert f"| composition.exact_match | {shown(summary['composition']['exact_match'])} |" in card
    assert f"| experts.C_to_D.off_mask_kl | {shown(summary['experts']['C_to_D']['off_mask_kl'])} |" in card
    assert "timing" not in card and "length." not in card
    assert "| A_to_B | lora | 1 | rules `A→B` |" in card
    verify_export(run / "export")  # the card is outside the checksums
    assert ComposedLM.from_manifest(run / "export").names == ["A_to_B", "C_to_D"]


def test_combined_export_has_a_model_card_and_verifies(run, tmp_path):
    from compose.frontends.combine import combine_exports

    out = tmp_path / "combined"
    result = combine_exports([run / "export"], out, limit=8, batch_size=8)
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "# combined" in card
    assert f"| composition.exact_match | {shown(result['metrics']['exact_match'])} |" in card
    verify_export(out)
    assert ComposedLM.from_manifest(out).names == ["A_to_B", "C_to_D"]


# ---------------------------------------------------------------------------------------------- config errors


def test_missing_include_path_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config([str(FAST)], [LM_EVAL[0], f"composition.lm_eval.include_path={tmp_path / 'nowhere'}"])
    assert "composition.lm_eval.include_path" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override", ["composition.lm_eval.limit=0", "composition.lm_eval.limit=1.5",
                                      "composition.lm_eval.batch_size=0", "composition.lm_eval.tasks=['']"])
def test_bad_values_are_one_line_naming_the_key(override):
    with pytest.raises(ConfigError) as err:
        load_config([str(FAST)], [override])
    assert override.split("=")[0] in str(err.value) and "\n" not in str(err.value)


def test_unknown_task_is_one_line_naming_the_key_before_anything_is_written(tmp_path):
    from lightning_modules.pipeline.stages import plan_run

    out = tmp_path / "run"
    cfg = load_config([str(FAST)], [f"output_dir={out}", "composition.lm_eval.tasks=[letters_choice,no_such_task]",
                                    LM_EVAL[1]])
    with pytest.raises(ConfigError) as err:
        plan_run(cfg)
    message = str(err.value)
    assert message.startswith("composition.lm_eval.tasks:") and "no_such_task" in message
    assert "letters_choice" not in message and "\n" not in message
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- the runner


def tiny_model() -> ComposedLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    from data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return ComposedLM(LlamaForCausalLM(config).eval(), tokenizer=tok)


def test_flat_metrics_names_filters_and_drops_stderr_and_non_numbers():
    results = {"t": {"alias": "t", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": "N/A",
                     "exact_match,strict-match": 1, "ppl,none": float("inf"), "flag,none": True}}
    assert flat_metrics(results) == {"t/acc": 0.5, "t/exact_match.strict-match": 1.0}


def test_runner_equals_lm_eval_and_keeps_the_training_random_state():
    from lm_eval import simple_evaluate

    from compose.frontends.lm_eval import ComposedLMEval, resolve_tasks

    model = tiny_model()
    runner = LMEvalRunner(["letters_*"], str(TASKS), limit=12, batch_size=8)
    random.seed(5)
    torch.manual_seed(5)
    states = random.getstate(), torch.get_rng_state()
    ours = runner(model)
    assert random.getstate() == states[0] and torch.equal(torch.get_rng_state(), states[1])
    names, manager = resolve_tasks(["letters_*"], str(TASKS), include_defaults=False)
    theirs = simple_evaluate(model=ComposedLMEval(composed=model, batch_size=3, device="cpu"), tasks=names,
                             task_manager=manager, limit=12, bootstrap_iters=0)
    assert ours == pytest.approx(flat_metrics(theirs["results"]), rel=1e-6)
    assert set(ours) == {"letters_choice/acc", "letters_compose/acc", "letters_compose/perplexity"}


def _ranked(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from compose.frontends.lm_eval import ComposedLMEval

    scored, score = [], ComposedLMEval._loglikelihood_tokens

    def counting(self, requests, *args, **kwargs):
        scored.append(len(requests))
        return score(self, requests, *args, **kwargs)

    ComposedLMEval._loglikelihood_tokens = counting
    try:
        runner = LMEvalRunner(["letters_choice", "letters_compose"], str(TASKS), limit=9, batch_size=4)
        metrics = runner(tiny_model())
        Path(out, f"{rank}.json").write_text(json.dumps({"metrics": metrics, "scored": sum(scored)}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_the_requests_and_agree_with_one_process(tmp_path):
    """Two gloo ranks, each scoring its share of the requests (lm-eval's rank and world_size): both get the scores
    of one process scoring them all."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ranked, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    one = LMEvalRunner(["letters_choice", "letters_compose"], str(TASKS), limit=9, batch_size=4)(tiny_model())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["metrics"] == pytest.approx(one, rel=1e-5)
        # 9 rows, 4 choices + 1 continuation each: rank 0 scores rows 0, 2, .., 8, rank 1 rows 1, 3, 5, 7 and pads
        # to as many requests (lm-eval keeps the ranks in step)
        assert result["scored"] == 25
