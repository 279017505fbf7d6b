"""Tests of the data side: tokenizer, letter rules and rows, the generic collator, splits and datamodule,
and the letter task behind the task seam (rows, determinism, decoding-side evaluation)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from data.collate import Collator
from data.datamodule import TaskDataModule
from data.splits import derive_seed, draw_excluding
from data.tasks import Expert, TaskError
from data.tasks.letters import (
    LettersConfig,
    LettersTask,
    RuleSet,
    apply_rules,
    build_letters_dataset,
    compositional_inputs,
    decode_outputs,
    expert_inputs,
    prompt_batch,
    random_rule_outputs,
    sample_strings,
    validate_rule_sets,
)
from data.tokenizer import build_char_tokenizer, letter_ids
from losses import IGNORE_INDEX

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
AB, CD, EF = RuleSet("ab", {"A": "B"}), RuleSet("cd", {"C": "D"}), RuleSet("ef", {"E": "F"})


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def expert(rs: RuleSet) -> Expert:
    """The task-seam view of a rule set."""
    return Expert(rs.name, {"rules": dict(rs.rules)})


def letters_collator(tok, corruption_prob: float = 0.0, generator=None) -> Collator:
    """What `LettersTask.collator` builds: pad id, the letters as the corruption set."""
    return Collator(tok.pad_token_id, letter_ids(tok, ALPHABET), corruption_prob, generator=generator)


def output_positions(batch) -> torch.Tensor:
    """[B, T] bool: the teacher-forced output span of every row."""
    pos = torch.arange(batch["input_ids"].shape[1])
    start, length = batch["output_start"][:, None], batch["output_len"][:, None]
    return (pos >= start) & (pos < start + length)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_decode(tok):
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.sep_token_id, tok.unk_token_id] == [
        0, 1, 2, 3, 4
    ]
    assert len(tok) == 31
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4, 5, 30]) == ["<pad>", "<bos>", "<eos>", "<sep>", "<unk>", "A", "Z"]
    assert tok.encode("ABC", add_special_tokens=False) == [5, 6, 7]
    assert tok.encode("ZYX", add_special_tokens=False) == [30, 29, 28]
    assert tok.decode([5, 6, 7]) == "ABC"
    assert tok.decode([1, 5, 6, 7, 3, 2]) == "<bos>ABC<sep><eos>"
    assert tok.decode([1, 5, 6, 7, 3, 2], skip_special_tokens=True) == "ABC"
    assert tok.encode("A?B", add_special_tokens=False) == [5, 4, 6]  # unknown character -> <unk>
    assert letter_ids(tok, "ABC") == [5, 6, 7]


def test_tokenizer_custom_alphabet_and_validation():
    small = build_char_tokenizer("xyz")
    assert small.encode("zyx", add_special_tokens=False) == [7, 6, 5]
    assert letter_ids(small, "xyz") == [5, 6, 7]
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        letter_ids(small, "xA")
    with pytest.raises(ValueError, match="non-empty"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="repeats the character 'A'"):
        build_char_tokenizer("ABA")
    with pytest.raises(ValueError, match="clashes with the special tokens"):
        build_char_tokenizer("AB<")
    with pytest.raises(ValueError, match="clashes with the special tokens"):
        build_char_tokenizer("A B")


def test_tokenizer_save_and_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded.get_vocab() == tok.get_vocab()
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "unk_token_id"):
        assert getattr(reloaded, attr) == getattr(tok, attr)
    assert reloaded.encode("HELLO", add_special_tokens=False) == [12, 9, 16, 16, 19]
    assert reloaded.decode([1, 12, 9, 3, 2], skip_special_tokens=True) == "HE"
    enc = reloaded(["AB", "ABCD"], padding=True, add_special_tokens=False)
    assert enc["input_ids"] == [[5, 6, 0, 0], [5, 6, 7, 8]]
    assert enc["attention_mask"] == [[1, 1, 0, 0], [1, 1, 1, 1]]


# ---------------------------------------------------------------- rules


def test_validate_rule_sets_errors():
    assert validate_rule_sets([AB, CD], ALPHABET) == []
    with pytest.raises(ValueError, match=r"rule set 'bad': rules key 'a' .* not a single letter"):
        validate_rule_sets([RuleSet("bad", {"a": "B"})], ALPHABET)
    with pytest.raises(ValueError, match=r"rule set 'bad': rules value '1'"):
        validate_rule_sets([RuleSet("bad", {"A": "1"})], ALPHABET)
    with pytest.raises(ValueError, match=r"rule set 'multi': rules key 'AB'"):
        validate_rule_sets([RuleSet("multi", {"AB": "C"})], ALPHABET)
    with pytest.raises(ValueError, match="used by more than one expert"):
        validate_rule_sets([AB, RuleSet("ab", {"C": "D"})], ALPHABET)
    with pytest.raises(ValueError, match="empty name"):
        validate_rule_sets([RuleSet("", {"A": "B"})], ALPHABET)
    with pytest.raises(ValueError, match="'none' has no rules"):
        validate_rule_sets([RuleSet("none", {})], ALPHABET)
    with pytest.raises(ValueError, match="maps a letter to itself"):
        validate_rule_sets([RuleSet("id", {"A": "A"})], ALPHABET)
    other = RuleSet("ac", {"A": "C"})
    with pytest.raises(ValueError, match="source letter 'A' is shared by experts 'ab' and 'ac'"):
        validate_rule_sets([AB, other], ALPHABET)
    assert validate_rule_sets([AB, other, CD], ALPHABET, allow_overlap=True) == [
        "source letter 'A' is shared by experts 'ab' and 'ac'"
    ]


def test_apply_rules_is_simultaneous():
    bc = RuleSet("bc", {"B": "C"})
    assert apply_rules("AB", [AB, bc]) == "BC"
    assert apply_rules("AB", [bc, AB]) == "BC"
    assert apply_rules("ABCA", [AB, CD]) == "BBDB"
    assert apply_rules("ABC", []) == "ABC"
    assert AB.apply("CAB") == "CBB"
    assert AB.sources == frozenset({"A"})
    with pytest.raises(ValueError, match="different targets"):
        apply_rules("A", [AB, RuleSet("ac", {"A": "C"})])


# ---------------------------------------------------------------- sampling


def test_sample_strings_lengths_seed_and_planting():
    xs = sample_strings(300, ALPHABET, 3, 6, seed=1)
    assert len(xs) == 300 and {len(x) for x in xs} == {3, 4, 5, 6}
    assert xs == sample_strings(300, ALPHABET, 3, 6, seed=1)
    assert xs != sample_strings(300, ALPHABET, 3, 6, seed=2)
    planted = sample_strings(300, ALPHABET, 2, 4, seed=3, must_contain=[{"Q"}, {"X", "Z"}])
    assert all("Q" in x and ("X" in x or "Z" in x) for x in planted)
    with pytest.raises(ValueError, match="min_len >= len"):
        sample_strings(5, ALPHABET, 2, 4, seed=0, must_contain=[{"A"}, {"B"}, {"C"}])
    with pytest.raises(ValueError, match="outside the alphabet"):
        sample_strings(5, ALPHABET, 2, 4, seed=0, must_contain=[{"a"}])


def test_expert_inputs_planted_fraction():
    xs = expert_inputs(1000, ALPHABET, 8, 16, seed=0, rule_set=AB, source_prob=0.5)
    with_a = sum("A" in x for x in xs) / len(xs)
    # half planted, the other half contain 'A' by chance with p ~ 1 - (25/26)^12 ~ 0.37
    assert 0.64 < with_a < 0.74
    assert all("A" in x for x in expert_inputs(200, ALPHABET, 8, 16, seed=0, rule_set=AB, source_prob=1.0))


def test_compositional_inputs_contain_every_expert():
    experts = [AB, CD, EF, RuleSet("gh", {"G": "H", "I": "J"})]
    xs = compositional_inputs(400, ALPHABET, 8, 16, seed=0, rule_sets=experts)
    assert all(any(s in x for s in e.sources) for x in xs for e in experts)
    some = compositional_inputs(400, ALPHABET, 8, 16, seed=0, rule_sets=experts, min_experts=2)
    counts = [sum(any(s in x for s in e.sources) for e in experts) for x in some]
    assert min(counts) >= 2
    with pytest.raises(ValueError, match="min_experts must be in"):
        compositional_inputs(4, ALPHABET, 8, 16, seed=0, rule_sets=experts, min_experts=1)
    with pytest.raises(ValueError, match="min_len >= len"):
        compositional_inputs(4, ALPHABET, 3, 16, seed=0, rule_sets=experts)


def test_split_helpers():
    assert derive_seed(0, "expert", "ab") == derive_seed(0, "expert", "ab")  # stable (no hash randomization)
    assert len({derive_seed(0, "a"), derive_seed(0, "b"), derive_seed(1, "a"), derive_seed(0, "a", 0)}) == 4
    assert all(0 <= derive_seed(s, "x") < 2**63 for s in range(20))
    # draws from successive attempts until n strings avoid `exclude`
    calls = []

    def make(attempt):
        calls.append(attempt)
        return [f"{attempt}{i}" for i in range(3)]

    assert draw_excluding(make, 4, {"00", "01"}, "t") == ["02", "10", "11", "12"] and calls == [0, 1]
    # a string space too small: warns, and the split overlaps the excluded strings
    with pytest.warns(UserWarning, match="tiny: could not draw 3 inputs disjoint"):
        assert draw_excluding(lambda attempt: ["x", "y", "z"], 3, {"x", "y", "z"}, "tiny") == ["x", "y", "z"]
    with pytest.warns(UserWarning, match=r"background (val|test): could not draw"):
        LettersTask(LettersConfig(alphabet="AB", min_len=2, max_len=2, n_train=4, n_val=4, n_test=4),
                    []).background_dataset("val")


# ---------------------------------------------------------------- dataset rows


def test_dataset_fields_hand_worked(tok):
    ds = build_letters_dataset(["CAB"], [AB], [AB, CD], tok, {"expert_index": 1, "is_task": 1})
    row = ds[0]
    # C=7 A=5 B=6; <bos>=1 <sep>=3 <eos>=2
    assert row["y"] == "CBB"
    assert row["input_ids"] == [1, 7, 5, 6, 3, 7, 6, 6, 2]
    assert row["targets"] == [-100, -100, -100, -100, 7, 6, 6, 2, -100]
    assert row["masks"] == [[0, 0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0, 0]]
    assert (row["output_start"], row["output_len"]) == (5, 3)
    assert (row["expert_index"], row["is_task"]) == (1, 1)
    copy = build_letters_dataset(["CAB"], [], [], tok)[0]
    assert copy["y"] == "CAB" and copy["masks"] == []
    assert copy["targets"] == [-100, -100, -100, -100, 7, 5, 6, 2, -100]


def test_dataset_alignment_invariants(tok):
    xs = sample_strings(200, ALPHABET, 1, 12, seed=5)
    ds = build_letters_dataset(xs, [AB, CD], [AB, CD], tok)
    for row in ds:
        n, ids, tg = len(row["x"]), row["input_ids"], row["targets"]
        scored = [t for t, v in enumerate(tg) if v != IGNORE_INDEX]
        assert scored == list(range(n + 1, 2 * n + 2))
        assert all(tg[t] == ids[t + 1] for t in scored)
        assert tok.decode(ids[row["output_start"] : row["output_start"] + row["output_len"]]) == row["y"]
        for mask, e in zip(row["masks"], (AB, CD), strict=True):
            assert [t for t, m in enumerate(mask) if m] == [n + 1 + j for j, ch in enumerate(row["x"]) if ch in e.sources]
            assert mask[2 * n + 1] == 0  # the <eos> target is in no mask


def test_dataset_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="not letters of the tokenizer"):
        build_letters_dataset(["Ab"], [], [], tok)
    with pytest.raises(ValueError, match="clashes with a built-in column"):
        build_letters_dataset(["AB"], [], [], tok, {"targets": 1})


# ---------------------------------------------------------------- collator


def test_collator_pads_and_checks_k(tok):
    ds = build_letters_dataset(["CAB", "A"], [AB], [AB], tok, {"expert_index": 0, "is_task": 1})
    batch = letters_collator(tok)([ds[0], ds[1]])
    # string columns (x, y) are dropped, every numeric column becomes a [B] tensor
    assert set(batch) == {"input_ids", "attention_mask", "targets", "masks", "output_start", "output_len",
                          "expert_index", "is_task"}
    assert batch["input_ids"].tolist() == [[1, 7, 5, 6, 3, 7, 6, 6, 2], [1, 5, 3, 6, 2, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1] * 5 + [0] * 4]
    assert batch["targets"][1].tolist() == [-100, -100, 6, 2, -100, -100, -100, -100, -100]
    assert batch["masks"].dtype == torch.bool and batch["masks"].shape == (2, 1, 9)
    assert batch["masks"][1, 0].tolist() == [False, False, True] + [False] * 6
    assert batch["output_start"].tolist() == [5, 3] and batch["output_len"].tolist() == [3, 1]
    assert batch["expert_index"].dtype == torch.long
    other = build_letters_dataset(["CAB"], [AB], [AB, CD], tok, {"expert_index": 0, "is_task": 1})
    with pytest.raises(ValueError, match="different numbers of masks"):
        letters_collator(tok)([ds[0], other[0]])
    # the task's own collator is this one: pad id, letters as the corruption set
    task_collate = LettersTask(LettersConfig(), [expert(AB)]).collator(0.25)
    assert task_collate.pad_token_id == tok.pad_token_id and task_collate.corruption_prob == 0.25
    assert task_collate.corruption_ids.tolist() == letter_ids(tok, ALPHABET)


def test_collator_columns_and_errors(tok):
    rows = [{"input_ids": [1, 5, 6], "targets": [5, 6, -100], "masks": [], "output_start": 1, "output_len": 2,
             "weight": 0.5, "name": "a"},
            {"input_ids": [1, 7], "targets": [7, -100], "masks": [], "output_start": 1, "output_len": 1,
             "weight": 2.0, "name": "b"}]
    batch = Collator(tok.pad_token_id)(rows)
    assert batch["weight"].dtype == torch.float32 and batch["weight"].tolist() == [0.5, 2.0]
    assert "name" not in batch and batch["masks"].shape == (2, 0, 3)
    assert batch["targets"].tolist() == [[5, 6, -100], [7, -100, -100]]
    with pytest.raises(ValueError, match="empty list of rows"):
        Collator(tok.pad_token_id)([])
    with pytest.raises(ValueError, match="targets length 2 != input_ids length 3"):
        Collator(tok.pad_token_id)([{**rows[0], "targets": [5, 6]}])
    with pytest.raises(ValueError, match="missing from some rows"):
        Collator(tok.pad_token_id)([rows[0], {k: v for k, v in rows[1].items() if k != "weight"}])
    with pytest.raises(ValueError, match=r"corruption_prob must be in \[0, 1\]"):
        Collator(tok.pad_token_id, [5, 6], 1.5)
    with pytest.raises(ValueError, match="needs corruption_ids"):
        Collator(tok.pad_token_id, (), 0.5)
    no_span = [{k: v for k, v in r.items() if k not in ("output_start", "output_len")} for r in rows]
    with pytest.raises(ValueError, match="needs the output_start and output_len columns"):
        Collator(tok.pad_token_id, [5, 6], 0.5)(no_span)
    # a column with one value per token is padded with 0 to [B, T]; a 0-dim tensor is a scalar
    per_token = [{**rows[0], "after_close": [0, 0, 1], "step": torch.tensor(3)},
                 {**rows[1], "after_close": [1, 0], "step": torch.tensor(4)}]
    batch = Collator(tok.pad_token_id)(per_token)
    assert batch["after_close"].tolist() == [[0, 0, 1], [1, 0, 0]] and batch["step"].tolist() == [3, 4]
    with pytest.raises(ValueError, match="row 1: column 'after_close' needs one value per token"):
        Collator(tok.pad_token_id)([per_token[0], {**per_token[1], "after_close": [1]}])


def test_corruption_changes_only_output_letters_at_the_rate(tok):
    xs = sample_strings(1000, ALPHABET, 8, 16, seed=0)
    rows = list(build_letters_dataset(xs, [AB], [AB], tok))
    clean = letters_collator(tok)(rows)
    assert torch.equal(letters_collator(tok, 0.0)(rows)["input_ids"], clean["input_ids"])
    noisy = letters_collator(tok, 0.5, generator=torch.Generator().manual_seed(0))(rows)
    output = output_positions(clean)
    changed = noisy["input_ids"] != clean["input_ids"]
    assert not (changed & ~output).any()  # bos, x, sep, eos, padding untouched
    rate = changed[output].float().mean().item()
    assert abs(rate - 0.5) < 0.05
    assert torch.equal(noisy["targets"], clean["targets"]) and torch.equal(noisy["masks"], clean["masks"])
    letters = torch.tensor(letter_ids(tok, ALPHABET))
    assert torch.isin(noisy["input_ids"][output], letters).all()
    # fresh draw per call; reproducible from the generator's seed
    collate = letters_collator(tok, 0.5, generator=torch.Generator().manual_seed(0))
    first, second = collate(rows)["input_ids"], collate(rows)["input_ids"]
    assert torch.equal(first, noisy["input_ids"]) and not torch.equal(first, second)


def test_corruption_range_draws_a_rate_per_row(tok):
    """`(low, high)`: each row's edit rate is uniform in the range, so one batch holds light and heavy edits."""
    xs = sample_strings(2000, ALPHABET, 16, 16, seed=2)
    rows = list(build_letters_dataset(xs, [AB], [AB], tok))
    clean = letters_collator(tok)(rows)
    noisy = letters_collator(tok, (0.0, 0.8), generator=torch.Generator().manual_seed(0))(rows)
    output = output_positions(clean)
    changed = (noisy["input_ids"] != clean["input_ids"]) & output
    per_row = changed.sum(1).float() / output.sum(1)
    assert not ((noisy["input_ids"] != clean["input_ids"]) & ~output).any()
    assert abs(per_row.mean().item() - 0.4) < 0.02  # the mean of U(0, 0.8)
    assert (per_row < 0.1).float().mean() > 0.08 and (per_row > 0.7).float().mean() > 0.08  # both ends occur
    assert abs(per_row.std().item() - 0.8 / 12 ** 0.5) < 0.03  # far wider than one rate's binomial spread
    assert letters_collator(tok, (0.3, 0.3)).corruption_prob == 0.3
    for bad in ((0.5, 0.2), (0.0, 1.5), (0.1, 0.2, 0.3), True, "ab", float("nan")):
        with pytest.raises(ValueError, match=r"corruption_prob must be in \[0, 1\]"):
            letters_collator(tok, bad)


def test_corruption_replaces_tokens_outside_the_set_by_tokens_of_it(tok):
    """Output tokens outside `corruption_ids` (other letters, a tokenizer's special tokens) are replaced by a
    token of the set; tokens of the set by a *different* one (it used to be an error)."""
    xs = sample_strings(300, ALPHABET, 8, 16, seed=1)
    rows = list(build_letters_dataset(xs, [], [], tok))
    rows.append({**rows[0], "input_ids": [*rows[0]["input_ids"][:-3], tok.sep_token_id, tok.unk_token_id,
                                          tok.eos_token_id]})  # special tokens inside the output span
    clean = Collator(tok.pad_token_id)(rows)
    output = output_positions(clean)
    abc = letter_ids(tok, "ABC")
    noisy = Collator(tok.pad_token_id, abc, 1.0, generator=torch.Generator().manual_seed(0))(rows)
    assert torch.isin(noisy["input_ids"][output], torch.tensor(abc)).all()
    assert (noisy["input_ids"] != clean["input_ids"])[output].all()  # ρ = 1: every output token changes
    assert torch.equal(noisy["input_ids"][~output], clean["input_ids"][~output])
    outside = output & ~torch.isin(clean["input_ids"], torch.tensor(abc))
    drawn = noisy["input_ids"][outside]
    assert outside.sum() > 1000 and {int(t) for t in drawn.unique()} == set(abc)  # uniform over the set
    # a one-token set: everything outside it becomes that token
    (a,) = letter_ids(tok, "A")
    single = Collator(tok.pad_token_id, [a], 1.0)(rows)
    assert (single["input_ids"][output] == a).all()


# ---------------------------------------------------------------- generation helpers


def test_prompt_batch_and_decode_outputs(tok):
    ids, attn = prompt_batch(tok, ["AB", "CDE"])
    assert ids.tolist() == [[0, 1, 5, 6, 3], [1, 7, 8, 9, 3]]
    assert attn.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    generated = torch.cat([ids, torch.tensor([[6, 6, 2, 0], [7, 3, 9, 10]])], dim=1)
    assert decode_outputs(tok, generated, ids.shape[1]) == [("BB", True), ("C<sep>EF", False)]


# ---------------------------------------------------------------- the letter task and its datamodule

SMALL = dict(n_train=240, n_val=40, n_test=60, min_len=4, max_len=10)


def test_task_settings_and_construction_errors():
    assert issubclass(TaskError, ValueError)
    with pytest.raises(TaskError, match="min_len <= max_len"):
        LettersConfig(min_len=5, max_len=4)
    with pytest.raises(TaskError, match=r"task.n_val=0: must be an integer in \[1, "):
        LettersConfig(n_val=0)
    with pytest.raises(TaskError, match=r"task.source_prob must be in \[0, 1\]"):
        LettersConfig(source_prob=1.5)
    with pytest.raises(TaskError, match="task.compositional_min_experts must be None or >= 2"):
        LettersConfig(compositional_min_experts=1)
    with pytest.raises(TaskError, match="task.alphabet: .*repeats the character 'A'"):
        LettersConfig(alphabet="ABA")
    cfg = LettersConfig(**SMALL)
    with pytest.raises(TaskError, match=r"reg_data='kl' is not one of own, background, composition, own\+background, "
                                        "random_rules"):
        LettersTask(cfg, [expert(AB)], reg_data="kl")
    with pytest.raises(TaskError, match=r"trained experts \['ef'\] are not among the experts in play \['ab', 'cd'\]"):
        LettersTask(cfg, [expert(AB), expert(CD)], trained=["ef"])
    with pytest.raises(TaskError, match="expert 'up': the letters task needs `rules`"):
        LettersTask(cfg, [Expert("up", {"interval": {"start": "[", "end": "]"}})])
    with pytest.raises(TaskError, match="experts: source letter 'A' is shared by experts 'ab' and 'ac'"):
        LettersTask(cfg, [expert(AB), Expert("ac", {"rules": {"A": "C"}})])
    with pytest.raises(TaskError, match="experts: rule set 'ab': rules key 'a'"):
        LettersTask(cfg, [Expert("ab", {"rules": {"a": "B"}})])
    with pytest.raises(TaskError, match="compositional_min_experts=3 exceeds the 2 experts in play"):
        LettersTask(LettersConfig(compositional_min_experts=3, **SMALL), [expert(AB), expert(CD)])
    task = LettersTask(cfg, [expert(AB)])
    with pytest.raises(ValueError, match=r"corruption_prob must be in \[0, 1\]"):
        task.collator(1.5)
    with pytest.raises(ValueError, match="rows must be 'background' or 'experts'"):
        TaskDataModule(task, "compositional")
    for method in (task.background_dataset, task.expert_dataset, task.compositional_dataset):
        with pytest.raises(ValueError, match="split must be one of"):
            method("dev")


def test_standard_experts_and_notes():
    task = LettersTask(LettersConfig(alphabet="ABCDEFG", min_len=4, max_len=6), [expert(AB)])
    assert task.standard_experts(3) == [{"name": "A_to_B", "rules": {"A": "B"}}, {"name": "C_to_D", "rules": {"C": "D"}},
                                        {"name": "E_to_F", "rules": {"E": "F"}}]
    with pytest.raises(TaskError, match="k=4 experts with disjoint single-letter rules need 8 letters; the alphabet has 7"):
        task.standard_experts(4)
    assert task.notes == []
    overlapping = LettersTask(LettersConfig(**SMALL), [expert(AB), Expert("ac", {"rules": {"A": "C"}})],
                              allow_overlap=True)
    assert overlapping.notes == ["source letter 'A' is shared by experts 'ab' and 'ac'"]


def test_background_rows_and_loaders(tok):
    task = LettersTask(LettersConfig(**SMALL), [])
    dm = TaskDataModule(task, "background", batch_size=32, corruption_prob=0.3)
    assert [len(dm.dataset(s)) for s in ("train", "val", "test")] == [240, 40, 60]
    assert dm.dataset("test") is task.background_dataset("test")  # built once
    train, val, test = (set(task.background_dataset(s)["x"]) for s in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    assert all(row["y"] == row["x"] for row in task.background_dataset("train"))
    # the background's rows do not depend on the experts in play
    with_experts = LettersTask(LettersConfig(**SMALL), [expert(AB), expert(CD)], reg_data="composition")
    assert with_experts.background_dataset("train")["x"] == task.background_dataset("train")["x"]
    batch = next(iter(dm.train_dataloader()))
    assert batch["masks"].shape == (32, 0, batch["input_ids"].shape[1])
    out = batch["targets"] != IGNORE_INDEX
    shifted = torch.roll(batch["input_ids"], -1, dims=1)
    # train batches are corrupted on teacher-forced outputs (targets stay clean) ...
    assert (shifted[out] != batch["targets"][out]).any()
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        vb = next(iter(loader))
        out = vb["targets"] != IGNORE_INDEX
        # ... val and test batches are clean: every target is the next input token
        assert torch.equal(torch.roll(vb["input_ids"], -1, dims=1)[out], vb["targets"][out])


def test_expert_rows_and_batches(tok):
    task = LettersTask(LettersConfig(**SMALL), [expert(AB), expert(CD), expert(EF)], reg_data="background")
    dm = TaskDataModule(task, "experts", batch_size=32, corruption_prob=0.2)
    train, val, test = (task.expert_dataset(s) for s in ("train", "val", "test"))
    assert len(train) == 3 * 2 * 240 and len(val) == 3 * 40 and len(test) == 3 * 60
    batch = next(iter(dm.train_dataloader()))
    T = batch["input_ids"].shape[1]
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "input_ids": ((32, T), torch.long), "attention_mask": ((32, T), torch.long),
        "targets": ((32, T), torch.long), "masks": ((32, 1, T), torch.bool),
        "output_start": ((32,), torch.long), "output_len": ((32,), torch.long),
        "expert_index": ((32,), torch.long), "is_task": ((32,), torch.long),
        "task_on_mask": ((32,), torch.long),
    }
    assert len(set(batch["expert_index"].tolist())) > 1 and set(batch["is_task"].tolist()) == {0, 1}
    assert batch["task_on_mask"].tolist() == batch["is_task"].tolist()  # copy rows: their masks hold copies
    for row in train.select(range(0, len(train), 37)):
        rs = (AB, CD, EF)[row["expert_index"]]
        assert row["y"] == (rs.apply(row["x"]) if row["is_task"] else row["x"])
        n = len(row["x"])
        assert [t for t, m in enumerate(row["masks"][0]) if m] == [
            n + 1 + j for j, ch in enumerate(row["x"]) if ch in rs.sources
        ]
    vb = next(iter(dm.val_dataloader()))
    assert vb["expert_index"].tolist() == [0] * 32 and vb["is_task"].tolist() == [1] * 32
    val_ef = val.filter(lambda r: r["expert_index"] == 2)
    assert len(val_ef) == 40 and all(r["y"] == EF.apply(r["x"]) for r in val_ef)
    assert sum("E" in x for x in val_ef["x"]) >= 20  # half planted with 'E'
    # held-out splits avoid training inputs (task and regularizer rows), and each other
    train_x, val_x, test_x = set(train["x"]), set(val["x"]), set(test["x"])
    comp_val, comp_test = (set(task.compositional_dataset(s)["x"]) for s in ("val", "test"))
    assert not train_x & (val_x | test_x | comp_val | comp_test)
    assert not val_x & (test_x | comp_val | comp_test) and not comp_val & (test_x | comp_test)
    with pytest.raises(ValueError, match="split must be one of"):
        task.compositional_dataset("train")


def test_random_rule_rows_edit_other_letters_consistently_and_know_no_other_expert(tok):
    """`reg_data=random_rules`: each expert's extra rows hold its own source, its own rule on its mask (task loss
    there) and, off it, random rules drawn per row (one target per letter within a row, edit rates from none to
    all); no other expert's rule decides them: the rows of `ab` are the same whoever else is in play."""
    xs = sample_strings(400, ALPHABET, 8, 16, seed=3)
    ys = random_rule_outputs(xs, AB, ALPHABET, seed=0)
    assert ys == random_rule_outputs(xs, AB, ALPHABET, seed=0) != random_rule_outputs(xs, AB, ALPHABET, seed=1)
    rates = []
    for x, y in zip(xs, ys, strict=True):
        assert all(b == "B" for a, b in zip(x, y, strict=True) if a == "A")  # its own rule, always
        mapping = {}
        for a, b in zip(x, y, strict=True):
            assert mapping.setdefault(a, b) == b  # a rule: one output per letter within a row
        others = [a for a in x if a != "A"]
        rates.append(sum(mapping[a] != a for a in others) / max(len(others), 1))
    assert min(rates) < 0.1 and max(rates) > 0.9 and 0.55 < sum(rates) / len(rates) < 0.8  # mean of q is 2/3

    alone = LettersTask(LettersConfig(**SMALL), [expert(AB)], reg_data="random_rules")
    with_others = LettersTask(LettersConfig(**SMALL), [expert(AB), expert(CD)], reg_data="random_rules")
    rows = alone.expert_dataset("train").filter(lambda r: r["is_task"] == 0)
    assert len(rows) == 240 and set(rows["task_on_mask"]) == {1} and all("A" in x for x in rows["x"])
    theirs = with_others.expert_dataset("train").filter(lambda r: r["is_task"] == 0 and r["expert_index"] == 0)
    assert rows["y"] == theirs["y"] and rows["input_ids"] == theirs["input_ids"]
    batch = alone.collator()(list(rows.select(range(8))))  # task loss on its own mask only (task_on_mask, not is_task)
    assert batch["is_task"].tolist() == [0] * 8 and batch["task_on_mask"].tolist() == [1] * 8
    assert set(batch["targets"][batch["masks"][:, 0]].tolist()) == {tok.convert_tokens_to_ids("B")}
    with pytest.raises(ValueError, match="ys must hold one output per input"):
        build_letters_dataset(["AB"], [], [AB], tok, ys=["ABC"])
    with pytest.raises(TaskError, match="aligned format has none"):
        LettersTask(LettersConfig(**SMALL, format="aligned"), [expert(AB)], reg_data="random_rules")


def test_composition_with_experts_trained_elsewhere(tok):
    gh = RuleSet("gh", {"G": "H"})
    task = LettersTask(LettersConfig(**SMALL), [expert(AB), expert(CD), expert(gh)], trained=["cd"],
                       reg_data="composition")
    xs = task.compositional_dataset("val")["x"]
    assert len(xs) == 40 and all("A" in x and "C" in x and "G" in x for x in xs)
    comp = task.compositional_dataset("test")
    assert len(comp) == 60 and all(len(m) == 3 for m in comp["masks"])  # one mask per expert in play
    assert comp[0]["y"] == apply_rules(comp[0]["x"], [AB, CD, gh])
    n = len(comp[0]["x"])
    for mask, rs in zip(comp[0]["masks"], (AB, CD, gh), strict=True):  # in composition order
        assert [t for t, m in enumerate(mask) if m] == [n + 1 + j for j, ch in enumerate(comp[0]["x"]) if ch in rs.sources]
    train = task.expert_dataset("train")
    assert set(train["expert_index"]) == {0}  # only the trained expert, indexed in `trained`
    reg = train.filter(lambda r: r["is_task"] == 0)
    assert len(reg) == 240
    row = reg[0]
    assert row["y"] == apply_rules(row["x"], [AB, CD, gh])
    assert set(reg["task_on_mask"]) == {1}  # on its own mask the composed target is its own rule's
    n = len(row["x"])
    assert [t for t, m in enumerate(row["masks"][0]) if m] == [n + 1 + j for j, ch in enumerate(row["x"]) if ch == "C"]
    assert all(r["y"] == CD.apply(r["x"]) for r in task.expert_dataset("val"))


def test_tasks_are_deterministic_given_seed(tok):
    cfg = LettersConfig(**SMALL)

    def make(**kw):
        return LettersTask(cfg, [expert(AB), expert(CD)], **kw)

    a, b = make(), make()
    for split in ("train", "val", "test"):
        assert a.expert_dataset(split)["input_ids"] == b.expert_dataset(split)["input_ids"]
        assert a.background_dataset(split)["input_ids"] == b.background_dataset(split)["input_ids"]
    assert a.compositional_dataset("test")["x"] == b.compositional_dataset("test")["x"]

    def batches(task):
        torch.manual_seed(0)
        loader = TaskDataModule(task, "experts", batch_size=32, corruption_prob=0.2).train_dataloader()
        return [x["input_ids"] for _, x in zip(range(3), loader, strict=False)]

    assert all(torch.equal(x, y) for x, y in zip(batches(a), batches(b), strict=True))
    c = make(seed=1)
    assert c.expert_dataset("train")["x"] != a.expert_dataset("train")["x"]
    assert c.background_dataset("train")["x"] != a.background_dataset("train")["x"]
    # an expert's data depends on its name, not on which other experts train beside it
    alone = make(trained=["cd"])
    assert alone.expert_dataset("val")["x"] == a.expert_dataset("val").filter(lambda r: r["expert_index"] == 1)["x"]


# ---------------------------------------------------------------- decoding-side evaluation


class Oracle:
    """Stands in for a ComposedLM in greedy decoding: reads `x` back from each `<bos> x <sep>` prompt and
    'generates' `apply_rules(x, rule_sets)` then `<eos>` (or no `<eos>` with `eos=False`)."""

    device = torch.device("cpu")

    def __init__(self, tok, rule_sets, eos: bool = True) -> None:
        self.tok, self.rule_sets, self.eos = tok, list(rule_sets), eos

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **_):
        out = []
        for ids, attn in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = [t for t, m in zip(ids, attn, strict=True) if m]
            x = self.tok.decode(prompt[1:-1])
            new = self.tok.convert_tokens_to_ids(list(apply_rules(x, self.rule_sets)))
            new = (new + [eos_token_id] * self.eos + [pad_token_id] * max_new_tokens)[:max_new_tokens]
            out.append(ids + new)
        return torch.tensor(out)


def test_evaluation_decodes_each_component_on_its_own_rows(tok):
    cfg = LettersConfig(source_prob=1.0, **SMALL)  # every expert row holds a source letter
    task = LettersTask(cfg, [expert(AB), expert(CD)], trained=["cd"])
    copy, ab, cd, both = Oracle(tok, []), Oracle(tok, [AB]), Oracle(tok, [CD]), Oracle(tok, [AB, CD])
    assert task.evaluate_background(copy, "test", batch_size=16) == {"exact_match": 1.0}
    assert task.evaluate_background(ab, "val", batch_size=16)["exact_match"] < 1.0
    # `name` picks that trained expert's held-out rows (its index in `trained`, not in the experts in play)
    assert task.evaluate_expert(cd, "cd", "test", batch_size=7) == {"exact_match": 1.0}
    assert task.evaluate_expert(copy, "cd", "val", batch_size=16)["exact_match"] == 0.0
    assert task.evaluate_expert(ab, "cd", "val", batch_size=16)["exact_match"] == 0.0
    comp = task.compositional_dataset("test")
    results = task.evaluate_composition(both, comp, batch_size=16)
    assert results["exact_match"] == 1.0 and results["failures/correct"] == 1.0
    assert results["ab/skill_accuracy"] == results["cd/skill_accuracy"] == 1.0
    assert set(results) == {"exact_match", "ab/skill_accuracy", "cd/skill_accuracy", "failures/correct",
                            "failures/rule_not_applied", "failures/wrong_letter_elsewhere", "failures/length_or_eos"}
    half = task.evaluate_composition(ab, comp, batch_size=16)  # C is left alone: C_to_D's skill fails
    assert half["exact_match"] == 0.0 and half["failures/rule_not_applied"] == 1.0
    assert half["ab/skill_accuracy"] == 1.0 and half["cd/skill_accuracy"] == 0.0
    no_eos = task.evaluate_composition(Oracle(tok, [AB, CD], eos=False), comp, batch_size=16)
    assert no_eos["exact_match"] == 0.0 and no_eos["failures/length_or_eos"] == 1.0


def test_data_modules_but_one_do_not_import_lightning():
    root = Path(__file__).resolve().parents[1] / "data"
    files = sorted(p for p in root.rglob("*.py") if p.name != "datamodule.py")
    assert {"__init__.py", "collate.py", "splits.py", "tokenizer.py", "rules.py", "task.py", "base.py"} <= {
        p.name for p in files}
    for path in files:
        tree = ast.parse(path.read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.col_offset == 0]
        assert not [m for m in modules if m.startswith(("lightning", "pytorch_lightning", "data.datamodule"))], path


GENERIC = ("collate", "datamodule", "generation", "sampler", "splits", "tokenizer")


def test_generic_data_pieces_import_neither_compose_nor_the_lightning_modules():
    root = Path(__file__).resolve().parents[1] / "data"
    for name in GENERIC:
        tree = ast.parse((root / f"{name}.py").read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m.split(".")[0] in ("compose", "lightning_modules")], name


def test_importing_the_generic_pieces_and_the_task_registry_loads_no_task_and_no_upper_layer():
    code = (f"import sys, data, data.tasks, {', '.join(f'data.{m}' for m in GENERIC)}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('compose', 'lightning_modules')\n"
            "             or m.startswith('data.tasks.') and m != 'data.tasks.base'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
