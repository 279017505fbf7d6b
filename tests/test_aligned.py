"""The position-aligned letter task (the paper authors' appendix set-up): data, argmax evaluation, pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from compose import ComposedLM
from data.datamodule import TaskDataModule
from data.tasks import Expert, TaskError
from data.tasks.letters import (
    LettersConfig,
    LettersTask,
    RuleSet,
    aligned_outputs,
    build_aligned_dataset,
    build_letters_dataset,
    sample_strings,
)
from data.tasks.letters.rules import aligned_batch, dataset_builder
from data.tokenizer import build_char_tokenizer
from lightning_modules.pipeline.config import ConfigError, load_config
from lightning_modules.pipeline.report import with_intervals

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
AB, CD = RuleSet("A_to_B", {"A": "B"}), RuleSet("C_to_D", {"C": "D"})
EXPERTS = [Expert(rs.name, {"rules": dict(rs.rules)}) for rs in (AB, CD)]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


# ---------------------------------------------------------------- dataset rows


def test_aligned_dataset_fields_hand_worked(tok):
    ds = build_aligned_dataset(["CAB"], [AB], [AB, CD], tok, {"expert_index": 1, "is_task": 1})
    row = ds[0]
    # <bos>=1, A=5 B=6 C=7; the logits at the position of x_j predict y_j
    assert row["y"] == "CBB"
    assert row["input_ids"] == [1, 7, 5, 6]
    assert row["targets"] == [-100, 7, 6, 6]
    assert row["masks"] == [[0, 0, 1, 0], [0, 1, 0, 0]]  # A at position 2 (A_to_B), C at position 1 (C_to_D)
    assert (row["output_start"], row["output_len"]) == (1, 3)
    assert (row["expert_index"], row["is_task"]) == (1, 1)
    copy = build_aligned_dataset(["CAB"], [], [], tok)[0]
    assert copy["targets"] == [-100, 7, 5, 6] and copy["masks"] == []
    assert ds.column_names == build_letters_dataset(["CAB"], [AB], [AB, CD], tok, {"expert_index": 1, "is_task": 1}).column_names
    assert dataset_builder("aligned") is build_aligned_dataset and dataset_builder("generative") is build_letters_dataset
    with pytest.raises(ValueError, match="data format 'interleaved' is not one of"):
        dataset_builder("interleaved")
    with pytest.raises(ValueError, match="not letters of the tokenizer"):
        build_aligned_dataset(["Ab"], [], [], tok)


def test_aligned_batch_is_right_padded(tok):
    ids, attn = aligned_batch(tok, ["AB", "CDE"])
    assert ids.tolist() == [[1, 5, 6, 0], [1, 7, 8, 9]]
    assert attn.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


SMALL = dict(n_train=64, n_val=16, n_test=16, min_len=6, max_len=6, format="aligned")


def test_task_builds_every_split_aligned_and_never_corrupts(tok):
    task = LettersTask(LettersConfig(**SMALL), EXPERTS, reg_data="composition")
    assert task.collator(0.5).corruption_prob == 0.0  # no teacher-forced outputs, so nothing to corrupt
    bg = TaskDataModule(task, "background", batch_size=16, corruption_prob=0.5)
    batch = next(iter(bg.train_dataloader()))
    assert torch.equal(batch["input_ids"][:, 1:], batch["targets"][:, 1:])  # copy rows, inputs untouched
    assert (batch["output_start"] == 1).all()
    train = task.expert_dataset("train")
    assert set(train["is_task"]) == {0, 1} and set(train["output_start"]) == {1}  # task and regularizer rows
    for row in train:
        assert row["input_ids"][0] == tok.bos_token_id and len(row["input_ids"]) == 7
    comp = task.compositional_dataset("test")
    assert set(comp["output_start"]) == {1} and len(comp[0]["masks"]) == 2
    for row in comp:
        assert row["y"] == row["x"].replace("A", "B").replace("C", "D")
    a, b, c, d = tok.convert_tokens_to_ids(list("ABCD"))
    dm = TaskDataModule(task, "experts", batch_size=16, corruption_prob=0.5)
    for batch in dm.train_dataloader():  # inputs differ from targets only where a rule rewrote x_j
        ids, tg = batch["input_ids"][:, 1:], batch["targets"][:, 1:]
        changed = ids != tg
        assert (((ids == a) & (tg == b)) | ((ids == c) & (tg == d)))[changed].all()
    with pytest.raises(TaskError, match="task.format='x' is not one of generative, aligned"):
        LettersConfig(format="x")
    with pytest.raises(ConfigError, match="task.format='x' is not one of generative, aligned"):
        load_config(overrides=["task.format=x"])


# ---------------------------------------------------------------- argmax evaluation


def _linear_gpt2(vocab: int, rules: dict[int, int] | None = None):
    """A one-layer GPT-2 whose blocks add nothing (zeroed output projections) and whose output layer reads
    the input token back: a hand-built copy model. ``rules`` {source id: target id} add weight from the
    source's coordinate to the target's logit, so the model rewrites the source (and, elsewhere, only
    lowers the target's logit slightly)."""
    config = GPT2Config(vocab_size=vocab, n_embd=vocab, n_layer=1, n_head=1, n_positions=32, n_inner=8,
                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.copy_(torch.eye(vocab))
        model.transformer.wpe.weight.zero_()
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        head = 10.0 * torch.eye(vocab)
        for src, tgt in (rules or {}).items():
            head[tgt, src] += 20.0
        model.lm_head.weight.copy_(head)
    return model


def test_argmax_evaluation_on_hand_built_models(tok):
    v = len(tok)
    a, b, c, d = tok.convert_tokens_to_ids(list("ABCD"))
    background = _linear_gpt2(v)
    expert_ab, expert_cd = _linear_gpt2(v, {a: b}), _linear_gpt2(v, {c: d})
    # varied lengths (padding); every expert row holds one of its sources, every compositional row both
    cfg = LettersConfig(min_len=5, max_len=9, format="aligned", n_train=40, n_val=40, n_test=40, source_prob=1.0)
    task = LettersTask(cfg, EXPERTS)
    comp = task.compositional_dataset("test")
    xs = list(comp["x"])
    assert {len(x) for x in xs} == set(range(5, 10))
    copy = ComposedLM(background, tokenizer=tok)
    preds, ended = aligned_outputs(copy, tok, xs, batch_size=16)
    assert preds == xs and all(ended)
    assert task.evaluate_background(copy, "test", 16) == {"exact_match": 1.0}
    assert task.evaluate_expert(copy, "A_to_B", "test", 16)["exact_match"] == 0.0  # every x holds an A
    alone = ComposedLM(background, [expert_ab], names=["A_to_B"], tokenizer=tok)
    assert task.evaluate_expert(alone, "A_to_B", "test", batch_size=7)["exact_match"] == 1.0
    assert task.evaluate_expert(alone, "C_to_D", "test", 16)["exact_match"] == 0.0  # C is left alone
    assert task.evaluate_composition(alone, comp, 16)["exact_match"] == 0.0
    composed = ComposedLM(background, [expert_ab, expert_cd], names=["A_to_B", "C_to_D"], tokenizer=tok)
    results = task.composition_metrics(composed, comp, 16)
    assert results["exact_match"] == 1.0
    assert results["A_to_B/skill_accuracy"] == results["C_to_D/skill_accuracy"] == 1.0
    assert results["failures/correct"] == 1.0
    assert results["A_to_B/on_mask_kl"] > 1.0 > 1e-3 > results["projectivity_error"]
    # each expert is active (KL above the threshold) exactly on its own mask, and the two never overlap
    for name in ("A_to_B", "C_to_D"):
        assert results[f"{name}/active_precision"] == results[f"{name}/active_recall"] == 1.0
    assert results["overlap/A_to_B__C_to_D"] == 0.0
    # the decoding half of composition_metrics is evaluate_composition
    assert task.evaluate_composition(composed, comp, 16).items() <= results.items()


def test_aligned_outputs_are_the_argmax_of_score_per_unpadded_row(tok):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2, n_positions=32, n_inner=32)
    background, expert = (AutoModelForCausalLM.from_config(config).eval() for _ in range(2))
    composed = ComposedLM(background, [expert], tokenizer=tok)
    xs = sample_strings(12, ALPHABET, 1, 10, seed=3)
    preds, _ = aligned_outputs(composed, tok, xs, batch_size=5)
    for x, pred in zip(xs, preds, strict=True):
        ids = torch.tensor([[tok.bos_token_id, *tok.convert_tokens_to_ids(list(x))]])
        expected = tok.decode(composed.score(ids)[0, 1:].argmax(-1).tolist(), skip_special_tokens=False)
        assert pred == expected
    assert len(set(preds)) > 1 and preds != xs  # an untrained model predicts (mostly) garbage


# ---------------------------------------------------------------- pipeline


def test_fast_aligned_pipeline_in_process(tmp_path):
    from lightning_modules.pipeline.stages import run

    cfg = load_config([str(ROOT / "configs" / "debug" / "fast.yaml")], base=DEFAULT, overrides=[
        f"output_dir={tmp_path / 'run'}", "task.format=aligned", "task.min_len=6", "task.max_len=6",
        "model.arch=gpt2", "expert.lora.target_modules=[c_attn,c_proj,c_fc]", "report=false",
    ])
    summary = run(cfg)
    assert 0.0 <= summary["background"]["exact_match"] <= 1.0
    for name in ("A_to_B", "C_to_D"):
        entry = summary["experts"][name]
        assert 0.0 <= entry["exact_match"] <= 1.0 and entry["off_mask_kl"] >= 0.0
        assert 0.0 <= entry["skill_accuracy"] <= 1.0
        assert 0.0 <= entry["active_precision"] <= 1.0 and 0.0 <= entry["active_recall"] <= 1.0
    comp = summary["composition"]
    assert 0.0 <= comp["exact_match"] <= 1.0 and comp["k"] == 2 and comp["n_test"] == 32
    assert comp["failures"]["length_or_eos"] == 0.0  # nothing is generated, so no length errors
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["composition"]
    assert written == with_intervals(summary)["composition"]  # the file adds the 95 % intervals
    header = (tmp_path / "run" / "logs" / "experts" / "metrics.csv").read_text().splitlines()[0]
    assert "val/composed/exact_match" in header
    saved = load_config([str(tmp_path / "run" / "config.yaml")])
    assert (saved.task.name, saved.task.format, saved.task.min_len) == ("letters", "aligned", 6)


def test_experiment_config_loads():
    cfg = load_config([str(ROOT / "configs" / "experiment" / "letters_aligned.yaml")], base=DEFAULT)
    assert (cfg.task.name, cfg.task.format, cfg.task.min_len, cfg.task.max_len) == ("letters", "aligned", 16, 16)
    assert (cfg.task.n_train, cfg.data.batch_size, cfg.model.arch) == (2000, 64, "gpt2")
    assert [e.name for e in cfg.experts] == ["A_to_B", "C_to_D"]

