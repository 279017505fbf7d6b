"""The synthetic interval task (`data/tasks/intervals.py`): rows, masks, splits, seeds, collation,
evaluation and input errors."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compose import ComposedLM
from data.tasks import Expert, TaskError, task_class
from data.tasks.intervals import IntervalsConfig, IntervalsTask, skill_accuracy

UPPER = Expert("upper", {"interval": {"start": "[", "end": "]", "regex": False}})
REVERSE = Expert("reverse", {"interval": {"start": "(", "end": ")"}})
SMALL = IntervalsConfig(n_train=120, n_val=40, n_test=40)
SEGMENT = re.compile(r"\[([a-z]+)\]|\(([a-z]+)\)")


def make_task(experts=(UPPER, REVERSE), cfg: IntervalsConfig = SMALL, seed: int = 0, **kwargs) -> IntervalsTask:
    return task_class("intervals")(cfg, list(experts), seed=seed, **kwargs)


@pytest.fixture(scope="module")
def task() -> IntervalsTask:
    return make_task()


def upper(x: str) -> str:
    return re.sub(r"\[([a-z]+)\]", lambda m: f"[{m.group(1).upper()}]", x)


def reverse(x: str) -> str:
    return re.sub(r"\(([a-z]+)\)", lambda m: f"({m.group(1)[::-1]})", x)


def interval_positions(y: str, start: str, end: str) -> set[int]:
    """Characters of y inside a start..end segment (content and end delimiter), found independently."""
    pattern = re.escape(start) + r"[^\[\](){}]*" + re.escape(end)
    return {j for m in re.finditer(pattern, y) for j in range(m.start() + len(start), m.end())}


def check_row(task: IntervalsTask, row: dict, specs: list[tuple[str, str]]) -> None:
    tok, x, y = task.tokenizer, row["x"], row["y"]
    n = len(x)
    assert tok.decode(row["input_ids"], skip_special_tokens=False) == f"<bos>{x}<sep>{y}<eos>"
    scored = [t for t in row["targets"] if t != -100]
    assert tok.decode(scored, skip_special_tokens=False) == f"{y}<eos>"
    assert row["targets"][: n + 1] == [-100] * (n + 1) and row["output_start"] == n + 2
    assert row["output_len"] == len(y)
    assert len(row["masks"]) == len(specs)
    for mask, (start, end) in zip(row["masks"], specs, strict=True):
        assert len(mask) == len(row["input_ids"])
        on = {p - (n + 1) for p, v in enumerate(mask) if v}
        assert on == interval_positions(y, start, end), (y, start)
        assert all(y[j] != start for j in on)  # the start delimiter is never in the mask


def plain_between_segments(x: str, delimiters: str) -> bool:
    return not set(SEGMENT.sub("", x)) & set(delimiters)


# --- rows -----------------------------------------------------------------------------------------------

def test_background_rows_copy_every_kind(task):
    rows = task.background_dataset("train")
    assert len(rows) == SMALL.n_train
    for row in rows:
        assert row["y"] == row["x"] and row["masks"] == []
        check_row(task, row, [])
        assert plain_between_segments(row["x"], "[]()")
    xs = rows["x"]
    assert any("[" in x for x in xs) and any("(" in x for x in xs) and any("[" in x and "(" in x for x in xs)


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_expert_task_rows(split):
    task = make_task(trained=["upper", "reverse"], reg_data="own")
    rows = task.expert_dataset(split)
    assert len(rows) == 2 * getattr(SMALL, f"n_{split}")
    for row in rows:
        name = ["upper", "reverse"][row["expert_index"]]
        x, own, other = row["x"], *(("[]", "()") if name == "upper" else ("()", "[]"))
        assert row["is_task"] == 1 and row["task_on_mask"] == 1
        assert not set(x) & set(other), "an expert's own rows hold only its own segments"
        assert plain_between_segments(x, "[]()")
        assert "][" not in x and ")(" not in x
        assert row["y"] == (upper(x) if name == "upper" else reverse(x))
        check_row(task, row, [tuple(own)])
    with_segments = sum("[" in x or "(" in x for x in rows["x"]) / len(rows)
    assert 0.6 < with_segments < 0.95  # source_prob = 0.8


def test_compositional_rows_hold_both_kinds_in_varying_order(task):
    rows = task.compositional_dataset("test")
    assert len(rows) == SMALL.n_test and set(rows.column_names) >= {"x", "y", "masks"}
    firsts, counts = set(), set()
    for row in rows:
        x = row["x"]
        assert "[" in x and "(" in x
        assert row["y"] == upper(reverse(x))
        assert plain_between_segments(x, "[]()") and not re.search(r"[\])][\[(]", x)  # never touch
        check_row(task, row, [("[", "]"), ("(", ")")])
        firsts.add(x[min(x.index("["), x.index("("))])
        counts.add((x.count("["), x.count("(")))
    assert firsts == {"[", "("} and len(counts) >= 3
    assert len({len(x) for x in rows["x"]}) > 5


@pytest.mark.parametrize("reg_data", ["own", "background", "own+background", "composition"])
def test_regularizer_rows(reg_data):
    task = make_task(trained=["reverse"], reg_data=reg_data)
    rows = task.expert_dataset("train")
    task_rows = rows.filter(lambda r: r["is_task"] == 1)
    reg = rows.filter(lambda r: r["is_task"] == 0)
    assert len(task_rows) == SMALL.n_train and set(task_rows["expert_index"]) == {0}
    if reg_data == "own":
        assert len(reg) == 0
        return
    assert len(reg) == SMALL.n_train
    for row in reg:
        if reg_data == "composition":
            assert row["task_on_mask"] == 1 and row["y"] == upper(reverse(row["x"]))
            assert "[" in row["x"] and "(" in row["x"]
        else:
            assert row["task_on_mask"] == 0 and row["y"] == row["x"]
        check_row(task, row, [("(", ")")])


def test_skill_mapping_and_other_delimiters():
    caps = Expert("caps", {"interval": {"start": "{", "end": "}"}})
    task = make_task([caps], replace(SMALL, skills={"caps": "upper"}), trained=["caps"])
    row = next(r for r in task.expert_dataset("val") if "{" in r["x"])
    assert row["y"] == re.sub(r"\{([a-z]+)\}", lambda m: "{" + m.group(1).upper() + "}", row["x"])
    check_row(task, row, [("{", "}")])


# --- splits and seeds -----------------------------------------------------------------------------------

def test_splits_are_disjoint(task):
    bg = {s: set(task.background_dataset(s)["x"]) for s in ("train", "val", "test")}
    assert not bg["train"] & bg["val"] and not bg["train"] & bg["test"] and not bg["val"] & bg["test"]
    alone = {name: make_task(trained=[name]) for name in ("upper", "reverse")}
    for name in ("upper", "reverse"):
        ex = {s: set(alone[name].expert_dataset(s)["x"]) for s in ("train", "val", "test")}
        assert not ex["train"] & ex["val"] and not ex["train"] & ex["test"] and not ex["val"] & ex["test"]
    comp = {s: set(task.compositional_dataset(s)["x"]) for s in ("val", "test")}
    assert not comp["val"] & comp["test"]
    train = set(bg["train"])
    for reg_data in ("background", "composition"):
        train |= set(make_task(trained=["upper", "reverse"], reg_data=reg_data).expert_dataset("train")["x"])
    held_out = comp["val"] | comp["test"]
    for name in ("upper", "reverse"):
        held_out |= set(alone[name].expert_dataset("val")["x"]) | set(alone[name].expert_dataset("test")["x"])
    assert not train & held_out


def test_seeds_are_stable_and_per_expert():
    a, b, c = make_task(trained=["upper"]), make_task(trained=["upper"]), make_task(seed=1)
    for split in ("train", "test"):
        assert a.background_dataset(split)["x"] == b.background_dataset(split)["x"]
        assert a.expert_dataset(split)["x"] == b.expert_dataset(split)["x"]
    assert a.compositional_dataset("val")["y"] == b.compositional_dataset("val")["y"]
    assert a.background_dataset("train")["x"] != c.background_dataset("train")["x"]
    # Adding (or dropping) an expert leaves the others' own rows unchanged.
    alone = make_task([UPPER])
    for split in ("train", "val", "test"):
        assert alone.expert_dataset(split)["x"] == a.expert_dataset(split)["x"]


# --- collation ------------------------------------------------------------------------------------------

def test_collator_corrupts_letters_never_delimiters(task):
    rows = [task.compositional_dataset("val")[i] for i in range(16)]
    clean = task.collator(0.0)(rows)
    torch.manual_seed(0)
    batch = task.collator(1.0)(rows)
    assert torch.equal(batch["targets"], clean["targets"]) and batch["masks"].shape == (16, 2, clean["masks"].shape[2])
    vocab = task.tokenizer.get_vocab()
    delimiters = torch.tensor([vocab[c] for c in "[]()"])
    for b, row in enumerate(rows):
        start, n = row["output_start"], row["output_len"]
        before, after = clean["input_ids"][b], batch["input_ids"][b]
        assert torch.equal(before[:start], after[:start]) and torch.equal(before[start + n:], after[start + n:])
        out_before, out_after = before[start:start + n], after[start:start + n]
        is_delim = torch.isin(out_before, delimiters)
        assert torch.equal(out_before[is_delim], out_after[is_delim])
        assert (out_before[~is_delim] != out_after[~is_delim]).all()  # p = 1: every letter changes
        assert not torch.isin(out_after[~is_delim], delimiters).any()


# --- evaluation -----------------------------------------------------------------------------------------

class Oracle:
    """`generate` returns each prompt followed by its reference (`answer(x)`) and <eos>."""

    def __init__(self, tokenizer, answer) -> None:
        self.tok, self.answer = tokenizer, answer

    def generate(self, input_ids, attention_mask, *, max_new_tokens, eos_token_id, pad_token_id, **_):
        tok, outs = self.tok, []
        for ids, attn in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            x = tok.decode([i for i, a in zip(ids, attn, strict=True) if a][1:-1])
            outs.append(tok.convert_tokens_to_ids(list(self.answer(x))) + [eos_token_id])
        assert max(map(len, outs)) <= max_new_tokens
        width = max(map(len, outs))
        new = torch.tensor([o + [pad_token_id] * (width - len(o)) for o in outs])
        return torch.cat([input_ids, new], dim=1)


def test_oracle_scores_one(task):
    tok = task.tokenizer
    perfect = Oracle(tok, lambda x: upper(reverse(x)))
    scores = task.evaluate_composition(perfect, task.compositional_dataset("test"), batch_size=16)
    assert scores["exact_match"] == 1.0 and scores["failures/correct"] == 1.0
    assert scores["upper/skill_accuracy"] == 1.0 and scores["reverse/skill_accuracy"] == 1.0
    assert task.evaluate_background(Oracle(tok, lambda x: x), "val", 16) == {"exact_match": 1.0}
    assert task.evaluate_expert(Oracle(tok, reverse), "reverse", "test", 16)["exact_match"] == 1.0
    assert task.evaluate_expert(Oracle(tok, upper), "upper", "val", 16) == {"exact_match": 1.0,
                                                                              "skill_accuracy": 1.0}


def test_skill_accuracy_counts_each_experts_segments(task):
    rows = task.compositional_dataset("test")
    scores = task.evaluate_composition(Oracle(task.tokenizer, upper), rows, batch_size=64)  # reverse missing
    assert scores["upper/skill_accuracy"] == 1.0
    assert scores["reverse/skill_accuracy"] < 0.6 and scores["exact_match"] < 0.5
    assert scores["failures/rule_not_applied"] == pytest.approx(1.0 - scores["exact_match"])
    spec = task.kinds[1].spec
    assert skill_accuracy(["a(cb)d(ef)"], ["a(bc)d(ef)"], spec) == 0.5
    assert skill_accuracy(["a(bc"], ["a(bc)"], spec) == 0.0  # unclosed segment
    assert skill_accuracy(["x"], ["x"], spec) == 1.0  # nothing to reproduce


def tiny_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_evaluation_of_a_random_llama_is_in_range():
    task = make_task(cfg=replace(SMALL, n_val=8, n_test=8))
    tok = task.tokenizer
    bg, e1, e2 = (tiny_llama(len(tok), s) for s in range(3))
    alone = ComposedLM(bg, [e1], names=["upper"], tokenizer=tok)
    both = ComposedLM(bg, [e1, e2], names=["upper", "reverse"], tokenizer=tok)
    results = [task.evaluate_background(ComposedLM(bg, tokenizer=tok), "val", 4),
               task.evaluate_expert(alone, "upper", "val", 4),
               task.evaluate_composition(both, task.compositional_dataset("val"), 4)]
    assert set(results[1]) == {"exact_match", "skill_accuracy"}
    assert {"exact_match", "upper/skill_accuracy", "reverse/skill_accuracy", "failures/correct"} <= set(results[2])
    for scores in results:
        assert all(0.0 <= v <= 1.0 for v in scores.values()), scores


# --- input errors ---------------------------------------------------------------------------------------

def interval(name: str, start: str, end: str, **extra) -> Expert:
    return Expert(name, {"interval": {"start": start, "end": end, **extra}})


@pytest.mark.parametrize("experts, cfg, match", [
    ([interval("shout", "[", "]")], SMALL, "skill 'shout' is not one of"),
    ([interval("upper", "[", "]"), interval("reverse", "[", "]")], SMALL, "share the delimiter character"),
    ([interval("upper", "[", "]"), interval("reverse", "(", "[")], SMALL, "share the delimiter character"),
    ([interval("upper", "a", "]")], SMALL, "are text characters"),
    ([interval("upper", "[", "Z")], SMALL, "are text characters"),
    ([interval("upper", r"\[", r"\]", regex=True)], SMALL, "regex interval specs are not supported"),
    ([interval("upper", "", "]")], SMALL, "'start' is missing or empty"),
    ([interval("upper", "<", ">")], SMALL, "delimiters cannot be tokens"),
    ([Expert("upper", {"rules": {"a": "b"}})], SMALL, "needs `interval`"),
    ([interval("lower", "[", "]")], SMALL, "leaves every text"),
    ([interval("upper", "[", "]"), interval("upper", "(", ")")], SMALL, "used more than once"),
    ([UPPER, REVERSE], replace(SMALL, min_len=4, max_len=6), "cannot hold one segment"),
    ([UPPER], replace(SMALL, compositional_min_experts=2), "exceeds the 1 experts"),
])
def test_bad_experts_raise_one_line(experts, cfg, match):
    with pytest.raises(TaskError, match=match) as err:
        make_task(experts, cfg)
    assert "\n" not in str(err.value)


def test_allow_overlap_does_not_accept_shared_delimiters():
    experts = [interval("upper", "[", "]"), interval("reverse", "[", "]")]
    with pytest.raises(TaskError, match="share the delimiter character.*allow_overlap or not") as err:
        make_task(experts, allow_overlap=True)
    assert "\n" not in str(err.value)
    assert make_task(allow_overlap=True).allow_overlap  # disjoint delimiters are fine either way


@pytest.mark.parametrize("changes, match", [
    ({"min_len": 10, "max_len": 9}, "min_len <= max_len"),
    ({"min_segment_len": 0}, "min_segment_len"),
    ({"max_segments": 0}, "min_segments <= max_segments"),
    ({"source_prob": 1.5}, "source_prob"),
    ({"n_val": 0}, "n_val"),
    ({"compositional_min_experts": 1}, "compositional_min_experts"),
    ({"alphabet": "ab<"}, "task.alphabet"),
])
def test_bad_config_raises(changes, match):
    with pytest.raises(TaskError, match=match):
        IntervalsConfig(**changes)


def test_bad_calls_and_standard_experts(task):
    with pytest.raises(TaskError, match="not among the experts in play") as err:
        make_task(trained=["nobody"])
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match="reg_data") as err:
        make_task(trained=["upper"], reg_data="everything")
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match="no experts named"):
        make_task(trained=[]).expert_dataset("train")
    with pytest.raises(TaskError, match="not in play"):
        task.evaluate_expert(None, "nobody", "val", 1)
    with pytest.raises(ValueError, match="split"):
        task.compositional_dataset("train")
    with pytest.raises(TaskError, match="at least one expert"):
        make_task([]).compositional_dataset("val")
    with pytest.raises(TaskError, match="k=4"):
        task.standard_experts(4)
    standard = task.standard_experts(3)
    assert [e["name"] for e in standard] == ["upper", "reverse", "rot13"]
    three = make_task([Expert(e["name"], {"interval": e["interval"]}) for e in standard])
    row = three.compositional_dataset("val")[0]
    assert "{" in row["x"] and len(row["masks"]) == 3
    with pytest.raises(TaskError, match="character tokenizer"):
        IntervalsTask(SMALL, [UPPER], tokenizer=make_task([]).tokenizer)  # no delimiter tokens
