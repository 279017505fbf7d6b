"""The text task (`data.tasks.text`): rows, masks, splits, chat rows, bad input and evaluation.

Data: `tests/fixtures/text/` (written by its `make_fixture.py`): `calc` owns `<<...>>`, `upper` owns `[...]`.
The tokenizer is a byte-level BPE trained here in-process; the models are tiny random Llamas.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from compose import ComposedLM
from compose.intervals import IntervalSpec
from data.generation import decode_until_eos, left_padded
from data.tasks import Expert, TaskError, task_class
from data.tasks.text import (
    TextConfig,
    TextTask,
    exact_match,
    interval_texts,
    missing_intervals,
    normalize_whitespace,
    read_examples,
    skill_counts,
)
from lightning_modules.pipeline.report import with_intervals

FIXTURES = Path(__file__).parent / "fixtures" / "text"
CALC = {"start": "<<", "end": ">>"}
UPPER = {"start": "[", "end": "]"}
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
INTERVAL_RE = {"calc": re.compile(r"<<(.*?>>)"), "upper": re.compile(r"\[(.*?\])")}


def fixture(name: str) -> str:
    return str(FIXTURES / name)


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    texts = []
    for name in ("calc", "upper", "general", "compositional"):
        for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            texts += [row["prompt"], row["response"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   chat_template=chat_template)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def config(**kw) -> TextConfig:
    return TextConfig(**{"general": [fixture("general.jsonl")], "compositional": [fixture("compositional.jsonl")],
                         "max_new_tokens": 24, **kw})


def experts(calc=CALC, upper=UPPER, calc_data=("calc.jsonl",), upper_data=("upper.jsonl",)) -> list[Expert]:
    return [Expert("calc", {"interval": calc}, data=tuple(fixture(f) for f in calc_data)),
            Expert("upper", {"interval": upper}, data=tuple(fixture(f) for f in upper_data))]


def make_task(tok, cfg: TextConfig | None = None, exps: list[Expert] | None = None, **kw) -> TextTask:
    return TextTask(cfg or config(), experts() if exps is None else exps, tokenizer=tok, **kw)


def test_delimiters_written_with_byte_pieces_are_noted(tok, tmp_path):
    """`⟦`/`⟧` are byte pieces to the fixture tokenizer (never in its corpus): the task notes the expert."""
    rows = Path(fixture("calc.jsonl")).read_text().replace("<<", "⟦").replace(">>", "⟧")
    (tmp_path / "calc.jsonl").write_text(rows)
    task = make_task(tok, exps=[Expert("calc", {"interval": {"start": "⟦", "end": "⟧"}},
                                       data=(str(tmp_path / "calc.jsonl"),)), experts()[1]])
    noted = [n for n in task.notes if "byte pieces" in n]
    assert len(noted) == 1 and noted[0].startswith("expert 'calc': the tokenizer writes '⟦', '⟧' with byte pieces")
    assert not any("byte pieces" in n for n in make_task(tok).notes)


@pytest.fixture(scope="module")
def task(tok) -> TextTask:
    return make_task(tok, reg_data="own+background")


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def masked_text(tok, row: dict, i: int) -> str:
    return decode(tok, [t for t, m in zip(row["targets"], row["masks"][i], strict=True) if m])


def check_layout(tok, row: dict) -> None:
    """`prompt + response + eos`; targets shifted, -100 on the prompt; EOS target in no mask."""
    ids, targets, s, n = row["input_ids"], row["targets"], row["output_start"], row["output_len"]
    assert len(targets) == len(ids) == s + n + 1
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert targets[: s - 1] == [-100] * (s - 1) and targets[-1] == -100
    assert targets[s - 1 : s + n] == ids[s:]
    assert decode(tok, ids[s : s + n]) == row["y"]
    assert decode(tok, ids[:s]) == "<bos>" + row["x"]
    for mask in row["masks"]:
        assert len(mask) == len(ids) and mask[s + n - 1] == 0 and mask[-1] == 0
        assert not any(mask[: s - 1])


# --- rows ------------------------------------------------------------------------------------------
def test_registered():
    assert task_class("text") is TextTask and TextTask.config_class is TextConfig


def test_expert_rows_mask_the_interval_text(tok, task):
    rows = task.expert_dataset("train")
    own = [r for r in rows if r["is_task"] == 1]
    assert len(own) == 2 * 32  # 40 rows each, holdout 0.2 → 8 held out
    for row in own:
        check_layout(tok, row)
        name = task.trained[row["expert_index"]]
        assert len(row["masks"]) == 1 and row["task_on_mask"] == 1
        assert masked_text(tok, row, 0) == "".join(INTERVAL_RE[name].findall(row["y"]))


def test_regularizer_rows_come_from_general(tok, task):
    rows = task.expert_dataset("train")
    reg = [r for r in rows if r["is_task"] == 0]
    general = {r["y"] for r in task.background_dataset("train")}
    assert len(reg) == 2 * 32 and {r["expert_index"] for r in reg} == {0, 1}
    for row in reg:
        check_layout(tok, row)
        assert row["task_on_mask"] == 0 and row["y"] in general and not any(row["masks"][0])


@pytest.mark.parametrize("reg_data, n_reg", [("own", 0), ("background", 64)])
def test_reg_data_choices(tok, reg_data, n_reg):
    rows = make_task(tok, reg_data=reg_data).expert_dataset("train")
    assert sum(1 - r for r in rows["is_task"]) == n_reg


def test_eval_splits_hold_only_task_rows(tok, task):
    val, test = task.expert_dataset("val"), task.expert_dataset("test")
    assert len(val) == len(test) == 2 * 4 and set(val["is_task"]) == {1}
    for row in (*val, *test):
        check_layout(tok, row)
    rows = [(r["x"], r["y"]) for split in ("train", "val", "test") for r in task.own["calc"][split] for r in [
        {"x": r.example.prompt, "y": r.example.response}]]
    fixture_rows = [tuple(json.loads(line).values()) for line in (FIXTURES / "calc.jsonl").read_text().splitlines()]
    assert sorted(rows) == sorted(fixture_rows)  # a partition of the expert's rows


def test_background_rows(tok, task):
    for split, n in (("train", 32), ("val", 4), ("test", 4)):
        rows = task.background_dataset(split)
        assert len(rows) == n
        for row in rows:
            check_layout(tok, row)
            assert row["masks"] == []
    train = task.background_dataset("train")
    batch = task.collator()([train[i] for i in range(3)])
    assert batch["masks"].shape[:2] == (3, 0)


def test_compositional_rows(tok, task):
    val, test = task.compositional_dataset("val"), task.compositional_dataset("test")
    assert len(val) == len(test) == 12
    all_rows = [json.loads(line)["response"] for line in (FIXTURES / "compositional.jsonl").read_text().splitlines()]
    assert sorted([*val["y"], *test["y"]]) == sorted(all_rows)
    for row in (*val, *test):
        check_layout(tok, row)
        assert len(row["masks"]) == 2
        for i, name in enumerate(task.expert_names):
            assert masked_text(tok, row, i) == "".join(INTERVAL_RE[name].findall(row["y"]))
        assert not any(a and b for a, b in zip(*row["masks"], strict=True))


def test_regex_interval_gives_the_same_masks(tok, task):
    t = make_task(tok, exps=experts(calc={"start": "<{2}", "end": ">>", "regex": True}, upper={"start": r"\[", "end": r"\]",
                                                                                          "regex": True}))
    assert list(t.compositional_dataset("val")["masks"]) == list(task.compositional_dataset("val")["masks"])


def test_splits_are_seeded(tok):
    a, b = make_task(tok, seed=3), make_task(tok, seed=3)
    assert list(a.compositional_dataset("val")["y"]) == list(b.compositional_dataset("val")["y"])
    assert list(a.expert_dataset("train")["x"]) == list(b.expert_dataset("train")["x"])
    c = make_task(tok, seed=4)
    assert list(a.compositional_dataset("val")["y"]) != list(c.compositional_dataset("val")["y"])


def test_limit_holdout_count_and_max_length(tok):
    t = make_task(tok, config(limit=5, holdout=6))
    assert len(t.background_dataset("train")) == 5 and len(t.background_dataset("val")) == 3
    assert len(t.compositional_dataset("test")) == 5
    short = make_task(tok, config(max_length=40))  # drops the longest compositional rows
    assert any("compositional" in note and "longer than task.max_length=40" in note for note in short.notes)
    assert max(len(ids) for ids in short.compositional_dataset("val")["input_ids"]) <= 40
    with pytest.raises(TaskError, match=r"compositional: no val row left \(task.max_length=30"):
        make_task(tok, config(max_length=30))


def test_collator_corrupts_only_outputs_with_plain_tokens(tok, task):
    ids = task.corruption_ids
    assert set(ids).isdisjoint(tok.all_special_ids) and len(ids) == len(tok) - 3
    rows = [task.expert_dataset("train")[i] for i in range(8)]
    batch = task.collator(1.0)(rows)
    clean = task.collator()(rows)
    changed = batch["input_ids"] != clean["input_ids"]
    pos = torch.arange(changed.shape[1])
    start, n = clean["output_start"][:, None], clean["output_len"][:, None]
    in_output = (pos >= start) & (pos < start + n)
    assert changed[in_output].all() and not changed[~in_output].any()
    assert torch.equal(batch["targets"], clean["targets"])


def test_tokenizer_from_config_folder():
    t = TextTask(config(tokenizer=str(FIXTURES / "tokenizer")), experts())
    assert t.tokenizer.is_fast and t.tokenizer.chat_template
    assert len(t.expert_dataset("train")) == 64


def test_pipeline_tokenizer_wins_with_a_note(tok):
    t = make_task(tok, config(tokenizer=str(FIXTURES / "tokenizer")))
    assert t.tokenizer is tok and any("was not used" in note for note in t.notes)


# --- chat rows -------------------------------------------------------------------------------------
def test_messages_rows_use_the_chat_template(tok):
    t = make_task(tok, exps=experts(upper_data=("upper_chat.jsonl",)), trained=["upper"])
    rows = t.expert_dataset("train")
    assert len(rows) == 12 - 2 and set(rows["expert_index"]) == {0}
    for row in rows:
        check_layout(tok, row.copy() | {"x": row["x"].removeprefix("<bos>")})
        assert row["input_ids"].count(tok.bos_token_id) == 1  # the template's <bos> is not doubled
        word = row["y"].split("[")[1].split("]")[0]
        assert row["x"] == (f"<bos><|system|>\nYou answer briefly.\n<|user|>\nSay the word {word.lower()} loudly.\n"
                            "<|assistant|>\n")
        assert masked_text(tok, row, 0) == f"{word}]"


def test_chat_template_false_reads_prompt_response(tok):
    t = make_task(tok, config(chat_template=False))
    assert len(t.expert_dataset("train")) == 64


# --- file types, byte-order marks and line ends -----------------------------------------------------
def test_every_file_type_bom_and_line_end_reads_the_same_examples(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(fixture("calc.jsonl")).read_text().splitlines()]
    reference = [(e.prompt, e.response) for e in read_examples(fixture("calc.jsonl"), config(), tok)]
    assert len(reference) == 40 and all("\n" in prompt for prompt, _ in reference)
    lines = [json.dumps(r) for r in rows]
    ends = ["\r\n", "\n", "\r"]
    table = io.StringIO()
    csv.writer(table, lineterminator="\r\n").writerows([["prompt", "response"], *([r["prompt"], r["response"]]
                                                                                   for r in rows)])
    files = {
        "bom_crlf.jsonl": codecs.BOM_UTF8 + "\r\n".join(lines).encode(),
        "mixed.jsonl": "".join(line + ends[i % 3] for i, line in enumerate(lines)).encode(),
        "array.json": codecs.BOM_UTF8 + json.dumps(rows, indent=2).replace("\n", "\r\n").encode(),
        "lines.json": "\n".join(lines).encode(),
        "bom_crlf.csv": codecs.BOM_UTF8 + table.getvalue().encode(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    for name in [*files, "rows.parquet"]:
        examples = read_examples(str(tmp_path / name), config(), tok)
        assert [(e.prompt, e.response) for e in examples] == reference, name
        unit = "row" if name in ("array.json", "rows.parquet") else "line"  # JSON Lines in a .json file too
        last = 80 if name.endswith(".csv") else 40  # a CSV record starts on line 2k: each prompt spans two lines
        assert examples[-1].where == f"{tmp_path / name} {unit} {last}", name


def test_rows_are_named_by_their_line_and_only_line_ends_split_them(tmp_path, tok):
    odd = {"prompt": "Q\n", "response": "a\u2028b\x85c\x0cd"}  # separators that are no JSON Lines line end
    path = write(tmp_path, "rows.jsonl", "")
    Path(path).write_text(json.dumps(odd, ensure_ascii=False) + "\n\n  \n" + json.dumps(odd) + "\n",
                          encoding="utf-8")
    examples = read_examples(path, config(), tok)
    assert [(e.response, e.where) for e in examples] == [(odd["response"], f"{path} line 1"),
                                                         (odd["response"], f"{path} line 4")]


# --- bad input -------------------------------------------------------------------------------------
def write(tmp_path: Path, name: str, rows: list[dict] | str) -> str:
    path = tmp_path / name
    path.write_text(rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def calc_rows(responses: list[str]) -> list[dict]:
    return [{"prompt": f"Q{i}\n", "response": r} for i, r in enumerate(responses)]


GOOD_CALC = [f"Half of {2 * i} is <<{2 * i}/2={i}>>{i} now." for i in range(3, 9)]


def bad_cases(tmp_path: Path, tok) -> dict[str, tuple]:
    """name -> (constructor thunk, regex the one-line message must match)."""
    def with_calc(path, **kw):
        return lambda: make_task(tok, exps=[Expert("calc", {"interval": kw.pop("spec", CALC)}, data=(path,))],
                                 cfg=kw.pop("cfg", None), **kw)

    comp = write(tmp_path, "comp.jsonl", [{"prompt": "p\n", "response": "none here"},
                                          {"prompt": "p\n", "response": "no interval here"}])
    no_template = build_tokenizer(chat_template=None)
    return {
        "missing file": (with_calc(str(tmp_path / "nope.jsonl")), r"nope\.jsonl: data file not found"),
        "empty file": (with_calc(write(tmp_path, "empty.jsonl", "")), r"empty\.jsonl: data file is empty"),
        "missing fields": (with_calc(write(tmp_path, "qa.jsonl", [{"question": "q", "answer": "a"}])),
                           r"qa\.jsonl: rows lack the field\(s\) \['prompt', 'response'\] "
                           r"\(they have \['question', 'answer'\]"),
        "unbalanced row": (with_calc(write(tmp_path, "unbalanced.jsonl",
                                           calc_rows([*GOOD_CALC[:2], "Half of 6 is <<6/2=3 now.", *GOOD_CALC[2:]]))),
                           r"unbalanced\.jsonl line 3: response does not balance expert 'calc'"),
        "start never occurs": (with_calc(write(tmp_path, "calc.jsonl", calc_rows(GOOD_CALC)),
                                         spec={"start": "{{", "end": "}}"}),
                               r"experts\[0\] \(calc\)\.interval\.start='\{\{' never occurs .*calc\.jsonl"),
        "bad regex": (with_calc(fixture("calc.jsonl"), spec={"start": "(", "end": ">>", "regex": True}),
                      r"experts\[0\] \(calc\)\.interval: .*'start' regex '\(' does not compile"),
        "no interval key": (lambda: make_task(tok, exps=[Expert("calc", {"rules": {"A": "B"}},
                                                                data=(fixture("calc.jsonl"),))]),
                            r"experts\[0\] \(calc\): the text task needs `interval`"),
        "slow tokenizer": (lambda: make_task(ByT5Tokenizer()), r"ByT5Tokenizer is not a fast tokenizer"),
        "no tokenizer": (lambda: TextTask(config(), experts()), r"task\.tokenizer is not set"),
        "chat template missing": (lambda: make_task(no_template, exps=experts(upper_data=("upper_chat.jsonl",))),
                                  r"upper_chat\.jsonl: rows are chat messages but the tokenizer has no chat template"),
        "chat requested, no messages": (lambda: make_task(tok, config(chat_template=True)),
                                        r"general\.jsonl: task\.chat_template=true but the rows lack the field "
                                        r"'messages'"),
        "no assistant message": (with_calc(write(tmp_path, "chat.jsonl",
                                                 [{"messages": [{"role": "user", "content": "hi"}]}])),
                                 r"chat\.jsonl line 1: messages have no assistant message"),
        "compositional row without interval": (
            lambda: make_task(tok, config(compositional=[comp])),
            r"comp\.jsonl: no compositional row holds an interval of any expert \(calc, upper\)"),
        "reg_data composition": (lambda: make_task(tok, reg_data="composition"), r"reg_data=composition"),
        "trained expert without data": (lambda: make_task(tok, exps=experts(upper_data=())),
                                        r"experts\[1\] \(upper\)\.data is empty"),
        "overlapping intervals": (lambda: make_task(tok, exps=experts(upper=CALC, upper_data=("calc.jsonl",))),
                                  r"compositional\.jsonl line \d+: the intervals of experts 'calc' and 'upper' overlap"),
        "no general files": (lambda: make_task(tok, config(general=[])), r"task\.general is empty"),
        "one compositional row": (lambda: make_task(tok, config(compositional=[write(tmp_path, "one.jsonl", [
            {"prompt": "p\n", "response": "<<1+1=2>>2"}])])), r"task\.compositional has 1 row\(s\)"),
        "holdout too large": (lambda: make_task(tok, config(holdout=40)),
                              r"general: 40 rows cannot give task\.holdout=40"),
        "field not text": (with_calc(write(tmp_path, "null.jsonl", [*calc_rows(GOOD_CALC[:1]),
                                                                    {"prompt": None, "response": "x"}])),
                           r"null\.jsonl line 2: field 'prompt' is not text"),
        "unknown file type": (with_calc(write(tmp_path, "calc.txt", "hello")), r"calc\.txt: unknown data file type"),
        "general row unbalanced": (
            lambda: make_task(tok, config(general=[write(tmp_path, "gen.jsonl", [{"prompt": "p", "response": "a ] b"}])])),
            r"gen\.jsonl line 1: response does not balance expert 'upper'"),
    }


CASES = ["missing file", "empty file", "missing fields", "unbalanced row", "start never occurs", "bad regex",
         "no interval key", "slow tokenizer", "no tokenizer", "chat template missing", "chat requested, no messages",
         "no assistant message", "compositional row without interval", "reg_data composition",
         "trained expert without data", "overlapping intervals", "general row unbalanced", "no general files",
         "one compositional row", "holdout too large", "field not text", "unknown file type"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_it(tmp_path, tok, case):
    thunk, pattern = bad_cases(tmp_path, tok)[case]
    with pytest.raises(TaskError) as info:
        thunk()
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern, message), message


def test_overlap_allowed_is_noted(tok):
    t = make_task(tok, exps=experts(upper=CALC, upper_data=("calc.jsonl",)), allow_overlap=True)
    assert any("overlap" in note for note in t.notes)


def test_untrained_expert_may_have_no_data(tok):
    t = make_task(tok, exps=experts(upper_data=()), trained=["calc"])
    assert set(t.expert_dataset("train")["expert_index"]) == {0}
    assert len(t.compositional_dataset("val")[0]["masks"]) == 2


# --- evaluation ------------------------------------------------------------------------------------
def test_helpers():
    assert normalize_whitespace("  a \n\t b  ") == "a b"
    assert exact_match(["a  b", "a b", "c"], ["a b", "a b", "d"], [True, False, True]) == pytest.approx(1 / 3)
    spec = IntervalSpec.from_dict(UPPER)
    ref = "I say [A] and [B]."
    assert skill_counts([ref], [ref], spec) == (2, 2)
    assert skill_counts(["I say [B] and [A]."], [ref], spec) == (0, 2)  # matched by order of occurrence
    assert skill_counts(["x [A] y"], [ref], spec) == (1, 2)
    assert skill_counts(["[A  ] [B]"], ["[A ] [B]"], spec) == (2, 2)  # whitespace-normalized
    # written wrong is not missing; fewer intervals than the reference are (never negative for more)
    assert missing_intervals(["I say [B] and [A].", "x [A] y", "no brackets", "[A] [B] [C]"], [ref] * 4, spec) == 3
    ids, attn = left_padded([[5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and attn.tolist() == [[1, 1], [0, 1]]


def test_decode_until_eos(tok):
    a = tok("ab", add_special_tokens=False)["input_ids"]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    gen = torch.tensor([[9, *a, eos, pad], [9, *a, pad, pad]])
    assert decode_until_eos(tok, gen, 1, eos) == [("ab", True), ("ab<pad><pad>", False)]


class Oracle:
    """A stand-in `ComposedLM` that writes a fixed answer per prompt (`edit` maps the reference)."""

    def __init__(self, tok, task: TextTask, edit=lambda y: y) -> None:
        self.tok, self.eos = tok, tok.eos_token_id
        rows = [enc for source in (task.general, task.compositional, *task.own.values())
                for part in source.values() for enc in part]
        self.answers = {tuple(enc.prompt_ids): edit(enc.example.response) for enc in rows}

    def generate(self, input_ids, attention_mask, *, max_new_tokens, eos_token_id, pad_token_id, **_):
        outs = []
        for ids, attn in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = tuple(i for i, a in zip(ids, attn, strict=True) if a)
            outs.append(self.tok(self.answers[prompt], add_special_tokens=False)["input_ids"] + [eos_token_id])
        width = max(map(len, outs))
        new = torch.tensor([o + [pad_token_id] * (width - len(o)) for o in outs])
        return torch.cat([input_ids, new], dim=1)


def test_perfect_model_scores_one(tok, task):
    oracle = Oracle(tok, task)
    assert task.evaluate_background(oracle, "val", 3) == {"exact_match": 1.0, "n_test": 4}
    calc = task.evaluate_expert(oracle, "calc", "test", 3)
    assert calc == {"exact_match": 1.0, "n_test": 4, "skill_accuracy": 1.0, "skill_accuracy_n": calc["skill_accuracy_n"]}
    result = task.evaluate_composition(oracle, task.compositional_dataset("test"), 5)
    counts = {k: v for k, v in result.items() if k.endswith("_n")}
    assert result == {"exact_match": 1.0, "calc/skill_accuracy": 1.0, "upper/skill_accuracy": 1.0,
                      "calc/intervals_missing": 0.0, "upper/intervals_missing": 0.0, "failures/no_eos": 0.0, **counts}
    assert counts["exact_match_n"] == 12 and counts["calc/skill_accuracy_n"] >= 1


def test_one_wrong_skill_is_named(tok, task):
    lower = Oracle(tok, task, edit=lambda y: re.sub(r"\[(\w+)\]", lambda m: f"[{m[1].lower()}]", y))
    result = task.evaluate_composition(lower, task.compositional_dataset("val"), 4)
    assert result["exact_match"] == 0.0 and result["calc/skill_accuracy"] == 1.0
    assert result["upper/skill_accuracy"] == 0.0 and result["upper/intervals_missing"] == 0.0  # written, wrong
    dropped = Oracle(tok, task, edit=lambda y: re.sub(r"\[(\w+)\]", lambda m: m[1], y))
    result = task.evaluate_composition(dropped, task.compositional_dataset("val"), 4)
    assert result["upper/intervals_missing"] == 1.0 and result["calc/intervals_missing"] == 0.0


def tiny_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def test_evaluation_on_a_tiny_composed_llama(tok):
    t = make_task(tok, config(max_new_tokens=6, limit=4))
    background, calc, upper = (tiny_llama(len(tok), seed) for seed in range(3))
    composed = ComposedLM(background, [calc, upper], names=["calc", "upper"], tokenizer=tok)
    alone = ComposedLM(background, [calc], names=["calc"], tokenizer=tok)
    results = [t.evaluate_background(ComposedLM(background, tokenizer=tok), "val", 2),
               t.evaluate_expert(alone, "calc", "val", 2),
               t.evaluate_composition(composed, t.compositional_dataset("val"), 3)]
    for result in results:
        assert "exact_match" in result
        rates = {k: v for k, v in result.items()
                 if k not in ("general_perplexity", "off_interval_kl", "n_test") and not k.endswith("_n")}
        assert all(0.0 <= v <= 1.0 for v in rates.values()), result
        assert result["general_perplexity"] >= 1.0  # a ComposedLM scores: the teacher-forced extras are there
    assert results[0]["exact_match"] >= 0.0 and results[2]["off_interval_kl"] >= 0.0
    assert {"calc/skill_accuracy", "upper/skill_accuracy", "failures/no_eos"} <= set(results[2])
    # the counts the report's intervals come from: rows decoded, and intervals scored per skill
    assert results[0]["n_test"] == results[1]["n_test"] == 4 and results[2]["exact_match_n"] == 4
    for name in ("calc", "upper"):
        spans = sum(len(interval_texts(y, t.specs[t.expert_names.index(name)]))
                    for y in t.compositional_dataset("val")["y"])
        assert results[2][f"{name}/skill_accuracy_n"] == spans > 0
    assert results[1]["skill_accuracy_n"] == sum(len(interval_texts(enc.example.response, t.specs[0]))
                                                 for enc in t.own["calc"]["val"])
    ci = with_intervals({"composition": {"n_test": 4, **results[2]}})["composition"]
    assert len(ci["calc/skill_accuracy_ci95"]) == 2 and len(ci["exact_match_ci95"]) == 2


def test_stop_strings_end_a_prediction_before_them(tok):
    """A base model goes on with its prompt's pattern instead of emitting EOS: `task.stop_strings` cut the
    prediction before the first stop string and count it as ended."""
    t = make_task(tok, config(max_new_tokens=12, limit=4))
    model = ComposedLM(tiny_llama(len(tok), 0), tokenizer=tok)
    prompts = [list(ids[:s]) for ids, s in zip(t.compositional_dataset("val")["input_ids"],
                                               t.compositional_dataset("val")["output_start"], strict=True)]
    plain, _ = t.greedy_outputs(model, prompts, 2)
    stop = next(text[len(text) // 2:][:2] for text in plain if len(text) >= 4)  # a piece of some output
    cut = make_task(tok, config(max_new_tokens=12, limit=4, stop_strings=[stop]))
    texts, ended = cut.greedy_outputs(model, prompts, 2)
    for full, text, done in zip(plain, texts, ended, strict=True):
        if stop in full:
            assert text == full[:full.index(stop)] and done
        else:
            assert text == full
    assert any(stop in full for full in plain)
    with pytest.raises(TaskError, match="task.stop_strings"):
        replace(TextConfig(), stop_strings=[""])


def test_config_rejects_bad_values():
    for kw, key in (({"holdout": 0}, "holdout"), ({"holdout": 2.5}, "holdout"), ({"limit": 0}, "limit"),
                    ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(TaskError, match=f"task.{key}"):
            replace(TextConfig(), **kw)


# --- teacher-forced extras: general perplexity, off-interval KL; cross evaluation -------------------
def test_general_perplexity_is_the_background_nll_on_general_responses(tok):
    t = make_task(tok, config(limit=6))
    background = tiny_llama(len(tok), 0)
    by_hand = []
    for enc in t.general["test"]:
        ids = torch.tensor([enc.prompt_ids + enc.response_ids + [tok.eos_token_id]])
        lp = background(ids).logits.float().log_softmax(-1)[0]
        p = len(enc.prompt_ids)
        by_hand += [-lp[p - 1 + j, tok_id].item() for j, tok_id in enumerate(enc.response_ids + [tok.eos_token_id])]
    expected = torch.tensor(by_hand).mean().exp().item()
    assert t.general_perplexity(ComposedLM(background, tokenizer=tok), "test", 4) == pytest.approx(expected, rel=1e-4)


def test_an_expert_equal_to_the_background_changes_nothing(tok):
    t = make_task(tok, config(limit=6))
    background = tiny_llama(len(tok), 0)
    alone = ComposedLM(background, tokenizer=tok)
    same = ComposedLM(background, [tiny_llama(len(tok), 0)], names=["calc"], tokenizer=tok)
    assert t.general_perplexity(same, "val", 3) == pytest.approx(t.general_perplexity(alone, "val", 3), rel=1e-5)
    rows = t.compositional_dataset("val")
    assert t.off_interval_kl(alone, rows, 3) == pytest.approx(0.0, abs=1e-6)
    assert t.off_interval_kl(same, rows, 3) == pytest.approx(0.0, abs=1e-5)


def test_gated_composition_leaves_the_off_interval_text_to_the_background(tok):
    """Soft: random experts move every position. Gated (each expert only inside its interval): nothing moves
    off the intervals, and general rows (no intervals here) score exactly as under the background."""
    t = make_task(tok, config(limit=6))
    background, calc, upper = (tiny_llama(len(tok), seed) for seed in range(3))
    composed = ComposedLM(background, [calc, upper], names=["calc", "upper"], tokenizer=tok,
                          specs=[{"interval": CALC}, {"interval": UPPER}])
    rows = t.compositional_dataset("val")
    soft = t.evaluate_composition(composed, rows, 3)
    composed.composition = "gated"
    gated = t.evaluate_composition(composed, rows, 3)
    assert soft["off_interval_kl"] > 1e-3 and gated["off_interval_kl"] == pytest.approx(0.0, abs=1e-6)
    bg_ppl = t.general_perplexity(ComposedLM(background, tokenizer=tok), "val", 3)
    assert gated["general_perplexity"] == pytest.approx(bg_ppl, rel=1e-5)
    assert soft["general_perplexity"] != pytest.approx(bg_ppl, rel=1e-3)
    test_rows = t.compositional_dataset("test")
    assert t.evaluate_composition(composed, test_rows, 3)["general_perplexity"] == pytest.approx(
        t.general_perplexity(composed, "test", 3), rel=1e-6)  # the split follows the rows


def test_cross_eval_scores_every_model_on_every_skill(tok):
    t = make_task(tok, config(cross_eval=True))
    oracle = Oracle(tok, t)  # decodes only: no teacher-forced extras
    result = t.evaluate_background(oracle, "val", 3)
    assert {k: v for k, v in result.items() if not k.endswith("_n")} == {
        "exact_match": 1.0, "n_test": 4, "calc/skill_accuracy": 1.0, "upper/skill_accuracy": 1.0,
        "compositional/exact_match": 1.0, "compositional/calc/skill_accuracy": 1.0,
        "compositional/upper/skill_accuracy": 1.0, "compositional/calc/intervals_missing": 0.0,
        "compositional/upper/intervals_missing": 0.0, "compositional/failures/no_eos": 0.0}
    assert result["compositional/exact_match_n"] == 12 and result["calc/skill_accuracy_n"] >= 4
    lower = Oracle(tok, t, edit=lambda y: re.sub(r"\[(\w+)\]", lambda m: f"[{m[1].lower()}]", y))
    result = t.evaluate_expert(lower, "calc", "test", 3)
    assert result["skill_accuracy"] == 1.0 and result["compositional/calc/skill_accuracy"] == 1.0
    assert result["compositional/upper/skill_accuracy"] == 0.0 and result["compositional/exact_match"] == 0.0
    background = tiny_llama(len(tok), 0)
    small = make_task(tok, config(cross_eval=True, limit=3, max_new_tokens=4))
    scored = small.evaluate_background(ComposedLM(background, tokenizer=tok), "val", 3)
    assert scored["general_perplexity"] >= 1.0 and scored["compositional/off_interval_kl"] == pytest.approx(0, abs=1e-6)
    assert "compositional/general_perplexity" not in scored
