"""`compose.combine`: exports of separate runs (one expert each, one background) checked, composed, evaluated,
written as one export; and each reason two exports do not combine, as one line and exit code 2."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from compose import ComposedLM
from compose.export import load_export, load_manifest, write_manifest
from compose.frontends.combine import CombineError, check_exports, combine_exports, main
from lightning_modules.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT, FAST = ROOT / "configs" / "default.yaml", ROOT / "configs" / "debug" / "fast.yaml"
SETTINGS = {"name": "letters", "alphabet": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "min_len": 8, "max_len": 16,
            "format": "generative", "n_train": 256, "n_val": 32, "n_test": 32, "source_prob": 0.5,
            "compositional_min_experts": None, "eval_lengths": None, "n_per_length": 200}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs, one expert each, in the issue's set-up: the first trains the background, the second (another
    seed) loads it with `background.path`; neither knows the other's expert."""
    from lightning_modules.pipeline.stages import run

    root = tmp_path_factory.mktemp("separate")
    common = ["ablations=[]", "baselines=[]", "report=false"]
    run(load_config([str(FAST)], [*common, f"output_dir={root / 'r0'}", "experts=[{name: A_to_B, rules: {A: B}}]"],
                    base=DEFAULT))
    run(load_config([str(FAST)], [*common, f"output_dir={root / 'r1'}", "seed=1", f"background.path={root / 'r0/background'}",
                                  "experts=[{name: C_to_D, rules: {C: D}}]"], base=DEFAULT))
    return root / "r0", root / "r1"


def copy_export(src: Path, dst: Path, edit=None, rehash: bool = False) -> Path:
    """A copy of the export `src`; `edit(manifest)` changes its manifest; `rehash` re-lists every file's sha256
    (a valid export of changed files)."""
    shutil.copytree(src, dst)
    manifest = load_manifest(dst)
    if edit is not None:
        edit(manifest)
    if rehash:
        write_manifest(dst, manifest["background"], manifest["experts"], manifest["extra"])
    else:
        (dst / "composition.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return dst


def test_separate_runs_combine_into_one_export_that_composes_as_one_model(runs, tmp_path):
    from data.tasks import Expert
    from data.tasks.letters import LettersConfig, LettersTask

    e0, e1 = runs[0] / "export", runs[1] / "export"
    assert load_manifest(e1)["extra"]["task_settings"] == SETTINGS  # recorded at export time
    out = tmp_path / "combined"
    result = combine_exports([e0, e1], out, batch_size=32)
    assert (result["experts"], result["k"], result["seed"], result["n_test"]) == (["A_to_B", "C_to_D"], 2, 0, 32)
    assert any("seeds [0, 1]" in note for note in result["notes"])

    # The reference: both adapters in one PeftModel, one ComposedLM, the task built here from its settings.
    loaded = load_export(e0)
    loaded.experts.load_adapter(str(e1 / "experts" / "C_to_D"), adapter_name="C_to_D")
    reference = ComposedLM.from_peft(loaded.experts, ["A_to_B", "C_to_D"], tokenizer=loaded.tokenizer)
    experts = [Expert("A_to_B", {"rules": {"A": "B"}}), Expert("C_to_D", {"rules": {"C": "D"}})]
    task = LettersTask(LettersConfig(n_train=256, n_val=32, n_test=32), experts, seed=0)
    expected = task.composition_metrics(reference, task.compositional_dataset("test"), 32)
    assert result["metrics"] == pytest.approx(expected, rel=1e-5, abs=1e-7)

    combined = ComposedLM.from_manifest(out)
    assert (combined.names, combined.weights, combined.specs) == (
        ["A_to_B", "C_to_D"], [1.0, 1.0], [{"rules": {"A": "B"}}, {"rules": {"C": "D"}}])
    manifest = load_manifest(out)
    assert "metrics.json" in manifest["checksums"] and manifest["background"] == {"path": "background"}
    assert [s["experts"] for s in manifest["extra"]["combined_from"]] == [["A_to_B"], ["C_to_D"]]
    # the exact shortcuts the composition takes are recorded, as each run's export recorded its own
    assert manifest["extra"]["decoding_paths"] == result["decoding_paths"] == dataclasses.asdict(combined.paths)
    assert set(load_manifest(e0)["extra"]["decoding_paths"]) == {"one_head", "one_head_why", "trunk_start",
                                                                 "num_layers", "trunk_why"}
    # A combined export is an input again (an expert trained later would join it), and --out is never overwritten.
    again = combine_exports([out], limit=8, batch_size=8)
    assert again["experts"] == ["A_to_B", "C_to_D"] and again["n_test"] == 8
    with pytest.raises(CombineError, match="exists"):
        combine_exports([e0, e1], out)
    # a floor on the components' log-probs reaches the composition evaluated: the reference with that floor
    floored = combine_exports([e0, e1], limit=8, batch_size=8, min_logprob=-2.0)
    reference.min_logprob = -2.0
    expected = task.composition_metrics(reference, task.compositional_dataset("test").select(range(8)), 8)
    assert floored["min_logprob"] == -2.0 and floored["metrics"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert floored["metrics"] != combine_exports([e0, e1], limit=8, batch_size=8)["metrics"]  # the floor is reached
    assert ComposedLM.from_manifest(out, min_logprob=-2.0).min_logprob == -2.0
    with pytest.raises(CombineError, match="min_logprob=0.5: must be a negative log-probability"):
        combine_exports([e0, e1], min_logprob=0.5)


def test_cli_prints_and_writes_the_metrics(runs, tmp_path, capsys):
    metrics = tmp_path / "m.json"
    out = tmp_path / "ref"
    argv = [str(runs[0] / "export"), str(runs[1] / "export"), "--limit", "4", "--batch_size", "4",
            "--composition", "gated", "--metrics", str(metrics), "--out", str(out), "--background", "ref", "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # a stage line (with the decoding paths), then the result
    assert printed.startswith("[combine] A_to_B, C_to_D: gated composition on the compositional test rows (one head")
    assert "\ncomposed 2 experts (A_to_B, C_to_D) from 2 exports: exact_match=" in printed
    assert "on 4 compositional test rows (gated)" in printed
    written = yaml.safe_load(metrics.read_text())
    assert written["n_test"] == 4 and "exact_match" in written["metrics"] and written["out"] == str(out)
    bg = load_manifest(out)["background"]
    assert Path(bg["ref"]) == (runs[0] / "export" / "background").resolve() and not (out / "background").exists()


def test_old_exports_take_the_task_settings_from_their_runs_config(runs, tmp_path):
    """Exports written before `task_settings` was recorded: the run's config.yaml beside the export."""
    def forget(manifest):
        del manifest["extra"]["task_settings"]

    run = tmp_path / "old"
    shutil.copytree(runs[1], run)
    copy_export(runs[1] / "export", tmp_path / "tmp", forget)
    shutil.rmtree(run / "export")
    shutil.move(tmp_path / "tmp", run / "export")
    combination = check_exports([runs[0] / "export", run / "export"])
    assert combination.settings == SETTINGS and combination.names == ["A_to_B", "C_to_D"]
    alone = copy_export(runs[1] / "export", tmp_path / "alone", forget)
    with pytest.raises(CombineError, match="no extra.task_settings and there is no config.yaml"):
        check_exports([runs[0] / "export", alone])


def test_training_only_settings_may_differ(runs, tmp_path):
    other = copy_export(runs[1] / "export", tmp_path / "n", lambda m: m["extra"]["task_settings"].update(n_train=512))
    combination = check_exports([runs[0] / "export", other])
    assert any("task.n_train differs" in note for note in combination.notes)


def test_test_settings_change_the_test_split_only_and_are_noted(runs, tmp_path, capsys):
    """Nine letter experts cannot all fit in inputs of 8 letters: the test split may be drawn with other settings
    (train_separately.py does this for a late expert), noted, while the combined export keeps the runs' own."""
    from data.tasks import Expert, TaskError
    from data.tasks.letters import LettersConfig, LettersTask

    nine = [Expert(f"{a}_to_{b}", {"rules": {a: b}}) for a, b in zip("ACEGIKMOQ", "BDFHJLNPR", strict=True)]
    with pytest.raises(TaskError, match=r"task.min_len=8: compositional inputs plant a source letter of 9 experts"):
        LettersTask(LettersConfig(), nine)
    out = tmp_path / "combined"
    result = combine_exports([runs[0] / "export", runs[1] / "export"], out, limit=8, batch_size=8,
                             test_settings={"min_len": 12})
    assert "test split with task.min_len=12 (the runs': 8)" in result["notes"]
    assert load_manifest(out)["extra"]["task_settings"]["min_len"] == 8
    combination = check_exports([runs[0] / "export"], test_settings={"min_len": 12})
    assert all(len(row["x"]) >= 12 for row in combination.task.compositional_dataset("test"))
    with pytest.raises(CombineError, match=r"test settings \['min_length'\] are not settings of the letters task"):
        check_exports([runs[0] / "export"], test_settings={"min_length": 12})
    assert main([str(runs[0] / "export"), "--limit", "4", "--batch_size", "4", "--test_setting", "min_len=12",
                 "--device", "cpu"]) == 0
    assert "note: test split with task.min_len=12 (the runs': 8)" in capsys.readouterr().out


def _other_background(manifest_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest_dir / "background")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(manifest_dir / "background")


def _other_tokenizer(manifest_dir: Path) -> None:
    from data.tokenizer import build_char_tokenizer

    shutil.rmtree(manifest_dir / "tokenizer")
    build_char_tokenizer("ABCDEFGH").save_pretrained(manifest_dir / "tokenizer")


def _bad(kind: str, runs, tmp: Path) -> list[str]:
    """Export folders that do not combine, for each reason."""
    e0, e1 = runs[0] / "export", runs[1] / "export"
    if kind == "missing":
        return [str(e0), str(tmp / "nowhere")]
    if kind == "corrupt":
        bad = copy_export(e1, tmp / "corrupt")
        (bad / "experts/C_to_D/adapter_model.safetensors").write_bytes(b"truncated")
        return [str(e0), str(bad)]
    if kind in ("background", "tokenizer"):
        bad = tmp / kind
        shutil.copytree(e1, bad)
        (_other_background if kind == "background" else _other_tokenizer)(bad)
        copy_export(bad, tmp / f"{kind}-rehashed", rehash=True)
        return [str(e0), str(tmp / f"{kind}-rehashed")]
    if kind == "clash":
        return [str(e0), str(copy_export(e0, tmp / "again"))]
    if kind == "overlap":
        def read_a(m):
            m["experts"][0]["spec"] = {"rules": {"A": "D"}}
        return [str(e0), str(copy_export(e1, tmp / "overlap", read_a))]
    if kind == "settings":
        return [str(e0), str(copy_export(e1, tmp / "len", lambda m: m["extra"]["task_settings"].update(max_len=20)))]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,message", [
    ("missing", r"nowhere: no such export folder"),
    ("corrupt", r"corrupt: not a valid export: .*adapter_model.safetensors: sha256 mismatch"),
    ("background", r"r0/export and .*background-rehashed have different backgrounds \(model.safetensors differs"),
    ("tokenizer", r"r0/export and .*tokenizer-rehashed have different tokenizers"),
    ("clash", r"expert name 'A_to_B' is in both .*r0/export and .*again"),
    ("overlap", r"source letter 'A' is shared by experts 'A_to_B' and 'C_to_D' .*\(A_to_B: .*r0/export; "
                r"C_to_D: .*overlap\)"),
    ("settings", r"task settings differ: task.max_len is 16 in .*r0/export but 20 in .*len, so the compositional"),
])
def test_exports_that_do_not_combine_are_one_line_and_exit_2(runs, tmp_path, capsys, kind, message):
    argv = _bad(kind, runs, tmp_path)
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("compose.combine: error: "), err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_overlapping_masks_combine_when_allowed_and_are_noted(runs, tmp_path):
    def read_a(m):
        m["experts"][0]["spec"] = {"rules": {"A": "D"}}

    other = copy_export(runs[1] / "export", tmp_path / "overlap", read_a)
    combination = check_exports([runs[0] / "export", other], allow_overlap=True)
    assert any("'A' is shared" in note for note in combination.notes)


def test_compare_decodes_the_same_rows_with_each_method(runs, tmp_path, recwarn):
    """`compare_with`: the other ways to use the same experts, on the rows the composition was scored on; each
    expert alone is that expert's own adapter, and a merge leaves no adapter behind."""
    from data.tasks import Expert
    from data.tasks.letters import LettersConfig, LettersTask

    e0, e1 = runs[0] / "export", runs[1] / "export"
    result = combine_exports([e0, e1], limit=16, batch_size=16,
                             compare_with=["soft", "alone", "background", "task_arithmetic", "ties"])
    compared = result["compare"]
    assert list(compared) == ["soft", "alone/A_to_B", "alone/C_to_D", "background", "task_arithmetic", "ties"]
    assert compared["soft"]["exact_match"] == pytest.approx(result["metrics"]["exact_match"])
    for entry in compared.values():
        lo, hi = entry["exact_match_ci95"]
        assert entry["exact_match_n"] == 16 and lo <= entry["exact_match"] <= hi

    loaded = load_export(e0)  # the reference: expert A_to_B alone, the task rebuilt here
    task = LettersTask(LettersConfig(n_train=256, n_val=32, n_test=32),
                       [Expert("A_to_B", {"rules": {"A": "B"}}), Expert("C_to_D", {"rules": {"C": "D"}})], seed=0)
    alone = ComposedLM.from_peft(loaded.experts, ["A_to_B"], tokenizer=loaded.tokenizer)
    expected = task.evaluate_composition(alone, task.compositional_dataset("test").select(range(16)), 16)
    assert compared["alone/A_to_B"]["exact_match"] == pytest.approx(expected["exact_match"])
    assert not [w for w in recwarn if "deleted" in str(w.message)]  # the merges go quietly
    with pytest.raises(CombineError, match="unknown method.*nope"):
        combine_exports([e0, e1], limit=2, compare_with=["nope"])


def test_decode_only_skips_every_teacher_forced_pass(runs):
    e0, e1 = runs[0] / "export", runs[1] / "export"
    scored = combine_exports([e0, e1], limit=8, batch_size=8)
    decoded = combine_exports([e0, e1], limit=8, batch_size=8, decode_only=True, compare_with=["gated"])
    assert "nll" in scored["metrics"] and "nll" not in decoded["metrics"]
    assert decoded["metrics"]["exact_match"] == pytest.approx(scored["metrics"]["exact_match"])  # the same decoding
    assert set(decoded["compare"]["gated"]) == {"exact_match", "exact_match_n", "exact_match_ci95",
                                                *(k for k in decoded["metrics"] if "/" in k)}


def _subset_bounds():
    """`scripts/subset_bounds.py` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("subset_bounds", ROOT / "scripts" / "subset_bounds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_subset_bounds_composes_every_pair_and_checks_each_skill_against_the_expert_alone(runs, tmp_path, capsys):
    """`scripts/subset_bounds.py`: three experts trained apart; every pair and the whole set, gated and soft, on the
    same rows; each skill's ratio is its accuracy in the composition over the expert alone on these rows."""
    from lightning_modules.pipeline.stages import run

    third = tmp_path / "r2"
    run(load_config([str(FAST)], ["ablations=[]", "baselines=[]", "report=false", f"output_dir={third}", "seed=2",
                                  f"background.path={runs[0] / 'background'}",
                                  "experts=[{name: E_to_F, rules: {E: F}}]"], base=DEFAULT))
    script = _subset_bounds()
    exports = [str(r / "export") for r in (*runs, third)]
    out = tmp_path / "subsets.json"
    results = script.main([*exports, "--sizes", "2", "--composition", "gated", "soft", "--limit", "12",
                           "--batch_size", "12", "--metrics", str(out)])
    assert json.loads(out.read_text()) == results and results["n_test"] == 12
    subsets = [(tuple(s["experts"]), s["composition"]) for s in results["subsets"]]
    pairs = [("A_to_B", "C_to_D"), ("A_to_B", "E_to_F"), ("C_to_D", "E_to_F")]
    everyone = ("A_to_B", "C_to_D", "E_to_F")
    assert subsets == [(p, c) for c in ("gated", "soft") for p in (*pairs, everyone)]
    soft_pair = combine_exports(exports[:2], limit=12, batch_size=12, decode_only=True)["metrics"]
    entry = results["subsets"][4]  # soft A_to_B + C_to_D: the same decoding as combine's
    for name in entry["experts"]:
        assert entry["skills"][name]["accuracy"] == pytest.approx(soft_pair[f"{name}/skill_accuracy"])
        own = results["alone"][name]["accuracy"]
        assert entry["skills"][name]["ratio"] == (pytest.approx(soft_pair[f"{name}/skill_accuracy"] / own) if own
                                                  else None)
    for s in results["subsets"]:
        assert s["meets"] == all(v["accuracy"] >= 0.9 * results["alone"][n]["accuracy"] for n, v in s["skills"].items())
    printed = capsys.readouterr().out
    assert "| A_to_B + C_to_D | gated |" in printed and "compositions meet the bound (12 rows)" in printed
    with pytest.raises(SystemExit, match="--sizes \\[3\\]"):
        script.main([*exports, "--sizes", "3"])


def test_subset_bounds_divides_each_skill_by_the_expert_alone(monkeypatch):
    """The bookkeeping on given metrics: a skill below `bound` × alone fails its subset; the whole set under the
    first composition reuses the decoding that gave the experts alone."""
    import compose.frontends.combine as combine

    script = _subset_bounds()
    names = {"a": "x", "b": "y", "c": "z"}
    accuracy = {("x", "y"): {"x": 0.8, "y": 0.5}, ("x", "z"): {"x": 0.9, "z": 0.45},
                ("y", "z"): {"y": 0.5, "z": 0.3}, ("x", "y", "z"): {"x": 0.85, "y": 0.49, "z": 0.5}}
    calls = []

    def fake(paths, composition="soft", compare_with=(), **kwargs):
        key = tuple(names[str(p)] for p in paths)
        calls.append((key, composition, tuple(compare_with)))
        metrics = {f"{n}/skill_accuracy": v for n, v in accuracy[key].items()}
        metrics.update({f"{n}/skill_accuracy_n": 40 for n in key})
        result = {"experts": list(key), "n_test": 40, "metrics": metrics}
        if compare_with:
            result["compare"] = {f"alone/{n}": {f"{n}/skill_accuracy": v, f"{n}/skill_accuracy_n": 40}
                                 for n, v in {"x": 1.0, "y": 0.5, "z": 0.5}.items()}
        return result

    monkeypatch.setattr(combine, "combine_exports", fake)
    results = script.subset_bounds([Path("a"), Path("b"), Path("c")], [2], ["gated"], bound=0.9)
    assert calls[0] == (("x", "y", "z"), "gated", ("alone",)) and len(calls) == 4  # 1 + 3 pairs, all reused
    got = {tuple(s["experts"]): (s["worst_ratio"], s["meets"]) for s in results["subsets"]}
    assert got[("x", "y")] == (pytest.approx(0.8), False)        # x at 0.8 of alone
    assert got[("x", "z")] == (pytest.approx(0.9), True)         # 0.9 and 0.45 / 0.5 = 0.9: on the bound
    assert got[("y", "z")] == (pytest.approx(0.6), False)
    assert got[("x", "y", "z")] == (pytest.approx(0.85), False)
    assert results["subsets"][0]["skills"]["y"] == {"accuracy": 0.5, "n": 40, "ratio": 1.0, "meets": True}


@pytest.mark.parametrize(("key", "value"), [("foreign_spans", [1, 3]), ("foreign_words", True),
                                                  ("foreign_rewrites", True), ("background_spans", True)])
def test_training_only_settings_may_differ_between_text_exports(tmp_path, key, value):
    """How many random foreign spans a regularizer row held, or whether the run's background trained on spanned
    rows, shapes training only (either order of exports); a setting of the test rows does not."""
    from types import SimpleNamespace

    from compose.frontends.combine import _common_settings

    base = {"name": "text", "general": ["g.jsonl"], "max_length": 64}
    old = SimpleNamespace(root=tmp_path / "old", settings=dict(base))  # written before the setting existed
    new = SimpleNamespace(root=tmp_path / "new", settings={**base, key: value})
    for sources in ([new, old], [old, new]):
        settings, notes = _common_settings(sources)
        assert settings == sources[0].settings
    assert any(f"task.{key} differs" in note for note in _common_settings([new, old])[1])
    other = SimpleNamespace(root=tmp_path / "other", settings={**base, key: value, "max_length": 32})
    with pytest.raises(CombineError, match="task.max_length"):
        _common_settings([new, other])
