"""Generate the rows of the skill-expert experiments on SmolLM2-135M-Instruct: experts that own spans of a sentence.

    python scripts/make_skill_data.py --out configs/experiment/data/smollm2_skills --seed 0
    python scripts/make_skill_data.py --out configs/experiment/data/skills4 --seed 0 \\
        --skills calc upper reverse translate --n 608 --n_compositional 800 --pair calc upper
    python scripts/make_skill_data.py --out configs/experiment/data/skills4 --seed 0 \\
        --skills calc upper reverse translate --n 608 --n_compositional 800 --pair calc upper --late unit
    python scripts/make_skill_data.py --out configs/experiment/data/skills4_late_angle --seed 0 \\
        --skills calc upper reverse translate --n 608 --n_compositional 800 --pair calc upper --late unit \\
        --late_delimiters ⟨ ⟩      # and --out .../skills4_late_paren --late_delimiters "((" "))"
    python scripts/make_skill_data.py --out configs/experiment/data/skills4_plain --seed 0 --format plain \\
        --skills calc upper reverse translate --n 608 --n_compositional 800 --pair calc upper

write the rows of `configs/experiment/smollm2_skills.yaml` (two skills; defaults `--n 240 --n_compositional 48
--op add --skills calc upper`) and of `configs/experiment/smollm2_skills4.yaml` (four skills; 608 rows per file =
208 training rows + 400 held out, 800 compositional rows = 400 validation + 400 test) and its two-expert variant
`smollm2_skills4_k2.yaml` (`compositional_calc_upper.jsonl`), and the same rows as plain prompt/response rows
for `configs/experiment/gemma3_skills4.yaml` and `gemma3_skills4_k2.yaml`. The third command adds, next to the
four-skill files and without rewriting them, the rows of a fifth expert trained after those four: `unit.jsonl`
(608 rows) and `compositional_late.jsonl` (800 rows, each needing `unit` and one to three of the four others),
the test set of the composition of all five. The fourth writes those two files again with `unit`'s span in `⟨…⟩`
(`skills4_late_angle`) or `((…))` (`skills4_late_paren`), pairs of the experts' random-span pool, instead of
`⟦…⟧`, every draw the same. Every file is byte for byte the same for the same arguments: every random draw comes from a `random.Random` seeded with the seed and the file's name.

The skills (`data.skills`: delimiters, draws, and a verifier per skill that checks every row written here):

* `calc` `<<...>>`: a calculator span the answer fills in: `Tom sold <<47+8=>> cups.` becomes
  `Tom sold <<47+8=55>> cups.` `--op`: `add` (two-digit + one-digit, the default), `add2` (two-digit +
  two-digit), `mul` (the times table to 12), `mul32` (three-digit x two-digit). In a pilot with longer
  sentences of this kind, a rank-16 LoRA (task loss on the whole answer) trained on 240 rows reached 83 % on
  `add` and 88 % on `mul` (24 held-out rows), and on 320 `add2` rows 50 % (16 rows); `add` is the default.
* `upper` `[...]`: one or two words the answer writes in capitals: `Then Ben said [good night].` becomes
  `Then Ben said [GOOD NIGHT].`
* `reverse` `«...»`: a word (of 40) spelled backwards: `Mia spelled «kite» backwards.` becomes
  `Mia spelled «etik» backwards.`
* `translate` `{...}`: an English word (of 40) in French: `Leo said {cat} in French.` becomes
  `Leo said {chat} in French.`
* `unit` `⟦...⟧`: 2 to 99 km, kg or L that the answer writes in m, g or mL after the = sign:
  `The note says ⟦5 km=⟧.` becomes `The note says ⟦5 km=5000 m⟧.`

How well the frozen background does each skill on its own, prompted with the skill's instruction as the system
line and four worked rows (chat turns) before the row, greedy, 40 rows per skill, 95 % Wilson intervals
(one thread of a 2-core CPU, about 3.5 minutes of CPU time; `--op` measures another calculator operation):

    python scripts/make_skill_data.py --measure calc upper reverse translate --rows 40

| skill | right spans | accuracy | 95 % interval |
|---|---|---|---|
| calc (`add`) | 14 / 40 | 35.0 % | [22.1 %, 50.5 %] |
| upper | 10 / 40 | 25.0 % | [14.2 %, 40.2 %] |
| reverse | 0 / 40 | 0.0 % | [0.0 %, 8.8 %] |
| translate | 0 / 40 | 0.0 % | [0.0 %, 8.8 %] |

Asked for `«bucket»` backwards it writes `«bacchos»`; asked for `{flower}` in French, `{petite}`. `unit` is not
measured.

Files (each expert owns the interval after its start delimiter: the span's text and the end delimiter):

* `<skill>.jsonl` for each skill: that expert's rows, a sentence with one span of its skill.
* `general.jsonl`: sentences of the same kind with no span (nothing to compute): the background's evaluation
  rows, the experts' regularizer rows and the general-text perplexity check.
* `compositional.jsonl`: sentences needing several skills at once. With the two skills `calc` and `upper`, every
  row needs both (in either order). With more, a row needs 2, 3, ... or all of them: the rows are shared
  equally between those numbers of skills, and within one number equally between the sets of skills of that
  size (so every pair occurs, alone and inside larger sets), the spans in a random order.
* `compositional_<a>_<b>.jsonl` (`--pair a b`): sentences of that kind needing exactly the skills `a` and `b`,
  for a composition of those two experts alone.
* `<late>.jsonl` and `compositional_late.jsonl` (`--late SKILL`, a skill not among `--skills`, for an expert
  trained after theirs; only these two files are written): the late expert's rows (`--n`), and
  `--n_compositional` rows each needing the late skill and 1, 2 or 3 of the others, shared equally between
  those numbers and within one number equally between the sets of that size (so every other skill occurs with
  it), the spans in a random order. The other files of the same arguments are drawn, not written, so that no
  new sentence repeats one of theirs.

Every row is a chat (`messages`, rendered with SmolLM2's chat template): a short system line, the user's
sentence, the assistant echoing it unchanged, the user sending it again, and the graded assistant turn: the
sentence with its spans filled in. The echo turn is what lets the frozen 135M model write the text outside the
spans by itself: it repeats its own previous turn (spans left empty), where asked zero-shot to repeat a line it
mostly answers something else. `--format plain` writes the same sentences as `prompt`/`response` rows for a
base model with no chat template (Gemma-3-270M: `configs/experiment/gemma3_skills4.yaml`): the instruction, then
`Input:`/`Output:` lines holding the sentence, its echo and the sentence again, the answer after the last
`Output:`. So the background owns the text between the spans, each expert the inside of
its own spans. No sentence occurs twice across the files. Bad input stops before anything is written, in one
line: two skills sharing a delimiter, or a skill whose verifier rejects a row written here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.skills import (  # noqa: E402
    CALC_OPS,
    SKILL_NAMES,
    Skill,
    SkillError,
    check_row,
    check_skills,
    make_skill,
    skill_counts,
)

SYSTEM = "Repeat the message."
NOUNS = ("apple", "bag", "ball", "basket", "bell", "bike", "boat", "book", "bottle", "box", "brush", "bucket",
         "cake", "candle", "card", "chair", "coin", "cookie", "cup", "desk", "drum", "egg", "flag", "flower",
         "glass", "hat", "jar", "key", "kite", "lamp", "leaf", "letter", "map", "mug", "nail", "pen", "pencil",
         "pie", "plate", "ring", "rope", "shell", "shoe", "sock", "spoon", "stamp", "stone", "toy", "tray", "wheel")
PEOPLE = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Nora", "Jack", "Ella", "Omar",
          "Ruth", "Ivan", "Zoe")
# A skill's span is the slot named after it; `{{`/`}}` are a literal brace.
OWN_TEMPLATES = {
    "calc": ("{p} sold <<{calc}>> {n}s.", "We need <<{calc}>> {n}s.", "{p} has <<{calc}>> {n}s now.",
             "The box holds <<{calc}>> {n}s.", "{p} counted <<{calc}>> {n}s.", "There are <<{calc}>> {n}s left."),
    "upper": ("{p} wrote [{upper}] on it.", "Then {p} said [{upper}].", "The sign read [{upper}].",
              "{p} shouted [{upper}].", "The {n} says [{upper}].", "{p} painted [{upper}] on a {n}."),
    "reverse": ("{p} spelled «{reverse}» backwards.", "{p} wrote «{reverse}» in reverse on a {n}.",
                "The {n} shows «{reverse}» backwards.", "Then {p} read «{reverse}» from right to left.",
                "{p} painted «{reverse}» backwards on the {m}."),
    "translate": ("{p} said {{{translate}}} in French.", "{p} wrote {{{translate}}} in French on a {n}.",
                  "The {n} says {{{translate}}} in French.", "In French, {p} called it {{{translate}}}.",
                  "{p} asked for {{{translate}}} in French by the {m}."),
    "unit": ("{p} wrote ⟦{unit}⟧ on a {n}.", "The label on the {n} reads ⟦{unit}⟧.",
             "{p} measured ⟦{unit}⟧ by the {m}.", "The note says ⟦{unit}⟧.", "{p} noted ⟦{unit}⟧ next to the {n}.",
             "The {n} shows ⟦{unit}⟧."),
}
GENERAL_TEMPLATES = (
    "{p} put the {n} by the {m}.",
    "The {n} is near {p}.",
    "{p} gave {k} {n}s away.",
    "There is a {n} and a {m}.",
    "{p} found {k} {n}s.",
    "{p} washed the {n}.",
    "{p} likes the {n} more than the {m}.",
    "The old {n} broke.",
    "{p} carried {k} {n}s home.",
    "A {n} fell near the {m}.",
)
PAIR_TEMPLATES = (  # the compositional rows of the two skills calc and upper
    "{p} sold <<{calc}>> {n}s and said [{upper}].",
    "{p} wrote [{upper}] on <<{calc}>> {n}s.",
    "The sign read [{upper}] by <<{calc}>> {n}s.",
    "We need <<{calc}>> {n}s that say [{upper}].",
    "{p} shouted [{upper}] and sold <<{calc}>> {n}s.",
    "There are <<{calc}>> {n}s marked [{upper}].",
)
CLAUSES = {  # the compositional rows of more skills: "{p} <clause>, <clause> and <clause>."
    "calc": ("sold <<{calc}>> {n}s", "counted <<{calc}>> {n}s", "needs <<{calc}>> {n}s"),
    "upper": ("wrote [{upper}] on a {m}", "said [{upper}]", "shouted [{upper}]"),
    "reverse": ("spelled «{reverse}» backwards", "wrote «{reverse}» in reverse"),
    "translate": ("said {{{translate}}} in French", "wrote {{{translate}}} in French"),
    "unit": ("measured ⟦{unit}⟧", "noted ⟦{unit}⟧ on the {n}"),
}
LATE_OTHERS = 3  # a compositional_late row needs the late skill and at most this many others (at most 4 spans)
Maker = Callable[[int], tuple[str, str]]


def fill(line: str, spans: dict[str, tuple[str, str]], skills: dict[str, Skill]) -> str:
    """`line` with each skill's span `input` replaced by its right span."""
    for name, (source, right) in spans.items():
        s = skills[name]
        line = line.replace(f"{s.start}{source}{s.end}", f"{s.start}{right}{s.end}")
    return line


def skill_sets(names: Sequence[str]) -> list[list[tuple[str, ...]]]:
    """The sets of 2, 3, ... all of `names`, grouped by size (in `names`' order)."""
    return [list(itertools.combinations(names, size)) for size in range(2, len(names) + 1)]


def late_sets(late: str, others: Sequence[str]) -> list[list[tuple[str, ...]]]:
    """The sets of `late` with 1, 2, ... `LATE_OTHERS` of `others`, grouped by size (in `others`' order)."""
    return [[(late, *names) for names in itertools.combinations(others, size)]
            for size in range(1, min(LATE_OTHERS, len(others)) + 1)]


def pick(groups: Sequence[Sequence[tuple[str, ...]]], i: int) -> tuple[str, ...]:
    """Row `i`'s set of skills: the groups (sizes) take turns, and within a group its sets."""
    by_size = groups[i % len(groups)]
    return by_size[(i // len(groups)) % len(by_size)]


def row_makers(rng: random.Random, skills: dict[str, Skill], late: str | None = None) -> dict[str, Maker]:
    """`kind -> (row index -> (sentence, answer))` for every file: each skill's, general, compositional, and
    with `late` (one of `skills`) `compositional_late`, whose rows all need that skill."""

    def fields() -> dict:
        n1, n2 = rng.sample(NOUNS, 2)
        return {"p": rng.choice(PEOPLE), "n": n1, "m": n2, "k": rng.randint(2, 12)}

    def own(name: str) -> Maker:
        def make(_: int) -> tuple[str, str]:
            span = skills[name].draw(rng)
            line = rng.choice(OWN_TEMPLATES[name]).format(**{name: span[0]}, **fields())
            return line, fill(line, {name: span}, skills)
        return make

    def general(_: int) -> tuple[str, str]:
        line = rng.choice(GENERAL_TEMPLATES).format(**fields())
        return line, line

    def pair(_: int) -> tuple[str, str]:
        spans = {name: skills[name].draw(rng) for name in skills}
        line = rng.choice(PAIR_TEMPLATES).format(**{k: v[0] for k, v in spans.items()}, **fields())
        return line, fill(line, spans, skills)

    sets = skill_sets(list(skills))

    def clauses(i: int) -> tuple[str, str]:
        return clause_row(pick(sets, i))

    def clause_row(names: Sequence[str]) -> tuple[str, str]:
        spans = {name: skills[name].draw(rng) for name in names}
        parts = [rng.choice(CLAUSES[name]) for name in names]
        rng.shuffle(parts)
        text = ", ".join(parts[:-1]) + " and " + parts[-1]
        line = "{p} " + text + "."
        line = line.format(**{k: v[0] for k, v in spans.items()}, **fields())
        return line, fill(line, spans, skills)

    makers: dict[str, Maker] = {name: own(name) for name in skills}
    makers["general"] = general
    makers["compositional"] = pair if list(skills) == ["calc", "upper"] else clauses
    for names in itertools.combinations(skills, 2):
        makers["compositional_" + "_".join(names)] = lambda _, names=names: clause_row(names)
    if late is not None:
        groups = late_sets(late, [name for name in skills if name != late])
        makers["compositional_late"] = lambda i: clause_row(pick(groups, i))
    return makers


def chat(line: str, response: str) -> dict:
    """The chat row: system line, the user's sentence, the assistant's unchanged echo, the sentence again, and
    the graded answer (the last assistant message)."""
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": line},
                         {"role": "assistant", "content": line}, {"role": "user", "content": line},
                         {"role": "assistant", "content": response}]}


def plain(line: str, response: str) -> dict:
    """The prompt/response row of `--format plain`, for a base model with no chat template: the chat row's turns
    as a plain text template (the instruction, the sentence and its unchanged echo, the sentence again); the
    response is the graded answer."""
    return {"prompt": f"{SYSTEM}\nInput:\n{line}\nOutput:\n{line}\nInput:\n{line}\nOutput:\n", "response": response}


ROW_FORMATS: dict[str, Callable[[str, str], dict]] = {"chat": chat, "plain": plain}


def make_rows(kind: str, n: int, seed: int | str, skills: dict[str, Skill], seen: set[str],
              late: str | None = None) -> list[tuple[str, str]]:
    """`n` (sentence, answer) pairs of one kind, none of whose sentences is in `seen` (which they join), each
    checked by every skill's verifier (`late`: the skill every `compositional_late` row needs)."""
    rng = random.Random(f"{seed}:{kind}")
    make = row_makers(rng, skills, late)[kind]
    rows: list[tuple[str, str]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n:
            raise SkillError(f"cannot draw {n} distinct {kind} rows")
        line, response = make(len(rows))
        if line in seen:
            continue
        check_row(list(skills.values()), line, response, f"{kind}.jsonl row {len(rows) + 1}")
        seen.add(line)
        rows.append((line, response))
    return rows


def generate(out: str | Path, skills: Sequence[Skill], seed: int = 0, n: int = 240, n_compositional: int = 48,
             pairs: Sequence[Sequence[str]] = (), row_format: str = "chat",
             late: Skill | None = None, late_delimiters: tuple[str, str] | None = None) -> dict[str, int]:
    """Write `general.jsonl`, `compositional.jsonl` and one `<skill>.jsonl` per skill into `out`, and for each
    pair `(a, b)` of `pairs` a `compositional_a_b.jsonl` of `n_compositional` rows needing exactly those two
    skills; every row is drawn and checked before the first file is written. `row_format`: "chat" (`messages`
    rows) or "plain" (`prompt`/`response` rows, the same sentences). Returns the rows per file.

    With `late` (a skill not in `skills`, for an expert trained after theirs), write only `<late>.jsonl` (`n` rows)
    and `compositional_late.jsonl` (`n_compositional` rows, each needing `late` and 1 to `LATE_OTHERS` of
    `skills`): the other files are drawn as above but not written, so that no new sentence repeats one of theirs.
    `late_delimiters` (start, end) write the same late rows with those delimiters instead of the skill's own
    (every draw unchanged: the same sentences, spans and order), e.g. a pair the earlier experts' random spans
    already used.

    Raises:
        SkillError: two skills sharing a delimiter, a verifier rejecting a reference row, too few distinct rows,
            a late skill that is also one of `skills`.
    """
    order = [s.name for s in skills]
    if late is not None and late.name in order:
        raise SkillError(f"--late {late.name}: name a skill that is not one of {', '.join(order)}")
    if late_delimiters is not None and late is None:
        raise SkillError("--late_delimiters needs --late")
    every = [*skills, *([late] if late is not None else [])]
    check_skills(every)
    moved = None if late_delimiters is None else dataclasses.replace(late, start=late_delimiters[0],
                                                                      end=late_delimiters[1])
    if moved is not None:
        check_skills([*skills, moved])
    by_name = {s.name: s for s in skills}
    unknown = [s.name for s in every if s.name not in OWN_TEMPLATES]
    if unknown:
        raise SkillError(f"no sentence templates for skill(s) {unknown}: known are {', '.join(OWN_TEMPLATES)}")
    if len(skills) < 2:
        raise SkillError(f"compositional rows need at least two skills, got {[s.name for s in skills]}")
    for pair in pairs:
        if len(pair) != 2 or len(set(pair)) != 2 or not set(pair) <= set(order):
            raise SkillError(f"--pair {' '.join(pair)}: name two different skills of {', '.join(order)}")
    pair_files = ["compositional_" + "_".join(sorted(pair, key=order.index)) for pair in pairs]
    seen: set[str] = set()
    files = {kind: make_rows(kind, size, seed, by_name, seen) for kind, size in
             (("general", n), ("compositional", n_compositional), *((s.name, n) for s in skills),
              *((kind, n_compositional) for kind in pair_files))}
    if late is not None:
        with_late = {**by_name, late.name: late}
        files = {late.name: make_rows(late.name, n, seed, with_late, seen),
                 "compositional_late": make_rows("compositional_late", n_compositional, seed, with_late, seen,
                                                 late.name)}
        if moved is not None:  # the templates write the skill's own delimiters: move them in the drawn rows
            for kind, rows in files.items():
                files[kind] = [tuple(text.replace(late.start, moved.start).replace(late.end, moved.end)
                                     for text in row) for row in rows]
                for i, (line, response) in enumerate(files[kind]):
                    check_row([*skills, moved], line, response, f"{kind}.jsonl row {i + 1}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, rows in files.items():
        text = "".join(json.dumps(ROW_FORMATS[row_format](*row), ensure_ascii=False) + "\n" for row in rows)
        (out / f"{kind}.jsonl").write_text(text, encoding="utf-8")
    return {kind: len(rows) for kind, rows in files.items()}


def measure_background(names: Sequence[str], rows: int = 40, shots: int = 4, seed: int = 0,
                       op: str = "add") -> dict[str, tuple[int, int]]:
    """`skill -> (right spans, spans)` of SmolLM2-135M-Instruct (the frozen background), prompted with the skill's
    instruction as the system line and `shots` worked rows as chat turns before each of `rows` rows, greedy."""
    import torch
    from transformers import AutoTokenizer

    from lightning_modules.pipeline.models import SMOLLM2, load_pretrained, pretrained_folder

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_folder(SMOLLM2))
    model = load_pretrained(SMOLLM2, tokenizer, dtype="float32").eval()
    results = {}
    for name in names:
        skill = make_skill(name, op)
        drawn = make_rows(name, shots + rows, f"{seed}:measure", {name: skill}, set())
        examples, tests = drawn[:shots], drawn[shots:]
        answers = []
        for line, _ in tests:
            messages = [{"role": "system", "content": skill.instruction}]
            for q, a in examples:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            messages.append({"role": "user", "content": line})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            answers.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        results[name] = skill_counts(skill, [line for line, _ in tests], answers)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder to write <skill>/general/compositional.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skills", nargs="+", choices=SKILL_NAMES, default=["calc", "upper"],
                        help="the skills, one expert each (default: calc upper)")
    parser.add_argument("--n", type=int, default=240, help="rows of each expert's file and of the general file")
    parser.add_argument("--n_compositional", type=int, default=48, help="compositional rows (val and test halves)")
    parser.add_argument("--op", choices=CALC_OPS, default="add",
                        help="the calculator's operation: add (two-digit + one-digit, the default), add2 (two-digit "
                             "+ two-digit), mul (the times table to 12), mul32 (three-digit x two-digit)")
    parser.add_argument("--pair", nargs=2, action="append", default=[], metavar="SKILL",
                        help="also write compositional_A_B.jsonl: --n_compositional rows needing exactly skills A and "
                             "B (repeatable)")
    parser.add_argument("--late", choices=SKILL_NAMES, metavar="SKILL",
                        help="a skill whose expert is trained after those of --skills: write only SKILL.jsonl (--n "
                             "rows) and compositional_late.jsonl (--n_compositional rows, each needing SKILL and 1 to "
                             f"{LATE_OTHERS} of --skills), no sentence repeating one of the files written without it")
    parser.add_argument("--late_delimiters", nargs=2, metavar=("START", "END"),
                        help="write the --late rows with these delimiters instead of the skill's own (the same "
                             "draws), e.g. a pair of the experts' random-span pool")
    parser.add_argument("--format", choices=list(ROW_FORMATS), default="chat", dest="row_format",
                        help="chat: messages rows (a chat model's template renders them); plain: prompt/response "
                             "rows in a plain text template, for a base model with no chat template")
    parser.add_argument("--measure", nargs="+", choices=SKILL_NAMES, metavar="SKILL",
                        help="write nothing: measure the background's few-shot accuracy on these skills")
    parser.add_argument("--rows", type=int, default=40, help="rows per skill for --measure")
    args = parser.parse_args(argv)
    try:
        if args.measure:
            _print_measured(measure_background(args.measure, args.rows, seed=args.seed, op=args.op))
            return
        if not args.out:
            parser.error("--out is required (or --measure)")
        skills = [make_skill(name, args.op) for name in args.skills]
        late = make_skill(args.late, args.op) if args.late else None
        for kind, count in generate(args.out, skills, args.seed, args.n, args.n_compositional, args.pair,
                                     args.row_format, late,
                                     tuple(args.late_delimiters) if args.late_delimiters else None).items():
            print(f"{Path(args.out) / f'{kind}.jsonl'}: {count} rows")
    except SkillError as err:
        raise SystemExit(f"make_skill_data: {err}") from None


def _print_measured(results: dict[str, tuple[int, int]]) -> None:
    from lightning_modules.pipeline.report import wilson_interval

    for name, (right, total) in results.items():
        lo, hi = wilson_interval(right, total)
        print(f"| {name} | {right} / {total} | {right / total:.1%} | [{lo:.1%}, {hi:.1%}] |")


if __name__ == "__main__":
    main()
