"""Regularizer rows that carry no knowledge of another expert (`expert.reg_data` own+foreign, own+samples):
random foreign spans (`data.foreign_spans`), the background's own samples and their cache
(`lightning_modules.pipeline.reg_samples`), on the text task's fixture rows and a tiny Llama."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from compose.intervals import IntervalSpec, interval_char_spans
from data.foreign_spans import (
    DELIMITER_POOL,
    REWRITES,
    UNICODE_BRACKETS,
    delimiter_pool,
    expert_pool,
    insert_foreign_spans,
    random_content,
    rewrite_content,
)
from data.tasks import Expert, TaskError, task_class
from lightning_modules.pipeline import reg_samples
from lightning_modules.pipeline.config import ConfigError, load_config
from tests.test_text_task import CALC, UPPER, check_layout, config, experts, fixture, make_task, tiny_llama

CALC_SPEC, UPPER_SPEC = IntervalSpec.from_dict(CALC), IntervalSpec.from_dict(UPPER)


@pytest.fixture(scope="module")
def tok():
    from tests.test_text_task import build_tokenizer

    return build_tokenizer()


def spans_of_pool(text: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in DELIMITER_POOL if a in text and b in text[text.index(a) + len(a):]]


# --- foreign spans ------------------------------------------------------------------------------------
def test_pool_leaves_out_every_pair_that_shares_a_character_with_the_own_delimiters():
    pool = delimiter_pool(UPPER_SPEC)
    assert ("[", "]") not in pool and ("[[", "]]") not in pool and ("<<", ">>") in pool
    assert all(not ({*a, *b} & {"[", "]"}) for a, b in pool)
    assert ("<", ">") not in delimiter_pool(CALC_SPEC) and ("[", "]") in delimiter_pool(CALC_SPEC)


def test_spans_go_outside_the_own_intervals_and_into_the_echoed_prompt():
    rng = random.Random(0)
    response = "Tom sold <<47+8=55>> cups to Ben today."
    prompt = "Repeat: Tom sold <<47+8=>> cups to Ben today.\n"
    for _ in range(200):
        p, r, spans = insert_foreign_spans(prompt, response, CALC_SPEC, rng, n_spans=2)
        assert [r[a:b] for a, b in interval_char_spans(r, CALC_SPEC)] == ["47+8=55>>"]  # own span untouched
        # each span: from a pool start delimiter right after a space to right after a pool end delimiter, where
        # the original text goes on (at a space)
        ends = [b for _, b in spans]
        assert 1 <= len(spans) <= 2 and spans == sorted(spans)
        assert all(r[e] == " " and any(r[:e].endswith(b) for _, b in DELIMITER_POOL) for e in ends)
        assert all(r[a - 1] == " " and any(r[a:b].startswith(x) and r[a:b].endswith(y) for x, y in DELIMITER_POOL)
                   for a, b in spans)
        assert r != response and "<" not in r.replace("<<47+8=55>>", "")  # no pair with the own characters
        assert len(r.split()) > len(response.split())
        if r.startswith("Tom ") and not r.startswith("Tom sold <<"):  # inserted right after "Tom"
            assert p.startswith("Repeat: Tom ") and p != prompt  # the prompt's copy got it too


def test_no_boundary_outside_the_own_interval_leaves_the_text():
    assert insert_foreign_spans("x", "[a b c]", UPPER_SPEC, random.Random(0)) == ("x", "[a b c]", [])


def test_without_an_own_interval_spans_may_use_every_pair_of_the_pool():
    rng = random.Random(0)
    response = "Tom sold <<47+8=55>> cups to Ben today."
    used = set()
    for _ in range(300):
        _, r, spans = insert_foreign_spans("Repeat: " + response, response, None, rng, n_spans=1)
        assert len(spans) == 1 and r != response
        used |= {(x, y) for x, y in DELIMITER_POOL if r[spans[0][0]:spans[0][1]].startswith(x)
                 and r[spans[0][0]:spans[0][1]].endswith(y)}
    assert ("<<", ">>") in used and ("[", "]") in used  # pairs any expert may own are in the draws


def test_foreign_words_draw_span_contents_from_the_given_words():
    rng, words = random.Random(0), ["window", "garden"]
    response = "Tom sold the cups to Ben today."
    drawn = set()
    for _ in range(300):
        _, r, spans = insert_foreign_spans("Repeat: " + response, response, None, rng, n_spans=1, words=words)
        drawn |= set(re.findall(r"[A-Za-z]+", r[spans[0][0]:spans[0][1]]))  # no pool delimiter holds a letter
    assert {"window", "garden", "WINDOW", "GARDEN"} <= drawn  # real words, in lower and upper case
    assert any(w.isalpha() and w.lower() not in words for w in drawn)  # random letters still drawn too


def test_without_words_the_seeded_draws_are_those_recorded_before_the_option():
    """Runs documented before `task.foreign_words` existed draw the same spans from the same seed."""
    assert [random_content(random.Random(s)) for s in range(6)] == [
        "97/5", "ZYCIDPY PUMZ DP", "l", "ELTPU CTAPI HGWPR", "X PECC", "807 3021573 8193"]
    assert insert_foreign_spans("x", "Tom sold the cups to Ben today.", None, random.Random(3), n_spans=2) == (
        "x", "Tom sold `PUSCT P` {{69=60}} the cups to Ben today.", [(9, 18), (19, 28)])


def test_foreign_rewrites_write_a_transform_of_the_prompts_contents():
    """With `rewrite`, some spans' response contents are a generic rewrite of the prompt's copy (the prompt keeps
    the original); without it, no draw changes."""
    response, outcomes = "Tom sold the cups to Ben today.", []
    for seed in range(300):
        prompt, r, ((a, b),) = insert_foreign_spans("Repeat: " + response, response, None, random.Random(seed),
                                                    pool=[("(", ")")], rewrite=True)
        written, original = r[a + 1:b - 1], prompt[len("Repeat: ") + a + 1:].split(")")[0]
        rewrites = {" ".join(f(w) for w in original.split(" ")) for f in REWRITES}
        outcomes.append("kept" if written == original else "rewritten" if written in rewrites else "redrawn")
        assert insert_foreign_spans("x", response, None, random.Random(seed)) == insert_foreign_spans(
            "x", response, None, random.Random(seed), rewrite=False)
    counts = {k: outcomes.count(k) for k in ("kept", "rewritten", "redrawn")}
    assert counts["kept"] > 110 and counts["rewritten"] > 40 and counts["redrawn"] > 40, counts  # 1/2, 1/4, 1/4
    assert rewrite_content("Tom 39", random.Random(0)) in {"Upn 40", "Tm 39", "Tmo 39", "TToomm 3399"}


def test_foreign_rewrites_reach_the_experts_rows_but_not_the_backgrounds(tok):
    plain = make_task(tok, config(background_spans=True), reg_data="own+foreign")
    rewriting = make_task(tok, config(background_spans=True, foreign_rewrites=True), reg_data="own+foreign")
    assert plain.background_dataset("train")["y"] == rewriting.background_dataset("train")["y"]
    assert plain.expert_dataset("train")["y"] != rewriting.expert_dataset("train")["y"]


def test_the_unicode_pool_adds_multi_byte_brackets_as_often_as_the_ascii_ones():
    import unicodedata

    assert len(UNICODE_BRACKETS) == 70 and all(len(a) == len(b) == 1 for a, b in UNICODE_BRACKETS)
    assert all(unicodedata.category(a) == "Ps" and unicodedata.category(b) == "Pe" and ord(b) == ord(a) + 1
               for a, b in UNICODE_BRACKETS)
    assert expert_pool(CALC_SPEC) == delimiter_pool(CALC_SPEC)  # the default draws as before
    wide = expert_pool(CALC_SPEC, "brackets+unicode")
    ascii_share = sum(pair in DELIMITER_POOL for pair in wide) / len(wide)
    assert ascii_share == 0.5 and ("⟦", "⟧") in wide and ("<", ">") not in wide
    kept_out = expert_pool(CALC_SPEC, "brackets+unicode", exclude="⟦⟧")
    assert ("⟦", "⟧") not in kept_out and ("⟨", "⟩") in kept_out and ("[", "]") in kept_out
    assert all(not ({*a, *b} & {"⟦", "⟧"}) for a, b in kept_out)
    with pytest.raises(ValueError, match="unknown foreign span pool 'emoji'"):
        expert_pool(CALC_SPEC, "emoji")


def test_the_unicode_pool_reaches_the_experts_rows_but_not_the_backgrounds(tok):
    plain = make_task(tok, config(background_spans=True), reg_data="own+foreign")
    wide = make_task(tok, config(background_spans=True, foreign_pool="brackets+unicode", foreign_exclude="⟦⟧"),
                     reg_data="own+foreign")
    assert plain.background_dataset("train")["y"] == wide.background_dataset("train")["y"]
    rows = wide.expert_dataset("train")["y"]
    assert rows != plain.expert_dataset("train")["y"]
    assert any(a in y for y in rows for a, _ in UNICODE_BRACKETS) and not any("⟦" in y or "⟧" in y for y in rows)
    with pytest.raises(TaskError, match="task.foreign_pool must be one of brackets, brackets\+unicode"):
        config(foreign_pool="unicode")
    with pytest.raises(TaskError, match="expert 'calc': no foreign span delimiter pair is free"):
        every = "".join(a + b for a, b in DELIMITER_POOL + UNICODE_BRACKETS)
        make_task(tok, config(foreign_exclude=every), reg_data="own+foreign").expert_dataset("train")


def test_foreign_words_come_from_the_general_training_rows(tok):
    t = make_task(tok, config(foreign_words=True), reg_data="own+foreign")
    words = t._general_words()
    general = " ".join(r.example.response for r in t.general["train"]).lower()
    assert words and words == sorted(set(words)) and all(w in general for w in words)
    spanned = t.expert_dataset("train")["y"]
    plain = make_task(tok, reg_data="own+foreign").expert_dataset("train")["y"]
    assert spanned != plain and len(spanned) == len(plain)


def test_background_spans_add_a_spanned_copy_of_each_general_training_row(tok):
    plain = make_task(tok).background_dataset("train")["y"]
    t = make_task(tok, config(background_spans=True))
    spanned = t.background_dataset("train")["y"]
    assert spanned[: len(plain)] == plain  # the general rows first, as without
    extra = spanned[len(plain):]
    assert 0 < len(extra) <= len(plain) and all(spans_of_pool(y) for y in extra)
    assert t.background_dataset("val")["y"] == make_task(tok).background_dataset("val")["y"]  # held out: plain
    assert make_task(tok, config(background_spans=True)).background_dataset("train")["y"] == spanned  # seeded


# --- own+foreign rows ---------------------------------------------------------------------------------
def test_foreign_rows_are_built_from_own_and_general_rows_with_foreign_spans(tok):
    t = make_task(tok, reg_data="own+foreign")
    rows = t.expert_dataset("train")
    general = {r["y"] for r in t.background_dataset("train")}
    for j, spec in enumerate((CALC_SPEC, UPPER_SPEC)):
        own = [r for r in rows if r["expert_index"] == j and r["is_task"] == 1]
        reg = [r for r in rows if r["expert_index"] == j and r["is_task"] == 0]
        assert len(reg) == len(own) == 32
        from_own = [r for r in reg if r["task_on_mask"] == 1]
        assert len(from_own) == 16
        for row in reg:
            check_layout(tok, row)
            assert row["y"] not in general and spans_of_pool(row["y"])  # every row holds a foreign span
            own_delims = spec.start in row["y"] or spec.end in row["y"]
            assert own_delims == (row["task_on_mask"] == 1) == any(row["masks"][0])
        for row in from_own:  # the skill's own spans, unchanged, and its mask on exactly them
            assert len(interval_char_spans(row["y"], spec)) >= 1


def test_after_close_marks_the_first_token_after_each_own_and_foreign_span(tok):
    t = make_task(tok, reg_data="own+foreign")
    rows = t.expert_dataset("train")
    for row in rows:
        spec = (CALC_SPEC, UPPER_SPEC)[row["expert_index"]]
        after, start = row["after_close"], row["output_start"]
        assert len(after) == len(row["input_ids"]) and set(after) <= {0, 1}
        # every marked position predicts a token (or the EOS) of the response, outside the own mask
        marked = [i for i, a in enumerate(after) if a]
        assert all(start - 1 <= i <= start - 1 + row["output_len"] and not row["masks"][0][i] for i in marked)
        # the token before each marked position ends a span: the own end delimiter or a pool end delimiter
        text_before = [tok.decode(row["input_ids"][start:i + 1]) for i in marked]
        ends = [spec.end] + [b for _, b in DELIMITER_POOL]
        assert all(any(x.rstrip().endswith(e) for e in ends) for x in text_before), text_before
        n_own = len(interval_char_spans(row["y"], spec))
        assert len(marked) >= (n_own if row["is_task"] else n_own + 1)  # a regularizer row holds a foreign span
    own_rows = [r for r in rows if r["is_task"] == 1]
    assert all(sum(r["after_close"]) == len(interval_char_spans(r["y"], (CALC_SPEC, UPPER_SPEC)[r["expert_index"]]))
               for r in own_rows)


def test_inside_foreign_marks_the_tokens_of_each_foreign_span(tok):
    t = make_task(tok, reg_data="own+foreign")
    rows = t.expert_dataset("train")
    pool_chars = {c for pair in DELIMITER_POOL for c in "".join(pair)}
    for row in rows:
        inside, start = row["inside_foreign"], row["output_start"]
        assert len(inside) == len(row["input_ids"]) and set(inside) <= {0, 1}
        marked = [i for i, a in enumerate(inside) if a]
        if row["is_task"] == 1:  # an own row holds no foreign span
            assert not marked
            continue
        # a regularizer row holds one or two spans: marked positions predict response tokens off the own mask,
        # and together they spell the spans' contents and end delimiters; the text between spans is not marked
        assert marked and all(start - 1 <= i < start - 1 + row["output_len"] and not row["masks"][0][i]
                              for i in marked)
        text = tok.decode([row["input_ids"][i + 1] for i in marked])
        assert any(b in text for _, b in DELIMITER_POOL), text
        assert len(text) < len(row["y"]) and set(text) & pool_chars


def test_at_open_marks_the_token_that_opens_each_own_and_foreign_span(tok):
    t = make_task(tok, reg_data="own+foreign")
    rows = t.expert_dataset("train")
    for row in rows:
        spec = (CALC_SPEC, UPPER_SPEC)[row["expert_index"]]
        opens, start = row["at_open"], row["output_start"]
        assert len(opens) == len(row["input_ids"]) and set(opens) <= {0, 1}
        marked = [i for i, a in enumerate(opens) if a]
        assert all(start - 1 <= i < start - 1 + row["output_len"] and not row["masks"][0][i] for i in marked)
        # the text from each marked position's token on begins with a start delimiter: the own one or one of the pool
        texts = [tok.decode(row["input_ids"][i + 1:start + row["output_len"]]).lstrip() for i in marked]
        starts = [spec.start] + [a for a, _ in DELIMITER_POOL]
        assert all(any(x.startswith(s) for s in starts) for x in texts), texts
        n_own = len(interval_char_spans(row["y"], spec))
        if row["is_task"] == 1:  # an own row: one mark per interval; from it to where the mask opens, the delimiter
            mask = row["masks"][0]
            opened = [next(j for j in range(i, len(mask)) if mask[j]) for i in marked]
            assert len(marked) == n_own and all(
                tok.decode(row["input_ids"][i + 1:j + 1]).strip() == spec.start for i, j in zip(marked, opened, strict=True))
        else:  # a regularizer row also marks each foreign span (two may open in one token)
            assert len(marked) >= n_own + 1


def test_position_weights_of_both_kinds_add():
    from lightning_modules.expert import ExpertLM, ExpertSettings

    batch = {"after_close": torch.tensor([[1, 0, 0, 1]]), "inside_foreign": torch.tensor([[0, 1, 0, 1]])}
    weight = ExpertLM._position_weight
    both = SimpleNamespace(settings=ExpertSettings(reg_after_close=3.0, reg_inside_foreign=5.0))
    assert weight(both, batch).tolist() == [[3.0, 5.0, 1.0, 7.0]]
    assert weight(SimpleNamespace(settings=ExpertSettings()), batch) is None
    with pytest.raises(ValueError, match="reg_inside_foreign needs training rows that mark those positions"):
        weight(SimpleNamespace(settings=ExpertSettings(reg_inside_foreign=2.0)), {"after_close": batch["after_close"]})
    three = SimpleNamespace(settings=ExpertSettings(reg_after_close=3.0, reg_inside_foreign=5.0, reg_at_open=10.0))
    assert weight(three, batch | {"at_open": torch.tensor([[1, 0, 1, 0]])}).tolist() == [[12.0, 5.0, 10.0, 7.0]]


@pytest.mark.parametrize("key,column", [("reg_after_close", "after_close"), ("reg_inside_foreign", "inside_foreign"),
                                        ("reg_at_open", "at_open")])
def test_a_training_step_weighs_the_marked_positions(tok, key, column):
    """The text task's rows through its collator into ExpertLM: `reg_after_close` (`reg_inside_foreign`) raises
    the regularizer by the marked positions' divergence, and 1 leaves it as it was."""
    from lightning_modules.expert import ExpertLM, ExpertSettings

    t = make_task(tok, reg_data="own+foreign")
    rows = [r for r in t.expert_dataset("train") if r["is_task"] == 0][:8]
    batch = t.collator()(rows)
    assert batch[column].shape == batch["targets"].shape and batch[column].sum() >= 8

    def reg(weight: float) -> float:
        m = ExpertLM(tiny_llama(len(tok), 0), ["calc", "upper"], ExpertSettings(lora_r=2, **{key: weight}))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.add_(0.2)  # an expert that differs from the background
        logged = {}
        m.log = lambda key, value, **_: logged.__setitem__(key, float(value))
        m.training_step(batch, 0)
        return logged["train/reg"]

    plain, weighted = reg(1.0), reg(5.0)
    assert plain > 0 and weighted > plain * 1.05


@pytest.mark.parametrize("key", ["reg_after_close", "reg_inside_foreign", "reg_at_open"])
def test_bad_position_weights_are_refused_naming_the_key(key):
    from lightning_modules.expert import ExpertSettings

    assert load_config([], [f"expert.{key}=8"]).expert[key] == 8
    with pytest.raises(ConfigError, match=rf"expert.{key}=-1.0: must be a finite number >= 0"):
        load_config([], [f"expert.{key}=-1"])
    with pytest.raises(ValueError, match=f"{key}=2.0 needs regularizer='token'"):
        ExpertSettings(**{key: 2.0}, regularizer="features")
    with pytest.raises(ValueError, match=f"{key}=-1.0 must be >= 0"):
        ExpertSettings(**{key: -1.0})


@pytest.mark.parametrize("key,marks", [("reg_after_close", "where intervals close"),
                                       ("reg_inside_foreign", "foreign spans"), ("reg_at_open", "where spans open")])
def test_span_weights_need_a_task_that_marks_the_spans(tmp_path, key, marks):
    """The letters task marks no spans: refused before anything is trained or written."""
    from lightning_modules.pipeline.stages import plan_run

    cfg = load_config([], [f"expert.{key}=4", f"output_dir={tmp_path / 'x'}"])
    with pytest.raises(ConfigError, match=f"expert.{key}=4.0 needs a task whose rows mark {marks} "
                                          "\\(task.name=text\\); task 'letters' does not"):
        plan_run(cfg)
    assert not (tmp_path / "x").exists()


def test_an_experts_rows_do_not_depend_on_the_other_experts(tok):
    """Never met: calc's rows are the same whatever the other expert is, or with no other expert at all."""
    def calc_rows(exps):
        rows = make_task(tok, exps=exps, trained=["calc"], reg_data="own+foreign").expert_dataset("train")
        return [(r["y"], r["x"], r["masks"]) for r in rows]

    alone = calc_rows(experts()[:1])
    calc, upper = experts()
    assert calc_rows([calc, upper]) == alone
    assert calc_rows([Expert("shout", upper.spec, data=upper.data), calc]) == alone


def test_foreign_rows_are_seeded(tok):
    a, b = (make_task(tok, reg_data="own+foreign").expert_dataset("train")["y"] for _ in range(2))
    assert a == b
    assert make_task(tok, reg_data="own+foreign", seed=1).expert_dataset("train")["y"] != a


def test_other_tasks_refuse_the_text_recipes():
    letters = task_class("letters")
    with pytest.raises(TaskError, match="own\\+foreign is not made by the letters task"):
        letters(letters.config_class(), [Expert("A_to_B", {"rules": {"A": "B"}})], reg_data="own+foreign")


def test_config_accepts_the_recipes_and_checks_the_sampling_settings():
    cfg = load_config([], ["expert.reg_data=own+samples", "expert.reg_samples.temperature=0.7"])
    assert cfg.expert.reg_samples.temperature == 0.7
    with pytest.raises(ConfigError, match="expert.reg_samples.top_p"):
        load_config([], ["expert.reg_samples.top_p=0"])


# --- own+samples rows and their cache -----------------------------------------------------------------
def test_sample_rows_use_the_given_continuations_and_leave_out_own_delimiters(tok):
    t = make_task(tok, reg_data="own+samples")
    prompts = t.background_sample_prompts()
    assert prompts == [enc.prompt_ids for enc in t.general["train"]]
    with pytest.raises(TaskError, match="samples are not drawn yet"):
        t.expert_dataset("train")
    texts = [f"sample {i} [loud]" if i % 2 else f"sample {i}" for i in range(len(prompts))]
    t.set_background_samples(texts)
    rows = t.expert_dataset("train")
    for j, name in enumerate(("calc", "upper")):
        reg = [r for r in rows if r["expert_index"] == j and r["is_task"] == 0]
        assert len(reg) == 32 and {r["task_on_mask"] for r in reg} == {0}
        for row in reg:
            check_layout(tok, row)
            assert row["y"] in texts and not any(row["masks"][0])
        assert any("[" in r["y"] for r in reg) == (name == "calc")  # upper's own delimiter: left out of its rows
    assert make_task(tok, reg_data="own+background").background_sample_prompts() == []


def sampling_config(**samples) -> OmegaConf:
    return OmegaConf.create({"seed": 0, "task": {"max_new_tokens": 4},
                             "expert": {"reg_samples": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": None,
                                                        "batch_size": 16, **samples}}})


def test_samples_are_drawn_once_and_read_from_the_cache(tok, tmp_path, monkeypatch):
    background = tmp_path / "background"
    tiny_llama(len(tok), 0).save_pretrained(background, safe_serialization=True)
    root = tmp_path / "cache"
    t = make_task(tok, config(limit=6), reg_data="own+samples")
    path = reg_samples.draw_background_samples(sampling_config(), t, background, root)
    assert path.parent == root / reg_samples.SAMPLES_DIR and path.is_file()
    drawn = json.loads(path.read_text())["responses"]
    assert len(drawn) == len(t.background_sample_prompts()) == 6
    assert {r["y"] for r in t.expert_dataset("train") if r["is_task"] == 0} <= set(drawn)
    stamp = path.stat().st_mtime_ns

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled again")

    monkeypatch.setattr(reg_samples, "sample_continuations", no_sampling)
    again = make_task(tok, config(limit=6), reg_data="own+samples")
    assert reg_samples.draw_background_samples(sampling_config(), again, background, root) == path
    assert path.stat().st_mtime_ns == stamp and list(path.parent.iterdir()) == [path]
    assert again.expert_dataset("train")["y"] == t.expert_dataset("train")["y"]
    # another sampling setting or another background is another file
    with pytest.raises(AssertionError, match="sampled again"):
        reg_samples.draw_background_samples(sampling_config(temperature=0.5), again, background, root)
    other = tmp_path / "other"
    tiny_llama(len(tok), 1).save_pretrained(other, safe_serialization=True)
    assert reg_samples.samples_path(reg_samples.background_checksums(other), again.background_sample_prompts(),
                                    json.loads(path.read_text())["settings"], root) != path


def test_a_task_without_sample_rows_draws_nothing(tok, tmp_path):
    t = make_task(tok, reg_data="own+background")
    assert reg_samples.draw_background_samples(sampling_config(), t, tmp_path, tmp_path) is None
    assert not any(tmp_path.iterdir())


def test_eval_limit_shortens_held_out_rows_only(tok):
    full, short = make_task(tok), make_task(tok, config(eval_limit=3))
    assert len(short.compositional_dataset("test")) == 3 and len(short.background_dataset("val")) == 3
    assert short.expert_dataset("train")["y"] == full.expert_dataset("train")["y"]
    assert fixture("general.jsonl") in short.cfg.general


def test_region_divergence_splits_positions_by_whose_interval_they_lie_in(tok):
    from compose import ComposedLM
    from scripts.interval_divergence import region_divergence

    t = make_task(tok, config(limit=4))
    rows = t.compositional_dataset("test")
    background = tiny_llama(len(tok), 0)
    composed = ComposedLM(background, [tiny_llama(len(tok), 0), tiny_llama(len(tok), 1)], names=["calc", "upper"],
                          tokenizer=tok)
    result = region_divergence(composed, rows, t.collator(), batch_size=3)
    valid = sum(sum(v != -100 for v in r) for r in rows["targets"])
    for name, j in (("calc", 0), ("upper", 1)):
        r = result[name]
        assert r["own_n"] + r["other_n"] + r["none_n"] == valid
        assert r["own_n"] == sum(sum(m[j]) for m in rows["masks"]) > 0 and r["other_n"] > 0
    assert result["calc"]["other"] == pytest.approx(0.0, abs=1e-6)  # the background's copy: 0 everywhere
    assert min(result["upper"][k] for k in ("own", "other", "none")) > 1e-4
    assert all(result["calc"][f"ratio_{k}"] == pytest.approx(0.0, abs=1e-6) for k in ("own", "other", "none"))
    # the reference token's log-ratio inside calc's interval, computed here directly for upper
    batch = t.collator()([rows[i] for i in range(len(rows))])
    lp_b, lp_e = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
    targets, calc_mask = batch["targets"], batch["masks"][:, 0].bool() & (batch["targets"] != -100)
    ratio = lp_e[1].gather(-1, targets.clamp_min(0)[..., None]) - lp_b.gather(-1, targets.clamp_min(0)[..., None])
    inside_calc = ratio.squeeze(-1)[calc_mask & ~batch["masks"][:, 1].bool()]
    assert result["upper"]["ratio_other"] == pytest.approx(float(inside_calc.double().mean()), abs=1e-5)


def test_foreign_spans_sets_how_many_spans_a_row_gets(tok):
    def counts(spans):
        t = make_task(tok, config(foreign_spans=spans), reg_data="own+foreign")
        rows = [r for r in t.expert_dataset("train") if r["is_task"] == 0]
        marks = [r["inside_foreign"] for r in rows]  # one run of marked positions per span
        return [sum(1 for a, b in zip([0, *m[:-1]], m, strict=True) if b and not a) for m in marks]

    default, three = counts([1, 2]), counts([3, 3])
    assert set(default) <= {1, 2} and 2 in default
    assert max(three) == 3 and sum(three) > sum(default)  # fewer only where a row has fewer word boundaries
    for bad in ([0, 2], [3, 2], [2], [1.5, 2], 3, "1,3"):
        with pytest.raises(TaskError, match="task.foreign_spans"):
            config(foreign_spans=bad)


def test_first_misses_sorts_each_rows_first_miss_by_region_and_blames_the_largest_push():
    from types import SimpleNamespace

    from scripts.interval_divergence import FIRST_MISS_REGIONS, _first_misses, first_miss_counts

    V, T = 5, 6
    names = ["a", "b"]
    decode = lambda ids: "".join(map(str, ids))  # noqa: E731
    composed = SimpleNamespace(names=names, weights=[1.0, 1.0], tokenizer=SimpleNamespace(decode=decode))
    # targets are token 0 everywhere; an interval covers positions 2-3 of every row; the last position is the EOS
    targets = torch.zeros(4, T, dtype=torch.long)
    valid = torch.ones(4, T, dtype=torch.bool)
    masks = torch.zeros(2, 4, T, dtype=torch.bool)
    masks[0, :, 2:4] = True  # expert a's
    lp_b = torch.full((4, T, V), -5.0)
    lp_b[..., 0] = 0.0  # the background is right everywhere
    lp_e = lp_b.expand(2, 4, T, V).clone()
    soft = lp_b.clone()
    for row, (t, pusher) in enumerate([(1, 1), (2, 0), (4, 1), (5, 0)]):  # open, inside, after, eos
        soft[row, t, 3] = 1.0  # the composition's top token is 3 at t
        lp_e[pusher, row, t, 3] = 2.0  # and expert `pusher` raised it most
    acc = first_miss_counts(names)
    ids = torch.arange(T).expand(4, T)  # the prompt's token ids: 0, 1, ..., T - 1 in every row
    _first_misses(acc, composed, ids, targets, valid, masks, soft, lp_b, lp_e, 0)
    assert [acc[r] for r in FIRST_MISS_REGIONS] == [1, 1, 1, 1, 0] and acc["no_miss"] == 0
    assert acc["open_background_right"] == 1 and acc["pushed_most"] == {"a": 2, "b": 2}
    assert acc["inside_owner_right"] == 0  # the owner (a) raised the wrong token itself
    assert [e["region"] for e in acc["examples"]] == ["open", "inside", "after", "eos"]
    # the reference (0) and the top token (3) are also decoded after the (up to) three tokens before them
    assert [(e["reference_in_context"], e["top_in_context"]) for e in acc["examples"]] == [
        ("010", "013"), ("0120", "0123"), ("2340", "2343"), ("3450", "3453")]
    assert acc["examples"][2]["before"] == "01234"
    # each expert's log-ratio at the reference, at the composition's top token, and its median over the vocabulary
    assert acc["examples"][1]["log_ratio"] == {"a": {"reference": 0.0, "top": 7.0, "median": 0.0},
                                               "b": {"reference": 0.0, "top": 0.0, "median": 0.0}}
