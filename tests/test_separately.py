"""`scripts/train_separately.py`: each expert in its own run and process, knowing only the background and its
own rule; the exports composed, in subsets, and with an expert trained later (a new run, a new seed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from compose.export import load_manifest

ROOT = Path(__file__).resolve().parents[1]
FAST = str(ROOT / "configs" / "debug" / "fast.yaml")


def _script(name: str = "train_separately"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_experts_trained_one_per_process_compose_and_a_late_expert_joins(tmp_path, capsys):
    out = tmp_path / "sep"
    experts = "experts=[{name: A_to_B, rules: {A: B}}, {name: C_to_D, rules: {C: D}}, {name: E_to_F, rules: {E: F}}]"
    results = _script().main([FAST, "--out", str(out), "--subsets", "2", "--draws", "2", "--late",
                              "{name: G_to_H, rules: {G: H}}", "--late_seed", "7", "--late_test_setting", "n_test=16",
                              "--compare", "alone", "--jobs", "2", experts, "expert.reg_data=own",
                              "expert.corruption_prob=[0,0.6]", "report=false"])
    runs = {p.name: p for p in (out / "runs").iterdir() if p.is_dir()}
    assert sorted(runs) == ["A_to_B", "C_to_D", "E_to_F", "G_to_H"]
    for name, run in runs.items():  # each run knew one expert and no other's rule, and loaded the first's background
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert [e["name"] for e in cfg["experts"]] == [name] and cfg["composition"]["compose_with"] == []
        assert cfg["expert"]["corruption_prob"] == [0, 0.6]
        assert (run / "background").is_dir() == (name == "A_to_B")
        # --jobs 2: the first run trained the background alone, the next two ran at once, each console in a log
        assert (out / "runs" / f"{name}.log").is_file() == (name != "G_to_H")
        assert cfg["seed"] == (7 if name == "G_to_H" else 0)
        if name != "A_to_B":
            assert cfg["background"]["path"] == str(runs["A_to_B"] / "background")
    # the combined export holds the three experts; the late one joined it
    assert [e["name"] for e in load_manifest(out / "combined")["experts"]] == ["A_to_B", "C_to_D", "E_to_F"]
    assert [e["name"] for e in load_manifest(out / "combined_late")["experts"]] == ["A_to_B", "C_to_D", "E_to_F",
                                                                                  "G_to_H"]
    ks = [c["k"] for c in results["compositions"]]
    assert ks == [3, 2, 2, 4]
    assert [c["n_test"] for c in results["compositions"]] == [32, 32, 32, 16]  # the late one's own test setting
    assert all(0.0 <= c["exact_match"] <= 1.0 for c in results["compositions"])
    assert results["compositions"][-1]["test_settings"] == {"n_test": 16}
    # --compare: the full combination and the late one decoded each expert alone on their rows too
    assert sorted(results["compositions"][0]["compare"]) == ["alone/A_to_B", "alone/C_to_D", "alone/E_to_F"]
    assert "alone/G_to_H" in results["compositions"][-1]["compare"]
    assert json.loads((out / "separate.json").read_text()) == results
    assert set(results["alone"]) == set(runs)
    printed = capsys.readouterr().out
    assert "[separately] k=4 A_to_B+C_to_D+E_to_F+G_to_H: exact_match=" in printed
    # the table of the targets reads the combination and its compared methods
    table = _script("composition_table").main([str(out)])
    assert table.startswith("|  | exact match |") and "| A_to_B alone |" in table
    # finished runs are not trained again: a second call only composes
    again = _script().main([FAST, "--out", str(out), experts, "expert.reg_data=own", "expert.corruption_prob=[0,0.6]",
                            "report=false"])
    assert again["compositions"][0] == {k: v for k, v in results["compositions"][0].items() if k != "compare"}
    assert "train.py" not in capsys.readouterr().out
    # the k-curve of these runs: k = 1 each expert alone, the other k their compositions, decoding timed against k
    plot = tmp_path / "k.png"
    curve = _script("k_curve").main(["--curve", f"modular={out}", "--timing", str(out / "combined"), "--ks", "1,3",
                                     "--out", str(plot)])
    modular = curve["curves"]["modular"]  # of the second call's separate.json: three experts, no subsets
    assert sorted(modular) == ["1", "3"] and modular["1"]["n"] == 3
    assert modular["1"]["min"] == min(again["alone"].values())
    assert modular["3"]["mean"] == pytest.approx(again["compositions"][0]["exact_match"])
    assert plot.is_file() and json.loads(plot.with_suffix(".json").read_text()) == json.loads(json.dumps(curve))
    assert set(curve["decode_ms_per_token"]) == {"1", "3"} and all(v > 0 for v in curve["decode_ms_per_token"].values())
    with pytest.raises(SystemExit, match="holds neither separate.json"):
        _script("k_curve").main(["--curve", f"x={tmp_path}", "--out", str(plot)])


def test_co_training_rows_are_refused():
    with pytest.raises(SystemExit, match="reg_data=composition applies every expert's rules"):
        _script().main([FAST, "--out", "unused", "expert.reg_data=composition"])


def test_k_curve_reads_a_train_py_run_as_each_expert_alone_and_its_composition(tmp_path):
    summary = {"experts": {"A_to_B": {"exact_match": 0.99}, "C_to_D": {"exact_match": 0.97}},
               "composition": {"k": 2, "exact_match": 0.95}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert _script("k_curve").points(tmp_path) == [(1, 0.99), (1, 0.97), (2, 0.95)]
    one = {"experts": {"A_to_B": {"exact_match": 0.9}}, "composition": {"k": 1, "exact_match": 0.9}}
    (tmp_path / "summary.json").write_text(json.dumps(one))
    assert _script("k_curve").points(tmp_path) == [(1, 0.9)]


def test_a_pretrained_background_is_every_runs_own(tmp_path, monkeypatch):
    """With `background.path` set no run trains a background: none is handed from the first run to the others."""
    import compose.frontends.combine as combine

    module, given = _script(), {}

    def train_one(config, overrides, spec, out, background, seed=None, test_limit=None, log=False):
        given[spec["name"]] = background
        out.mkdir(parents=True, exist_ok=True)
        return {"experts": {spec["name"]: {"exact_match": 1.0}}}

    monkeypatch.setattr(module, "train_one", train_one)
    monkeypatch.setattr(combine, "combine_exports", lambda *a, **k: {"metrics": {"exact_match": 1.0}, "n_test": 1})
    experts = "experts=[{name: A_to_B, rules: {A: B}}, {name: C_to_D, rules: {C: D}}]"
    module.main([FAST, "--out", str(tmp_path / "sep"), experts, "background.path=smollm2", "--jobs", "2", "--late",
                 "{name: E_to_F, rules: {E: F}}"])
    assert given == {"A_to_B": None, "C_to_D": None, "E_to_F": None}
    module.main([FAST, "--out", str(tmp_path / "sep2"), experts])
    assert given["C_to_D"] == tmp_path / "sep2" / "runs" / "A_to_B" / "background"


def test_composition_table_says_how_many_intervals_were_not_written():
    targets = _script("composition_table").targets
    soft = {"exact_match": 0.5, "exact_match_n": 20, "upper/skill_accuracy": 0.4, "upper/intervals_missing": 0.25}
    alone = {"upper/skill_accuracy": 0.8, "upper/intervals_missing": 0.05}
    lines = targets(soft, {"alone/upper": alone}, ["upper"], 0.95, 1.02)
    assert lines == ["- `upper`: soft 0.400 / alone 0.800 = 0.500 (misses ≥ 0.95); not written: soft 25.0%, alone 5.0%"]
    del alone["upper/intervals_missing"]  # metrics from before the count existed: the ratio alone
    assert targets(soft, {"alone/upper": alone}, ["upper"], 0.95, 1.02)[0].endswith("(misses ≥ 0.95)")
