"""The text task end to end through train.py (fixture rows, byte-level BPE, a tiny model), pretrained folders
with padded embedding tables, and the text task's bad input at the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "configs" / "experiment" / "text_fast.yaml"
FIXTURE = ROOT / "tests" / "fixtures" / "text"
# A few steps: the point is the whole pipeline on text rows, not accuracy.
FAST = ["background.max_steps=12", "expert.max_steps=6", "trainer.val_check_interval=6",
        "trainer.enable_progress_bar=false", "composition.val_limit=4"]


def train(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("text") / "run"
    proc = train(TEXT, *FAST, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_text_run_writes_the_summary_contract(text_run):
    s = json.loads((text_run / "summary.json").read_text())
    assert s["task"] == "text"
    assert 0.0 <= s["background"]["exact_match"] <= 1.0
    for name in ("calc", "upper"):
        e = s["experts"][name]
        assert 0.0 <= e["exact_match"] <= 1.0 and e["off_mask_kl"] >= 0.0
        assert 0.0 <= e["skill_accuracy"] <= 1.0
    c = s["composition"]
    assert c["k"] == 2 and c["n_test"] >= 1 and 0.0 <= c["exact_match"] <= 1.0 and c["nll"] > 0
    assert 0.0 <= c["gated"]["exact_match"] <= 1.0  # experts with intervals are also composed gated
    assert (text_run / "report.md").is_file() and (text_run / "divergence_heatmap.png").is_file()
    header = (text_run / "logs/experts/metrics.csv").read_text().splitlines()[0]
    for key in ("val/composed/exact_match", "val/composed/calc/off_mask_kl", "val/calc/off_mask_kl"):
        assert key in header, key


def test_the_final_evaluation_can_skip_the_gated_pass_and_decode_fewer_rows(tmp_path):
    """`composition.gated=false` and `composition.test_limit`: what the one-expert runs of train_separately use."""
    out = tmp_path / "run"
    proc = train(TEXT, *FAST, "composition.gated=false", "composition.test_limit=2", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((out / "summary.json").read_text())["composition"]
    assert c["n_test"] == 2 and c["exact_match_n"] == 2 and "gated" not in c


def test_text_export_records_intervals_and_composes_gated_with_no_user_code(text_run):
    import torch

    from compose import ComposedLM

    manifest = yaml.safe_load((text_run / "export/composition.yaml").read_text())
    specs = {e["name"]: e["spec"] for e in manifest["experts"]}
    assert specs["calc"] == {"interval": {"start": "<<", "end": ">>", "regex": False}}
    soft = ComposedLM.from_manifest(text_run / "export")
    gated = ComposedLM.from_manifest(text_run / "export", composition="gated")
    tok = gated.tokenizer
    ids = torch.tensor([[tok.bos_token_id, *tok("What is 6*7?\n", add_special_tokens=False)["input_ids"]]])
    out = gated.generate(ids, torch.ones_like(ids), max_new_tokens=8)
    assert out.shape[0] == 1 and out.shape[1] > ids.shape[1]
    assert soft.composition == "soft" and gated.composition == "gated"


def test_pretrained_folder_with_a_padded_embedding_table_is_accepted(tmp_path):
    """Real checkpoints pad their vocabularies: a background folder with 64 extra rows trains experts."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(FIXTURE / "tokenizer")
    config = LlamaConfig(vocab_size=len(tok) + 64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "padded")
    proc = train(TEXT, *FAST, f"background.path={tmp_path / 'padded'}", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run/summary.json").read_text())["composition"]["k"] == 2

    small = LlamaConfig(**{**config.to_dict(), "vocab_size": len(tok) - 1})
    LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    proc = train(TEXT, f"background.path={tmp_path / 'small'}", f"output_dir={tmp_path / 'nope'}")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "background.path" in line and "fewer than the tokenizer" in line
    assert not (tmp_path / "nope").exists()


def test_a_pretrained_background_tuned_on_spanned_rows_is_a_folder_later_runs_can_name_alone(tmp_path):
    """`model.pretrained_path` + `task.background_spans`: the pipeline fine-tunes the pretrained model on the general
    rows and their spanned copies and saves it with its tokenizer, so `background.path` alone names it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(FIXTURE / "tokenizer")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "pretrained")
    first = tmp_path / "first"
    proc = train(TEXT, *FAST, f"model.pretrained_path={tmp_path / 'pretrained'}", "task.background_spans=true",
                 "background.corruption_prob=0", f"output_dir={first}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (first / "background/tokenizer.json").is_file() and (first / "background/model.safetensors").is_file()
    second = tmp_path / "second"
    proc = train(TEXT, *FAST, "task.tokenizer=null", f"background.path={first / 'background'}",
                 f"output_dir={second}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((second / "summary.json").read_text())["composition"]["k"] == 2


@pytest.mark.parametrize("override, expected", [
    ("experts.0.data=[tests/fixtures/text/missing.jsonl]", "missing.jsonl"),
    ("experts.0.interval.start=<<<", "<<<"),
    ("experts.0.interval={start: '(', end: ')', regex: true}", "regex"),
    ("task.general=[tests/fixtures/text/tokenizer/tokenizer_config.json]", "tokenizer_config.json"),
])
def test_text_bad_input_is_one_line_before_anything_is_written(tmp_path, override, expected):
    """In-process (the command line prints the same ConfigError as `error: ...` and exits 2)."""
    from lightning_modules.pipeline.config import ConfigError, load_config
    from lightning_modules.pipeline.stages import run

    with pytest.raises(ConfigError) as err:
        run(load_config([str(TEXT)], [override, f"output_dir={tmp_path / 'run'}"],
                        base=ROOT / "configs" / "default.yaml"))
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_text_bad_input_at_the_command_line(tmp_path):
    proc = train(TEXT, "experts.1.data=[nowhere.jsonl]", f"output_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: nowhere.jsonl: data file not found"]
    assert not (tmp_path / "run").exists()


def test_exports_that_differ_in_their_evaluation_rows_combine(text_run, tmp_path):
    """An expert trained later brings compositional rows that need its skill: exports that differ only in how a
    run was evaluated (`compositional`, `eval_limit`, `cross_eval`) combine, noted, on the first export's rows."""
    import shutil

    from compose.export import load_manifest, write_manifest
    from compose.frontends.combine import check_exports

    def one_expert(name: str, **settings) -> Path:
        dst = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(text_run / "export", dst)
        manifest = load_manifest(dst)
        for entry in manifest["experts"]:
            if entry["name"] != name:
                shutil.rmtree(dst / entry["path"])
        extra = {**manifest["extra"], "task_settings": {**manifest["extra"]["task_settings"], **settings}}
        write_manifest(dst, manifest["background"], [e for e in manifest["experts"] if e["name"] == name], extra)
        return dst

    calc = one_expert("calc")
    later = one_expert("upper", compositional=[str(FIXTURE / "compositional.jsonl")] * 2, eval_limit=3)
    combination = check_exports([calc, later])
    assert combination.names == ["calc", "upper"]
    assert combination.settings["compositional"] == load_manifest(calc)["extra"]["task_settings"]["compositional"]
    assert sum("task.compositional differs" in n or "task.eval_limit differs" in n for n in combination.notes) == 2
    longer = load_manifest(calc)["extra"]["task_settings"]["max_length"] + 1
    trained_differently = one_expert("upper", max_length=longer)  # it shapes the training rows: refused
    with pytest.raises(ValueError, match="task.max_length is"):
        check_exports([calc, trained_differently])


def test_interval_divergence_reports_regions_and_perplexity_of_an_export(text_run, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("interval_divergence", ROOT / "scripts" / "interval_divergence.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main([str(text_run / "export"), "--limit", "2", "--perplexity", "--top1", "--misses", "50",
                          "--first_miss", "--foreign", "3"])
    assert set(result["experts"]) == {"calc", "upper"} and result["n_test"] == 2
    # --foreign: KL inside and outside random spans put into 3 general rows, for every expert
    for r in result["foreign_spans"].values():
        assert r["inside_n"] > 0 and r["outside_n"] > 0
        assert 0.0 <= r["inside"] < float("inf") and 0.0 <= r["outside"] < float("inf")
    # --first_miss: each row either decodes the reference or first leaves it in exactly one region
    first = result["first_miss"]
    missed = sum(first[r] for r in script.FIRST_MISS_REGIONS)
    assert first["rows"] == 2 and first["no_miss"] + missed == 2
    assert sum(first["pushed_most"].values()) == missed == len(first["examples"])
    assert all(first[f"{r}_background_right"] <= first[r] for r in script.FIRST_MISS_REGIONS)
    ppl = result["general_perplexity"]
    assert ppl["composition"] > 1.0 and ppl["background"] > 1.0 and ppl["composition"] != ppl["background"]
    out = capsys.readouterr().out
    assert "general perplexity: composition" in out and "composition: top token misses the reference" in out
    assert "soft greedy decoding leaves the reference in" in out
    assert "inside random foreign spans" in out

    # --top1's regions partition the target positions; `after` is the position following each interval's end
    from compose.frontends.combine import check_exports

    task = check_exports([text_run / "export"]).task
    batch = task.collator()([task.compositional_dataset("test")[i] for i in range(2)])
    valid = batch["targets"] != -100
    inside = batch["masks"].bool().any(1) & valid
    ends = int((inside[:, :-1] & ~inside[:, 1:] & valid[:, 1:]).sum())
    for model in ("background", "composition"):
        errors = result["top1_errors"][model]
        assert errors["inside_n"] == int(inside.sum()) and errors["after_n"] == ends > 0
        assert errors["inside_n"] + errors["after_n"] + errors["none_n"] == int(valid.sum())
        assert all(0.0 <= errors[r] <= 1.0 for r in ("inside", "after", "none"))
    # --misses lists every such miss right after a close (fewer than 50 here): the tokens differ, and the
    # composition's log-probs rank its top token first
    after = result["top1_errors"]["composition"]
    misses = result["after_misses"]
    assert 0 < len(misses) == round(after["after"] * after["after_n"])
    for miss in misses:
        lp = miss["logprobs [reference, top]"]
        assert miss["reference"] != miss["composition_top"] and lp["composition"][1] >= lp["composition"][0]
        assert set(lp) == {"background", "calc", "upper", "composition"}
