"""train.py end to end on configs/debug/fast.yaml, and its handling of bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_modules.pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
FAST = ROOT / "configs" / "debug" / "fast.yaml"


def train(*args, cwd=ROOT, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fast") / "run"
    proc = train(FAST, f"output_dir={out}", "trainer.enable_progress_bar=true")  # the console a default run shows
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


# What libraries print on every stage although nothing is wrong (lightning_modules/pipeline/console.py).
CONSOLE_NOISE = ("GPU available", "TPU available", "💡 Tip", "litlogger", "was configured so", "weights_only",
                 "FutureWarning", "is_gradient_checkpointing", "LeafSpec", "in eval mode", "does not have many workers",
                 "Loading weights", "Writing model shards", "Epoch ", "/-2", "`Trainer.fit` stopped")


def test_fast_run_console_is_stage_lines_progress_bars_summary_and_report(fast_run):
    out, proc = fast_run
    printed = proc.stdout + proc.stderr
    for noise in CONSOLE_NOISE:
        assert noise not in printed, noise
    lines = [line.strip() for line in printed.replace("\r", "\n").splitlines() if line.strip()]
    stages = [line.split("]", 1)[0] + "]" for line in lines if line.startswith("[")]
    for stage in ("[background]", "[experts]", "[composition]", "[baselines]", "[ablations]"):
        assert stage in stages, stage
    # one bar per training stage, counting its optimizer steps (fast.yaml: 10 background, 6 expert steps)
    assert any(line.startswith("background: 100%") and "10/10" in line for line in lines)
    assert any(line.startswith("experts: 100%") and "6/6" in line for line in lines)
    assert "| component | exact match |" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"report: {out / 'report.md'}")


def test_fast_run_writes_everything(fast_run):
    out, proc = fast_run
    for name in ("config.yaml", "summary.json", "report.md", "divergence_map.json", "tokenizer",
                 "background/model.safetensors", "export/composition.yaml",
                 "checkpoints/background/last.ckpt", "checkpoints/experts/last.ckpt",
                 "logs/background/metrics.csv", "logs/experts/metrics.csv"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["background"]["exact_match"] <= 1.0
    assert (summary["experiment"], summary["task"]) == ("debug_fast", "letters")
    for name in ("A_to_B", "C_to_D"):
        assert 0.0 <= summary["experts"][name]["exact_match"] <= 1.0
        assert summary["experts"][name]["off_mask_kl"] >= 0.0
        assert 0.0 <= summary["experts"][name]["active_precision"] <= 1.0
        assert 0.0 <= summary["experts"][name]["active_recall"] <= 1.0
    assert 0.0 <= summary["composition"]["exact_match"] <= 1.0
    assert "task_arithmetic" in summary["baselines"]
    for k in ("2", "3"):
        assert 0.0 <= summary["ablations"]["plain"]["k"][k]["exact_match"] <= 1.0
    k3 = json.loads((out / "ablations/plain_k3/summary.json").read_text())
    assert sorted(k3["experts"]) == ["A_to_B", "C_to_D", "E_to_F"] and k3["composition"]["k"] == 3
    assert str(out) in proc.stdout  # the run ends by printing where it wrote
    # validation logged the composition alongside the experts' factorizability
    header = (out / "logs/experts/metrics.csv").read_text().splitlines()[0]
    for key in ("val/composed/exact_match", "val/composed/nll", "val/A_to_B/off_mask_kl", "val/C_to_D/on_mask_kl",
                "train/A_to_B/nll", "train/C_to_D/off_mask_kl", "val/composed/projectivity_error"):
        assert key in header, key
    cfg = load_config([str(out / "config.yaml")])
    assert cfg.experiment == "debug_fast" and (cfg.task.name, cfg.task.n_train) == ("letters", 256)
    from compose.export import load_manifest

    manifest = load_manifest(out / "export")
    assert manifest["extra"]["task"] == "letters"
    assert [(e["name"], e["spec"]) for e in manifest["experts"]] == [("A_to_B", {"rules": {"A": "B"}}),
                                                                      ("C_to_D", {"rules": {"C": "D"}})]


def test_export_reloads_with_the_same_composed_logprobs(fast_run):
    """The manifest's composition equals the trained model's, as checkpointed just before export."""
    from compose import ComposedLM
    from data.collate import Collator
    from data.tasks.letters import RuleSet, build_letters_dataset, compositional_inputs
    from data.tokenizer import letter_ids
    from lightning_modules.expert import ExpertLM
    from lightning_modules.pipeline.build import expert_settings
    from lightning_modules.pipeline.models import load_pretrained

    out, _ = fast_run
    cfg = load_config([str(out / "config.yaml")])
    reloaded = ComposedLM.from_manifest(out / "export")
    assert reloaded.names == ["A_to_B", "C_to_D"]
    module = ExpertLM(load_pretrained(out / "background"), ["A_to_B", "C_to_D"], expert_settings(cfg))
    state = torch.load(out / "checkpoints/experts/last.ckpt", map_location="cpu", weights_only=True)
    module.load_state_dict(state["state_dict"])
    rules = [RuleSet("A_to_B", {"A": "B"}), RuleSet("C_to_D", {"C": "D"})]
    tok = reloaded.tokenizer
    xs = compositional_inputs(8, cfg.task.alphabet, 8, 16, 123, rules)
    batch = Collator(tok.pad_token_id, letter_ids(tok, cfg.task.alphabet))(list(build_letters_dataset(xs, rules, rules, tok)))
    before = module.composed_model().score(batch["input_ids"], batch["attention_mask"])
    after = reloaded.score(batch["input_ids"], batch["attention_mask"])
    assert (before - after).abs().max() < 1e-5
    separate = ComposedLM.from_manifest(out / "export", backend="separate")
    assert (separate.score(batch["input_ids"], batch["attention_mask"]) - after).abs().max() < 1e-5


def test_resume_from_last_checkpoint_skips_finished_stages(fast_run, tmp_path):
    out, _ = fast_run
    summary_before = json.loads((out / "summary.json").read_text())
    proc = train(FAST, f"output_dir={out}", "ckpt_path=last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["composition"]["exact_match"] == summary_before["composition"]["exact_match"]
    assert summary["timing"]["background_s"] < 5  # the background was not trained again


def test_bad_input_exits_2_with_one_line_naming_it(tmp_path):
    proc = train(FAST, "expert.reg_wieght=1", f"output_dir={tmp_path / 'x'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: command line: unknown config key 'expert.reg_wieght'")
    assert not (tmp_path / "x").exists()


def test_existing_output_dir_is_not_touched(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    cfg = load_config([str(FAST)], [f"output_dir={out}"], base=DEFAULT)
    from lightning_modules.pipeline.stages import run

    with pytest.raises(ConfigError, match="exists and is not empty"):
        run(cfg)
    assert (out / "precious.txt").read_text() == "keep" and len(list(out.iterdir())) == 1


@pytest.mark.parametrize("override,message", [
    ("experts=[{name: a, rules: {A: B}}, {name: b, rules: {A: C}}]", "'A'"),
    ("experts=[{name: a, rules: {A: BB}}]", "BB"),
    ("experts=[{name: a, rules: {A: '1'}}]", "'1'"),
    ("background.path=/nonexistent/model", "/nonexistent/model"),
    ("composition.compose_with=[/nonexistent/export]", "/nonexistent/export"),
    ("ablation_ks=[20]", "k=20"),
    ("experts=[{name: a, interval: {start: '[', end: ']'}}]", "expert 'a': the letters task needs `rules`"),
    ("task.compositional_min_experts=3", "compositional_min_experts=3 exceeds the 2 experts in play"),
])
def test_bad_experiments_are_refused_before_writing(tmp_path, override, message):
    from lightning_modules.pipeline.stages import run

    out = tmp_path / "run"
    cfg = load_config([str(FAST)], [f"output_dir={out}", "ablations=[]", override], base=DEFAULT)  # see test_bad_input
    with pytest.raises(ConfigError, match=message):
        run(cfg)
    assert not out.exists()


def test_compose_with_an_export_of_another_tokenizer_is_refused(fast_run, tmp_path):
    from lightning_modules.pipeline.stages import run

    out, _ = fast_run
    cfg = load_config([str(FAST)], [f"output_dir={tmp_path / 'r'}", "task.alphabet=ABCDEFGH",
                                     "experts=[{name: E_to_F, rules: {E: F}}]",
                                     f"composition.compose_with=[{out / 'export'}]", "ablations=[]",
                                     f"background.path={out / 'background'}"], base=DEFAULT)
    with pytest.raises(ConfigError, match="tokenizer of .* differs"):
        run(cfg)
    assert not (tmp_path / "r").exists()


def test_readme_composition_example_runs_on_an_export(fast_run, capsys):
    out, _ = fast_run
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- example: compose-export -->", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [f'export = "{out / "export"}"' if line.startswith("export = ") else line for line in block.splitlines()]
    exec("\n".join(lines), {})
    printed = capsys.readouterr().out.splitlines()
    decoded = eval(printed[0])  # noqa: S307 - our own printed list of (text, ended) pairs
    assert len(decoded) == 2 and all(isinstance(t, str) and isinstance(e, bool) for t, e in decoded)
    assert printed[1] == "['A_to_B', 'C_to_D'] [1.0, 1.0]"


def test_resume_continues_an_interrupted_stage_from_its_last_checkpoint(fast_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(fast_run[0], out)
    shutil.rmtree(out / "background")  # as if the run died after the background's last checkpoint
    shutil.rmtree(out / "export")
    proc = train(FAST, f"output_dir={out}", "ckpt_path=last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Restoring states from the checkpoint path" in proc.stderr + proc.stdout
    state = torch.load(out / "checkpoints/background/last.ckpt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 10 and state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches": 10}]
    assert (out / "background/model.safetensors").is_file() and (out / "export/composition.yaml").is_file()
    before, after = (json.loads((d / "summary.json").read_text()) for d in (fast_run[0], out))
    assert after["composition"] == before["composition"] and after["experts"] == before["experts"]


def test_resume_with_a_changed_config_is_refused_naming_the_keys(fast_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(fast_run[0], out)
    shutil.rmtree(out / "background")
    config = (out / "config.yaml").read_text()
    proc = train(FAST, f"output_dir={out}", "ckpt_path=last", "model.hidden_size=48", "expert.lora.r=4")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ckpt_path=last:") and "model.hidden_size (32 -> 48)" in last
    assert "expert.lora.r (2 -> 4)" in last  # the experts are exported: their keys are fixed too
    assert "Traceback" not in proc.stderr
    assert (out / "config.yaml").read_text() == config and (out / "export/composition.yaml").is_file()


def test_checkpoint_that_does_not_match_the_config_is_a_clear_error(fast_run, tmp_path):
    out = tmp_path / "run"
    ckpt = fast_run[0] / "checkpoints/background/last.ckpt"
    proc = train(FAST, f"output_dir={out}", f"ckpt_path={ckpt}", "model.hidden_size=48", "ablations=[]")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint") and "does not match the config" in last


def test_overlapping_experts_run_when_allowed_and_are_marked(tmp_path):
    from lightning_modules.pipeline.stages import run

    cfg = load_config([str(FAST)], [f"output_dir={tmp_path / 'run'}", "ablations=[]", "baselines=[]",
                                     "experts=[{name: a, rules: {A: B}}, {name: b, rules: {A: B, C: D}}]",
                                     "composition.allow_overlap=true"], base=DEFAULT)
    summary = run(cfg)
    assert summary["composition"]["notes"] == ["source letter 'A' is shared by experts 'a' and 'b'"]
    assert "Notes from the task" in (tmp_path / "run" / "report.md").read_text()


def test_a_new_expert_composes_with_an_earlier_export(fast_run, tmp_path):
    """Experts trained at different times: E_to_F trains alone, validated and tested with A_to_B, C_to_D."""
    from lightning_modules.pipeline.stages import run

    out, _ = fast_run
    common = [f"composition.compose_with=[{out / 'export'}]", "ablations=[]", "baselines=[]",
              "experts=[{name: E_to_F, rules: {E: F}}]"]
    with pytest.raises(ConfigError, match="set background.path"):
        run(load_config([str(FAST)], [f"output_dir={tmp_path / 'a'}", *common], base=DEFAULT))
    other = _other_background(out, tmp_path / "other_background")
    with pytest.raises(ConfigError, match="differs from background.path"):
        run(load_config([str(FAST)], [f"output_dir={tmp_path / 'b'}", *common, f"background.path={other}"],
                        base=DEFAULT))
    summary = run(load_config([str(FAST)], [f"output_dir={tmp_path / 'c'}", *common,
                                            f"background.path={out / 'background'}"], base=DEFAULT))
    assert summary["composition"]["k"] == 3
    assert summary["experts"]["A_to_B"]["trained_in"] == "compose_with"
    assert "exact_match" in summary["experts"]["E_to_F"]
    header = (tmp_path / "c/logs/experts/metrics.csv").read_text().splitlines()[0]
    assert "val/composed/A_to_B/skill_accuracy" in header and "val/composed/E_to_F/skill_accuracy" in header


def _other_background(run_dir, dest):
    """A background folder with the same architecture but different weights."""
    from lightning_modules.pipeline.models import load_pretrained

    model = load_pretrained(run_dir / "background")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(dest)
    return dest


def test_plan_names_trained_and_frozen_experts_without_writing(fast_run, tmp_path):
    from data.tasks.letters import LettersTask
    from lightning_modules.pipeline.stages import plan_run

    out, _ = fast_run
    cfg = load_config([str(FAST)], [f"output_dir={tmp_path / 'p'}", f"composition.compose_with=[{out / 'export'}]",
                                    f"background.path={out / 'background'}", "ablations=[]",
                                    "experts=[{name: E_to_F, weight: 0.5, rules: {E: F}}]"], base=DEFAULT)
    plan = plan_run(cfg)
    assert (plan.trained, plan.frozen, plan.in_play) == (["E_to_F"], ["A_to_B", "C_to_D"], ["E_to_F", "A_to_B", "C_to_D"])
    assert isinstance(plan.task, LettersTask) and plan.task.expert_names == plan.in_play
    assert plan.task.trained == ["E_to_F"] and plan.task.reg_data == cfg.expert.reg_data
    assert plan.specs == {"E_to_F": {"rules": {"E": "F"}}, "A_to_B": {"rules": {"A": "B"}}, "C_to_D": {"rules": {"C": "D"}}}
    assert plan.weights == {"E_to_F": 0.5, "A_to_B": 1.0, "C_to_D": 1.0}
    assert set(plan.frozen_adapters) == {"A_to_B", "C_to_D"}
    assert all(Path(p).is_dir() for p in plan.frozen_adapters.values())
    assert plan.tokenizer is plan.task.tokenizer
    assert not (tmp_path / "p").exists()


def test_load_pretrained_accepts_a_larger_vocabulary_and_refuses_a_smaller_one(tmp_path):
    """Pretrained checkpoints pad their embedding tables: more rows than the tokenizer has is fine."""
    from data.tokenizer import build_char_tokenizer
    from lightning_modules.pipeline.config import ModelConfig
    from lightning_modules.pipeline.models import build_causal_lm, load_pretrained

    small, large = build_char_tokenizer("ABCDEFGH"), build_char_tokenizer()
    tiny = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    build_causal_lm(tiny, large).save_pretrained(tmp_path / "large")
    build_causal_lm(tiny, small).save_pretrained(tmp_path / "small")
    model = load_pretrained(tmp_path / "large", small)
    assert model.get_output_embeddings().weight.shape[0] == len(large) == 31 > len(small) == 13
    assert load_pretrained(tmp_path / "small", small).get_output_embeddings().weight.shape[0] == 13
    with pytest.raises(ConfigError, match="small: the model's vocabulary has 13 tokens, fewer than the tokenizer's 31"):
        load_pretrained(tmp_path / "small", large)
    with pytest.raises(ConfigError, match="no HF model folder at"):
        load_pretrained(tmp_path / "missing", small)


def test_margin_decomposition_script_runs_on_a_finished_run(fast_run):
    out, _ = fast_run
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "margin_decomposition.py"), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(f"{out}: ") and "mask positions" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["owner", "others", "composed"]
