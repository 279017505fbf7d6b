"""Tests of the data side: tokenizer, letter task, collator, datamodules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from data.datamodules import BackgroundDataModule, ExpertDataModule, LettersDataConfig
from data.letters import (
    IGNORE_INDEX,
    LettersCollator,
    RuleSet,
    apply_rules,
    build_letters_dataset,
    compositional_inputs,
    decode_outputs,
    expert_inputs,
    prompt_batch,
    sample_strings,
    validate_rule_sets,
)
from data.tokenizer import build_char_tokenizer, letter_ids

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
AB, CD, EF = RuleSet("ab", {"A": "B"}), RuleSet("cd", {"C": "D"}), RuleSet("ef", {"E": "F"})


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


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
    batch = LettersCollator(tok, ALPHABET)([ds[0], ds[1]])
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
        LettersCollator(tok, ALPHABET)([ds[0], other[0]])


def test_corruption_changes_only_output_letters_at_the_rate(tok):
    xs = sample_strings(1000, ALPHABET, 8, 16, seed=0)
    rows = list(build_letters_dataset(xs, [AB], [AB], tok))
    clean = LettersCollator(tok, ALPHABET)(rows)
    assert torch.equal(LettersCollator(tok, ALPHABET, 0.0)(rows)["input_ids"], clean["input_ids"])
    noisy = LettersCollator(tok, ALPHABET, 0.5, generator=torch.Generator().manual_seed(0))(rows)
    pos = torch.arange(clean["input_ids"].shape[1])
    start, length = clean["output_start"][:, None], clean["output_len"][:, None]
    output = (pos >= start) & (pos < start + length)
    changed = noisy["input_ids"] != clean["input_ids"]
    assert not (changed & ~output).any()  # bos, x, sep, eos, padding untouched
    rate = changed[output].float().mean().item()
    assert abs(rate - 0.5) < 0.05
    assert torch.equal(noisy["targets"], clean["targets"]) and torch.equal(noisy["masks"], clean["masks"])
    letters = torch.tensor(letter_ids(tok, ALPHABET))
    assert torch.isin(noisy["input_ids"][output], letters).all()
    # fresh draw per call; reproducible from the generator's seed
    collate = LettersCollator(tok, ALPHABET, 0.5, generator=torch.Generator().manual_seed(0))
    first, second = collate(rows)["input_ids"], collate(rows)["input_ids"]
    assert torch.equal(first, noisy["input_ids"]) and not torch.equal(first, second)


# ---------------------------------------------------------------- generation helpers


def test_prompt_batch_and_decode_outputs(tok):
    ids, attn = prompt_batch(tok, ["AB", "CDE"])
    assert ids.tolist() == [[0, 1, 5, 6, 3], [1, 7, 8, 9, 3]]
    assert attn.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    generated = torch.cat([ids, torch.tensor([[6, 6, 2, 0], [7, 3, 9, 10]])], dim=1)
    assert decode_outputs(tok, generated, ids.shape[1]) == [("BB", True), ("C<sep>EF", False)]


# ---------------------------------------------------------------- datamodules

SMALL = dict(n_train=240, n_val=40, n_test=60, batch_size=32, min_len=4, max_len=10)


def test_config_validation():
    with pytest.raises(ValueError, match=r"reg_data='kl' is not one of \['own', 'background', 'composition'"):
        LettersDataConfig(reg_data="kl")
    with pytest.raises(ValueError, match="corruption_prob"):
        LettersDataConfig(corruption_prob=1.5)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        LettersDataConfig(min_len=5, max_len=4)


def test_background_datamodule(tok):
    dm = BackgroundDataModule(tok, LettersDataConfig(corruption_prob=0.3, **SMALL))
    dm.setup()
    dm.setup("fit")  # idempotent
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [240, 40, 60]
    train, val, test = (set(dm.datasets[s]["x"]) for s in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    assert all(row["y"] == row["x"] for row in dm.datasets["train"])
    assert dm.copy_eval_inputs("test") == list(dm.datasets["test"]["x"])
    batch = next(iter(dm.train_dataloader()))
    assert batch["masks"].shape == (32, 0, batch["input_ids"].shape[1])
    out = batch["targets"] != IGNORE_INDEX
    shifted = torch.roll(batch["input_ids"], -1, dims=1)
    # train batches are corrupted on teacher-forced outputs (targets stay clean) ...
    assert (shifted[out] != batch["targets"][out]).any()
    vb = next(iter(dm.val_dataloader()))
    out = vb["targets"] != IGNORE_INDEX
    # ... val batches are clean: every target is the next input token
    assert torch.equal(torch.roll(vb["input_ids"], -1, dims=1)[out], vb["targets"][out])


def test_expert_datamodule_batches_and_rows(tok):
    cfg = LettersDataConfig(reg_data="background", corruption_prob=0.2, **SMALL)
    dm = ExpertDataModule(tok, cfg, [AB, CD, EF])
    dm.setup()
    assert len(dm.datasets["train"]) == 3 * 2 * 240 and len(dm.datasets["val"]) == 3 * 40
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
    train = dm.datasets["train"]
    for row in train.select(range(0, len(train), 37)):
        expert = (AB, CD, EF)[row["expert_index"]]
        assert row["y"] == (expert.apply(row["x"]) if row["is_task"] else row["x"])
        n = len(row["x"])
        assert [t for t, m in enumerate(row["masks"][0]) if m] == [
            n + 1 + j for j, ch in enumerate(row["x"]) if ch in expert.sources
        ]
    vb = next(iter(dm.val_dataloader()))
    assert vb["expert_index"].tolist() == [0] * 32 and vb["is_task"].tolist() == [1] * 32
    assert sum("E" in x for x in dm.expert_eval_inputs(2, "val")) >= 20  # half planted with 'E'
    assert dm.expert_eval_inputs(1, "test") == list(dm.datasets["test"].filter(lambda r: r["expert_index"] == 1)["x"])
    # held-out splits avoid training inputs (task and regularizer rows)
    train_x = set(train["x"])
    assert not train_x & set(dm.datasets["val"]["x"]) and not train_x & set(dm.compositional_inputs("test"))
    with pytest.raises(ValueError, match="split must be one of"):
        dm.compositional_inputs("train")


def test_expert_datamodule_composition(tok):
    gh = RuleSet("gh", {"G": "H"})
    cfg = LettersDataConfig(reg_data="composition", **SMALL)
    dm = ExpertDataModule(tok, cfg, [CD], composition_experts=[AB, CD, gh])
    xs = dm.compositional_inputs("val")
    assert len(xs) == 40 and all("A" in x and "C" in x and "G" in x for x in xs)
    comp = dm.compositional_dataset("test")
    assert len(comp) == 60 and all(len(m) == 3 for m in comp["masks"])
    assert comp[0]["y"] == apply_rules(comp[0]["x"], [AB, CD, gh])
    reg = dm.datasets["train"].filter(lambda r: r["is_task"] == 0)
    assert len(reg) == 240 and set(reg["expert_index"]) == {0}
    row = reg[0]
    assert row["y"] == apply_rules(row["x"], [AB, CD, gh])
    assert set(reg["task_on_mask"]) == {1}  # on its own mask the composed target is its own rule's
    n = len(row["x"])
    assert [t for t, m in enumerate(row["masks"][0]) if m] == [n + 1 + j for j, ch in enumerate(row["x"]) if ch == "C"]
    with pytest.raises(ValueError, match="'ef' .* is trained but not in composition_experts"):
        ExpertDataModule(tok, cfg, [EF], composition_experts=[AB, CD])
    with pytest.raises(ValueError, match="shared by experts"):
        ExpertDataModule(tok, cfg, [AB, RuleSet("ac", {"A": "C"})])


def test_datamodules_are_deterministic_given_seed(tok):
    cfg = LettersDataConfig(reg_data="own", corruption_prob=0.2, **SMALL)
    a, b = ExpertDataModule(tok, cfg, [AB, CD]), ExpertDataModule(tok, cfg, [AB, CD])
    for split in ("train", "val", "test"):
        assert a._built(split)["input_ids"] == b._built(split)["input_ids"]
    assert a.compositional_inputs("test") == b.compositional_inputs("test")
    torch.manual_seed(0)
    batches_a = [x["input_ids"] for _, x in zip(range(3), a.train_dataloader(), strict=False)]
    torch.manual_seed(0)
    batches_b = [x["input_ids"] for _, x in zip(range(3), b.train_dataloader(), strict=False)]
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    c = ExpertDataModule(tok, LettersDataConfig(reg_data="own", seed=1, **SMALL), [AB, CD])
    assert c._built("train")["x"] != a._built("train")["x"]
    # an expert's data depends on its name, not on which other experts train beside it
    alone = ExpertDataModule(tok, cfg, [CD], composition_experts=[AB, CD])
    assert alone.expert_eval_inputs(0, "val") == a.expert_eval_inputs(1, "val")


def test_non_lightning_modules_do_not_import_lightning():
    root = Path(__file__).resolve().parents[1] / "data"
    for name in ("__init__.py", "letters.py", "tokenizer.py"):
        tree = ast.parse((root / name).read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.col_offset == 0]
        assert not [m for m in modules if m.startswith(("lightning", "pytorch_lightning", "data.datamodules"))], name
