"""Skills checked by programs (`data.skills`) and the four-skill rows of `configs/experiment/smollm2_skills4.yaml`,
with the rows of a fifth expert (`unit`) trained after those four.

The rows are written by `scripts/make_skill_data.py` (checked here to reproduce the committed files byte for byte);
every reference span passes its skill's verifier, wrong spans do not, and the test sets have the sizes the
config promises once `task.holdout` splits them.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data.skills import SKILL_NAMES, SkillError, check_row, check_skills, make_skill, skill_counts

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "experiment" / "smollm2_skills4.yaml"
CONFIG_K2 = ROOT / "configs" / "experiment" / "smollm2_skills4_k2.yaml"
DATA = ROOT / "configs" / "experiment" / "data" / "skills4"
SKILLS = {name: make_skill(name) for name in SKILL_NAMES}
FOUR = ("calc", "upper", "reverse", "translate")
ARGS = ["--seed", "0", "--skills", *FOUR, "--n", "608", "--n_compositional", "800", "--pair", "calc", "upper"]
LATE_FILES = ("unit.jsonl", "compositional_late.jsonl")  # the fifth expert's, written by ARGS + --late unit


def read(path: Path) -> list[tuple[str, str]]:
    """(sentence, graded answer) of every row of a file."""
    rows = [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines()]
    return [(m[1]["content"], m[-1]["content"]) for m in rows]


def present(line: str) -> frozenset[str]:
    return frozenset(name for name, skill in SKILLS.items() if skill.spans(line))


@pytest.mark.parametrize(("name", "source", "right", "wrong"), [
    ("calc", "47+8=", "47+8=55", ["47+8=54", "47+8=", "48+8=56", "55", " 47+8=55"]),
    ("calc", "12*11=", "12*11=132", ["12*11=133", "12+11=23"]),
    ("upper", "good night", "GOOD NIGHT", ["GOOD night", "good night", "GOODNIGHT"]),
    ("reverse", "kite", "etik", ["kite", "etiK", "eitk"]),
    ("translate", "cat", "chat", ["cat", "chien", "Chat"]),
    ("unit", "5 km=", "5 km=5000 m", ["5 km=500 m", "5 km=5000 g", "5 km=5000m", "5000 m", "5 km=5 km", "5 km="]),
    ("unit", "99 L=", "99 L=99000 mL", ["99 L=99000 L", "99 L=99000 ml", "98 L=98000 mL"]),
    ("unit", "12 kg=", "12 kg=12000 g", ["12 kg=12000 kg", "12 kg=1200 g", " 12 kg=12000 g"]),
])
def test_verifiers_accept_the_right_span_and_reject_wrong_ones(name, source, right, wrong):
    skill = SKILLS[name]
    assert skill.verify(source, right)
    for span in wrong:
        assert not skill.verify(source, span), span


def test_verifiers_reject_inputs_outside_the_skill():
    assert not SKILLS["calc"].verify("47-8=", "47-8=39")          # not an operation the skill does
    assert not SKILLS["upper"].verify("OK", "OK")                 # nothing to capitalise
    assert not SKILLS["reverse"].verify("level", "level")         # a palindrome shows nothing
    assert not SKILLS["translate"].verify("zebra", "zebre")       # not in the dictionary
    assert not SKILLS["unit"].verify("5 cm=", "5 cm=50 mm")       # not a unit the skill converts
    assert not SKILLS["unit"].verify("5 km", "5 km5000 m")        # no = sign to answer after


@pytest.mark.parametrize("name", SKILL_NAMES)
def test_draws_verify(name):
    skill, rng = SKILLS[name], random.Random(name)
    for _ in range(200):
        source, right = skill.draw(rng)
        assert skill.verify(source, right), (source, right)
        assert not skill.verify(source, source)


def test_unit_draws_every_unit_in_range_and_owns_its_delimiters():
    rng = random.Random(0)
    drawn = [SKILLS["unit"].draw(rng)[0] for _ in range(500)]
    assert {d.split()[1] for d in drawn} == {"km=", "kg=", "L="}
    assert {int(d.split()[0]) for d in drawn} <= set(range(2, 100)) and {2, 99} <= {int(d.split()[0]) for d in drawn}
    unit = SKILLS["unit"]
    assert (unit.start, unit.end) == ("\u27e6", "\u27e7")
    check_skills(list(SKILLS.values()))  # all five: no delimiter shared or nested
    others = "".join(s.start + s.end for name, s in SKILLS.items() if name != "unit")
    assert unit.start not in others and unit.end not in others
    assert unit.spans("A ⟦5 km=⟧ and <<2+3=>> [hi] ⟦7 L=⟧.") == ["5 km=", "7 L="]


def test_skill_counts_scores_span_by_span():
    calc, upper = SKILLS["calc"], SKILLS["upper"]
    questions = ["A <<2+3=>> and <<4*5=>> [hi].", "B [ok] <<9+9=>>."]
    answers = ["A <<2+3=5>> and <<4*5=21>> [HI].", "B [OK] <<9+9=18"]  # the second calc span never closes
    assert skill_counts(calc, questions, answers) == (1, 3)
    assert skill_counts(upper, questions, answers) == (2, 2)


def test_check_row_names_the_skill_and_the_row():
    skills = list(SKILLS.values())
    check_row(skills, "Tom said {cat} and «kite».", "Tom said {chat} and «etik».", "x row 1")
    with pytest.raises(SkillError, match=r"^x row 2: skill 'translate'.*rejects .*\{chien\} for \{cat\}$"):
        check_row(skills, "Tom said {cat}.", "Tom said {chien}.", "x row 2")
    with pytest.raises(SkillError, match=r"^x row 3: skill 'reverse': the question has 1 span\(s\), the answer 0$"):
        check_row(skills, "Tom said «kite».", "Tom said kite.", "x row 3")


def test_shared_delimiters_are_refused():
    check_skills(list(SKILLS.values()))
    with pytest.raises(SkillError, match=r"^skills 'upper' and 'reverse' share the delimiter '\['"):
        check_skills([SKILLS["upper"], replace(SKILLS["reverse"], start="[")])
    with pytest.raises(SkillError, match=r"^skills 'calc' and 'reverse' share the delimiter '<'"):
        check_skills([SKILLS["calc"], replace(SKILLS["reverse"], start="<", end="|")])
    with pytest.raises(SkillError, match="unknown skill 'shout'"):
        make_skill("shout")


def test_generator_stops_on_bad_skills_before_writing(tmp_path, capsys):
    from scripts.make_skill_data import generate, main

    broken = replace(SKILLS["reverse"], verify=lambda source, span: span == source)
    with pytest.raises(SkillError, match=r"^compositional\.jsonl row 1: skill 'reverse'.s verifier rejects"):
        generate(tmp_path / "a", [SKILLS["calc"], broken])
    with pytest.raises(SkillError, match="share the delimiter"):
        generate(tmp_path / "b", [SKILLS["upper"], replace(SKILLS["translate"], end="]")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(SystemExit, match=r"^make_skill_data: compositional rows need at least two skills"):
        main(["--out", str(tmp_path / "c"), "--skills", "calc"])
    with pytest.raises(SystemExit, match=r"^make_skill_data: --pair calc reverse: name two different skills of calc, upper$"):
        main(["--out", str(tmp_path / "d"), "--pair", "calc", "reverse"])
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_generator_reproduces_the_committed_four_skill_rows(tmp_path):
    from scripts.make_skill_data import main

    main(["--out", str(tmp_path / "four"), *ARGS])
    main(["--out", str(tmp_path / "late"), *ARGS, "--late", "unit"])
    assert sorted(p.name for p in (tmp_path / "late").iterdir()) == sorted(LATE_FILES)
    for path in sorted(DATA.glob("*.jsonl")):
        written = tmp_path / ("late" if path.name in LATE_FILES else "four") / path.name
        assert written.read_bytes() == path.read_bytes(), path.name
    names = [p.name for p in (tmp_path / "four").iterdir()] + list(LATE_FILES)
    assert sorted(names) == sorted(p.name for p in DATA.glob("*.jsonl"))


@pytest.mark.parametrize("folder, start, end", [("skills4_late_angle", "⟨", "⟩"), ("skills4_late_paren", "((", "))")])
def test_late_delimiters_move_the_same_rows_to_another_pair(tmp_path, folder, start, end):
    from scripts.make_skill_data import main

    main(["--out", str(tmp_path / "moved"), *ARGS, "--late", "unit", "--late_delimiters", start, end])
    moved = replace(SKILLS["unit"], start=start, end=end)
    skills = [*(SKILLS[name] for name in FOUR), moved]
    for name in LATE_FILES:
        written = (tmp_path / "moved" / name).read_text(encoding="utf-8")
        assert written.encode() == (DATA.parent / folder / name).read_bytes(), name
        # the same draws: only the late skill's delimiters differ from the committed rows
        assert written.replace(start, "⟦").replace(end, "⟧") == (DATA / name).read_text(encoding="utf-8")
        for n, (line, answer) in enumerate(read(tmp_path / "moved" / name), 1):
            check_row(skills, line, answer, f"{name} row {n}")
            assert moved.spans(line) and "⟦" not in line + answer


def test_late_delimiters_of_another_skill_are_refused_before_writing(tmp_path):
    from scripts.make_skill_data import main

    with pytest.raises(SystemExit, match=r"^make_skill_data: skills 'upper' and 'unit' share the delimiter '\['"):
        main(["--out", str(tmp_path / "bad"), *ARGS, "--late", "unit", "--late_delimiters", "[", ")"])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit, match=r"^make_skill_data: --late_delimiters needs --late$"):
        main(["--out", str(tmp_path / "bad"), *ARGS, "--late_delimiters", "⟨", "⟩"])


def test_late_skill_rows_all_need_it_and_repeat_no_other_file(tmp_path):
    from scripts.make_skill_data import generate

    four = [SKILLS[name] for name in FOUR]
    assert generate(tmp_path / "four", four, n=10, n_compositional=24, pairs=[("calc", "upper")]) == {
        "general": 10, "compositional": 24, **dict.fromkeys(FOUR, 10), "compositional_calc_upper": 24}
    assert generate(tmp_path / "late", four, n=10, n_compositional=24, pairs=[("calc", "upper")],
                    late=SKILLS["unit"]) == {"unit": 10, "compositional_late": 24}
    earlier = {line for path in (tmp_path / "four").iterdir() for line, _ in read(path)}
    assert {present(line) for line, _ in read(tmp_path / "late" / "unit.jsonl")} == {frozenset({"unit"})}
    rows = read(tmp_path / "late" / "compositional_late.jsonl")
    for n, (line, answer) in enumerate(rows, 1):
        check_row(list(SKILLS.values()), line, answer, f"compositional_late.jsonl row {n}")
        assert line not in earlier
    sets = [present(line) for line, _ in rows]
    assert all("unit" in s for s in sets)
    assert {size: sum(len(s) == size for s in sets) for size in (2, 3, 4)} == {2: 8, 3: 8, 4: 8}
    assert set().union(*sets) == set(SKILL_NAMES)


def test_late_skill_must_not_be_one_of_the_skills(tmp_path):
    from scripts.make_skill_data import main

    with pytest.raises(SystemExit, match=r"^make_skill_data: --late calc: name a skill that is not one of calc, upper$"):
        main(["--out", str(tmp_path / "a"), "--late", "calc"])
    assert not (tmp_path / "a").exists()


def test_four_skill_rows_are_right_and_cover_every_set_of_skills():
    skills, seen = list(SKILLS.values()), set()
    for path in sorted(DATA.glob("*.jsonl")):
        for n, (line, answer) in enumerate(read(path), 1):
            check_row(skills, line, answer, f"{path.name} row {n}")
            assert line not in seen
            seen.add(line)
            kind = path.stem
            if kind in SKILLS:
                assert present(line) == {kind}
            elif kind == "general":
                assert present(line) == set()
            elif kind == "compositional_calc_upper":
                assert present(line) == {"calc", "upper"}
            elif kind == "compositional":
                assert "unit" not in present(line)
            # outside the spans, the answer is the question
            strip = line, answer
            for skill in skills:
                pattern = re.escape(skill.start) + ".*?" + re.escape(skill.end)
                strip = tuple(re.sub(pattern, skill.start + skill.end, s) for s in strip)
            assert strip[0] == strip[1]
    sets = [present(line) for line, _ in read(DATA / "compositional.jsonl")]
    by_size = {size: sum(len(s) == size for s in sets) for size in (2, 3, 4)}
    assert sum(by_size.values()) == len(sets) == 800 and min(by_size.values()) >= 266
    for pair in itertools.combinations(FOUR, 2):
        assert sum(set(pair) == s for s in sets) >= 40, pair             # the pair alone
        assert sum(set(pair) <= s for s in sets) >= 300, pair            # the pair, alone or in a larger set
    # the fifth expert's test set: unit and one, two or three of the four others, every other with unit
    late = [present(line) for line, _ in read(DATA / "compositional_late.jsonl")]
    assert all("unit" in s for s in late)
    assert {size: sum(len(s) == size for s in late) for size in (2, 3, 4)} == {2: 267, 3: 267, 4: 266}
    for name in FOUR:
        assert sum({"unit", name} == s for s in late) >= 66, name        # unit with that skill alone
        assert sum(name in s for s in late) >= 300, name


@pytest.mark.parametrize("files", [[CONFIG], [CONFIG, CONFIG_K2]], ids=["k4", "k2"])
def test_config_splits_give_the_promised_test_sets(files):
    """`task.holdout` rows of each expert's and the general file are halved into validation (the odd one) and
    test; the compositional rows are halved likewise (`data.tasks.text.TextTask`)."""
    from lightning_modules.pipeline.config import load_config

    cfg = load_config([str(f) for f in files])
    raw = OmegaConf.merge(*(OmegaConf.load(f) for f in files))
    holdout = int(cfg.task.holdout)
    val = (holdout + 1) // 2
    assert holdout - val >= 200 and val == 200
    for path in [*cfg.task.general, *(p for e in cfg.experts for p in e.data)]:
        assert len(read(ROOT / path)) - holdout == 208, path   # as many training rows as smollm2_skills.yaml
    n = len(read(ROOT / cfg.task.compositional[0]))
    assert n - (n + 1) // 2 >= 400
    # the experts are the skills, with their delimiters; no two share one
    specs = {e.name: (e.interval.start, e.interval.end) for e in raw.experts}
    assert specs == {name: (s.start, s.end) for name, s in SKILLS.items() if name in specs}
    assert len(specs) == (4 if len(files) == 1 else 2)
    needed = {frozenset(present(line)) for line, _ in read(ROOT / cfg.task.compositional[0])}
    assert set().union(*needed) == set(specs)  # the rows need exactly the experts in play
    check_skills([replace(SKILLS[name], start=a, end=b) for name, (a, b) in specs.items()])
