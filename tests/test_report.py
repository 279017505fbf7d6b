"""The run report: terminal table, report.md content with 95 % intervals, and the two PNG plots."""

from __future__ import annotations

import copy
import json

import pytest

from lightning_modules.pipeline.report import (
    fraction_count,
    plot_accuracy_vs_k,
    plot_divergence_heatmap,
    print_summary,
    wilson_interval,
    with_intervals,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAILURES = {"correct": 0.95, "rule_not_applied": 0.03, "wrong_letter_elsewhere": 0.0125, "length_or_eos": 0.0075}


def _summary() -> dict:
    return {
        "experiment": "letters", "task": "letters", "seed": 3,
        "background": {"exact_match": 1.0},
        "experts": {
            "A_to_B": {"exact_match": 0.998, "off_mask_kl": 0.0033, "on_mask_kl": 7.0712,
                       "max_off_mask_log_ratio": 7.5, "skill_accuracy": 1.0},
            "C_to_D": {"trained_in": "compose_with", "off_mask_kl": 0.0041, "on_mask_kl": 6.5,
                       "max_off_mask_log_ratio": 5.25, "skill_accuracy": 0.9875},
        },
        "composition": {"exact_match": 0.962, "k": 2, "n_test": 1000, "nll": 0.0261, "projectivity_error": 0.0071,
                        "failures": FAILURES, "overlap": {"A_to_B__C_to_D": 0.0664},
                        "active_set_accuracy": 0.9912, "margin_on_mask_min": -0.5, "margin_off_mask_below_2": 0.0031},
        "baselines": {"task_arithmetic": {"exact_match": 0.93, "max_logprob_gap_vs_composed": 1.2345},
                      "ties": {"exact_match": 0.5}, "dare": {"exact_match": 0.4}},
        "ablations": {
            "regularized": {"description": "default recipe", "overrides": ["expert.reg_weight=1.0"],
                            "k": {"2": {"exact_match": 0.962, "off_mask_kl": 0.003, "max_off_mask_log_ratio": 7.5,
                                        "failures": FAILURES, "experts_min_exact_match": 0.998},
                                  "10": {"exact_match": 0.871, "off_mask_kl": 0.0052},
                                  "4": {"exact_match": 0.9345, "off_mask_kl": 0.004}}},
            "plain": {"description": "no regularizer", "overrides": ["expert.reg_weight=0"],
                      "k": {"2": {"exact_match": 0.61, "off_mask_kl": 0.8123}, "4": {"exact_match": 0.2468}}},
        },
        "timing": {"background_s": 23.9, "experts_s": 50.0, "total_s": 100.4},
        "output_dir": "runs/letters/20260101-000000",
        "export": "runs/letters/20260101-000000/export",
        "command": "python train.py configs/experiment/letters_k4.yaml seed=3",
    }


def _divergence_map() -> dict:
    inputs, outputs = ["QACXB", "ZZCAA"], ["QBDXB", "ZZDBB"]
    experts = ["A_to_B", "C_to_D"]
    divergence, masks = [], []
    for letter in ("A", "C"):
        div_e, mask_e = [], []
        for x in inputs:
            mask = [int(ch == letter) for ch in x] + [0]
            mask_e.append(mask)
            div_e.append([7.0 if m else 1e-4 * (i + 1) for i, m in enumerate(mask)])
        divergence.append(div_e)
        masks.append(mask_e)
    return {"experts": experts, "inputs": inputs, "outputs": outputs, "divergence": divergence, "masks": masks}


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE


def test_write_report_full(tmp_path):
    (tmp_path / "divergence_map.json").write_text(json.dumps(_divergence_map()))
    path = write_report(_summary(), tmp_path)
    assert path == tmp_path / "report.md"
    text = path.read_text()
    assert text.startswith("# Run report: letters (seed 3)")
    # component table: every expert, the earlier export marked, the key numbers at 4 decimals
    assert "| expert A_to_B | 0.9980 | 0.0033 | 7.0712 | 7.5000 | 1.0000 |" in text
    assert "| expert C_to_D (earlier export) | - | 0.0041 | 6.5000 | 5.2500 | 0.9875 |" in text
    # 962 of 1000 compositional test rows: the Wilson interval beside it
    assert "| **composition (k=2, n=1000)** | **0.9620 [0.9483, 0.9722]** |" in text
    # composition details, including an extra scalar the stages may add
    for s in ("exact match (95 % interval): 0.9620 [0.9483, 0.9722]", "NLL per token: 0.0261",
              "projectivity error: 0.0071", "active_set_accuracy: 0.9912",
              "| rule_not_applied | 0.0300 [0.0211, 0.0425] |", "| A_to_B × C_to_D | 0.0664 |",
              "composed target margin on the masks: smallest (nats): -0.5000",
              "composed target margin off the masks: fraction below 2 nats: 0.0031"):
        assert s in text, s
    # baselines (on the same 1000 test rows): Δ = 0.93 - 0.962, and intervals that do not overlap
    assert "| composition (ours) | 0.9620 [0.9483, 0.9722] | 0.0000 | - |" in text
    assert "| task arithmetic | 0.9300 [0.9125, 0.9442] | -0.0320 | 1.2345 |" in text
    assert "| ties | 0.5000 [0.4691, 0.5309] | -0.4620 | - |" in text
    assert "Task arithmetic merges" in text
    assert "Notes from the task" not in text  # the task had none
    # ablations: k columns sorted numerically, missing cell shown as "-"
    assert "| variant | description | overrides | k=2 | k=4 | k=10 |" in text
    assert "| **plain** | no regularizer | `expert.reg_weight=0` | 0.6100 | 0.2468 | - |" in text
    assert "| regularized | 2 | 0.0030 | 7.5000 | 0.9980 | 0.9500 | 0.0300 | 0.0125 | 0.0075 |" in text
    assert "| plain | 2 | 0.8123 |" in text
    # plots embedded with relative links, timing, reproduce command
    assert "![composed exact match vs k](accuracy_vs_k.png)" in text
    assert "![per-position divergence](divergence_heatmap.png)" in text
    assert "| total | 100.4 |" in text
    assert "python train.py configs/experiment/letters_k4.yaml seed=3" in text
    _assert_png(tmp_path / "accuracy_vs_k.png")
    _assert_png(tmp_path / "divergence_heatmap.png")


def test_write_report_minimal(tmp_path):
    """Only the background: no composition, no plots, still a valid report."""
    path = write_report({"experiment": "letters", "seed": 0, "background": {"exact_match": 0.75}}, tmp_path / "run")
    text = path.read_text()
    assert "| background | 0.7500 | - | - | - | - |" in text
    for absent in ("## Composition", "## Baselines", "## Ablations", "## Timing", "![", "**composition"):
        assert absent not in text
    assert "python train.py seed=0" in text
    assert not (tmp_path / "run" / "accuracy_vs_k.png").exists()
    assert not (tmp_path / "run" / "divergence_heatmap.png").exists()


def test_no_ablations_no_accuracy_plot(tmp_path):
    summary = _summary()
    del summary["ablations"]
    del summary["command"]
    text = write_report(summary, tmp_path, divergence_map=_divergence_map()).read_text()
    assert not (tmp_path / "accuracy_vs_k.png").exists()
    assert "accuracy_vs_k.png" not in text and "## Ablations" not in text
    _assert_png(tmp_path / "divergence_heatmap.png")
    # without a command the resolved config reproduces the run
    assert "python train.py runs/letters/20260101-000000/config.yaml" in text
    assert plot_accuracy_vs_k(summary, tmp_path / "a.png") is None
    assert plot_accuracy_vs_k({"background": {}, "ablations": {"x": {"k": {}}}}, tmp_path / "a.png") is None
    assert not (tmp_path / "a.png").exists()


def test_divergence_heatmap_empty_and_bad_shapes(tmp_path):
    assert plot_divergence_heatmap({}, tmp_path / "h.png") is None
    assert plot_divergence_heatmap({**_divergence_map(), "experts": []}, tmp_path / "h.png") is None
    bad = copy.deepcopy(_divergence_map())
    bad["divergence"][1][0] = bad["divergence"][1][0][:-2]
    with pytest.raises(ValueError, match="C_to_D"):
        plot_divergence_heatmap(bad, tmp_path / "h.png")
    bad = _divergence_map()
    del bad["masks"]
    with pytest.raises(ValueError, match="masks"):
        plot_divergence_heatmap(bad, tmp_path / "h.png")
    assert not (tmp_path / "h.png").exists()


def test_print_summary(capsys):
    print_summary(_summary())
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "| component | exact match | off-mask KL | on-mask KL | max off-mask log-ratio | skill accuracy |" in lines
    assert "| background | 1.0000 | - | - | - | - |" in lines
    assert "| expert A_to_B | 0.9980 | 0.0033 | 7.0712 | 7.5000 | 1.0000 |" in lines
    assert any(line.startswith("| **composition (k=2, n=1000)** | **0.9620 [0.9483, 0.9722]** |") for line in lines)
    assert lines[-1] == "report: runs/letters/20260101-000000/report.md"


def test_print_summary_background_only(capsys):
    print_summary({"background": {"exact_match": 0.5}})
    out = capsys.readouterr().out
    assert "| background | 0.5000 |" in out
    assert "expert" not in out and "report:" not in out


def test_task_notes_are_listed_once(tmp_path):
    summary = _summary()
    summary["composition"]["notes"] = ["source letter 'A' is shared by experts 'a' and 'b'"]
    text = write_report(summary, tmp_path).read_text()
    assert ("Notes from the task (e.g. experts whose masks can claim the same positions): "
            "`source letter 'A' is shared by experts 'a' and 'b'`") in text
    assert text.count("source letter 'A'") == 1  # not repeated among the composition's extra scalars


def _token_map(lengths: list[int]) -> dict:
    """A divergence map written by a run with a subword tokenizer: `tokens` label each target position."""
    tokens = [["QB", "DX", "B", "<eos>"], ["ZZ", "DBB", "</s>"]]
    experts = ["A_to_B", "C_to_D"]
    divergence = [[[7.0 if (e + t) % 2 else 1e-3 for t in range(n)] for n in lengths] for e in range(2)]
    masks = [[[int((e + t) % 2) for t in range(n)] for n in lengths] for e in range(2)]
    return {"experts": experts, "inputs": ["QACXA", "ZZCAA"], "outputs": ["QBDXB", "ZZDBB"], "tokens": tokens,
            "divergence": divergence, "masks": masks}


def test_divergence_heatmap_labels_positions_with_the_runs_tokens(tmp_path):
    # one label per position (the characters of `outputs` would give 5 + eos = 6 positions)
    path = plot_divergence_heatmap(_token_map([4, 3]), tmp_path / "h.png")
    assert path == tmp_path / "h.png"
    _assert_png(path)
    _assert_png(plot_divergence_heatmap(_token_map([5, 4]), tmp_path / "eos.png"))  # tokens + 1: an eos position
    with pytest.raises(ValueError, match=r"divergence_map\['divergence'\]\[0\]\[1\] has 6 positions, expected 3 target tokens"):
        plot_divergence_heatmap(_token_map([4, 6]), tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize(("successes", "n", "expected"), [
    (0, 10, (0.0, 0.2775)),        # the interval of a zero count is not empty
    (10, 10, (0.7225, 1.0)),
    (5, 10, (0.2366, 0.7634)),
    (81, 263, (0.2553, 0.3662)),   # as statsmodels' proportion_confint(81, 263, method="wilson")
    (962, 1000, (0.9483, 0.9722)),
    (1, 1, (0.2065, 1.0)),
])
def test_wilson_interval_known_values(successes, n, expected):
    lo, hi = wilson_interval(successes, n)
    assert (lo, hi) == pytest.approx(expected, abs=5e-5)
    # a wider z widens it, more trials narrow it, and it mirrors for the complement
    lo99, hi99 = wilson_interval(successes, n, z=2.576)
    assert lo99 <= lo and hi99 >= hi and (lo99, hi99) != (lo, hi)
    assert wilson_interval(n - successes, n) == pytest.approx((1 - hi, 1 - lo))
    lo4, hi4 = wilson_interval(4 * successes, 4 * n)
    assert hi4 - lo4 < hi - lo


def test_wilson_interval_bad_counts():
    for successes, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="wilson_interval needs 0 <= successes <= n"):
            wilson_interval(successes, n)


def test_report_shows_intervals_where_the_summary_counts_the_rows(tmp_path):
    """A component's `n_test` counts its exact match, `<key>_n` any other fraction; without a count, no interval."""
    summary = _summary()
    summary["background"] = {"exact_match": 0.75, "n_test": 200}
    summary["experts"]["A_to_B"] |= {"n_test": 500, "skill_accuracy_n": 400}
    summary["composition"]["gated"] = {"exact_match": 0.5}
    text = write_report(summary, tmp_path).read_text()
    assert "| background | 0.7500 [0.6857, 0.8049] | - | - | - | - |" in text
    assert "| expert A_to_B | 0.9980 [0.9888, 0.9996] | 0.0033 | 7.0712 | 7.5000 | 1.0000 [0.9905, 1.0000] |" in text
    assert "| expert C_to_D (earlier export) | - | 0.0041 | 6.5000 | 5.2500 | 0.9875 |" in text  # no count
    assert "| composition, gated (k=2) | 0.5000 [0.4691, 0.5309] |" in text  # the composition's test rows
    assert fraction_count({"exact_match": 0.5}, "exact_match") is None
    assert fraction_count({"exact_match": 0.5, "n_test": 8}, "exact_match") == 8
    assert fraction_count({"skill_accuracy": 0.5, "n_test": 8}, "skill_accuracy") is None


def test_summary_intervals_beside_each_counted_fraction():
    summary = _summary()
    summary["experts"]["A_to_B"]["skill_accuracy_n"] = 400
    out = with_intervals(summary)
    assert "exact_match_ci95" not in summary["composition"]  # the summary itself is left alone
    assert out["composition"]["exact_match_ci95"] == pytest.approx([0.9483, 0.9722], abs=5e-5)
    assert out["composition"]["failures"]["correct_ci95"] == pytest.approx(list(wilson_interval(950, 1000)))
    assert out["baselines"]["ties"]["exact_match_ci95"] == pytest.approx([0.4691, 0.5309], abs=5e-5)
    assert out["experts"]["A_to_B"]["skill_accuracy_ci95"] == pytest.approx(list(wilson_interval(400, 400)))
    assert "exact_match_ci95" not in out["experts"]["A_to_B"] and "nll_ci95" not in out["composition"]
    assert "exact_match_ci95" not in out["ablations"]["plain"]["k"]["2"]  # an ablation records no count
