"""Generate the rows of `configs/experiment/smollm2_skills.yaml`: two skill experts on SmolLM2-135M-Instruct.

    python scripts/make_skill_data.py --out configs/experiment/data/smollm2_skills --seed 0

writes (defaults `--n 240 --n_compositional 48 --op add`), byte for byte the same for the same arguments: every
random draw comes from a `random.Random` seeded with the seed and the file's name, and nothing else:

* `calc.jsonl`: the `calc` expert's rows: a one-line, GSM8K-like sentence with a calculator span whose result
  the answer fills in: `Tom sold <<47+8=>> cups.` becomes `Tom sold <<47+8=55>> cups.` The expert owns the
  interval after `<<` (operands, `=`, the result, `>>`) and must do exact arithmetic there. `--op`: `add`
  (two-digit + one-digit, the default), `add2` (two-digit + two-digit), `mul` (the times table to 12),
  `mul32` (three-digit x two-digit). Prompted with four worked examples, SmolLM2 gets 25 % of `add`, 7.5 % of
  `add2`, 35 % of `mul` and 0 % of three-digit sums right (40 rows each). In a pilot with longer sentences of
  this kind, a rank-16 LoRA (task loss on the whole answer) trained on 240 rows reached 83 % on `add` and 88 %
  on `mul` (24 held-out rows), and on 320 `add2` rows 50 % (16 rows); `add` is the default for that reason.
* `upper.jsonl`: the `upper` expert's rows: a sentence with one or two bracketed words the answer writes in
  capitals: `Then Ben said [good night].` becomes `Then Ben said [GOOD NIGHT].` (it owns the interval after
  `[`: the words and `]`).
* `general.jsonl`: sentences of the same kind with no span (nothing to compute): the background's evaluation
  rows, the experts' regularizer rows and the general-text perplexity check.
* `compositional.jsonl`: sentences with both spans, in either order: one answer needs both skills.

Every row is a chat (`messages`, rendered with SmolLM2's chat template): a short system line, the user's
sentence, the assistant echoing it unchanged, the user sending it again, and the graded assistant turn: the
sentence with its spans filled in. The echo turn is what lets the frozen 135M model write the text outside the
spans by itself: it repeats its own previous turn (spans left empty), where asked zero-shot to repeat a line it
mostly answers something else. So the background owns the text between the spans, each expert the inside of
its own spans. No sentence occurs twice across the four files.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

SYSTEM = "Repeat the message."
NOUNS = ("apple", "bag", "ball", "basket", "bell", "bike", "boat", "book", "bottle", "box", "brush", "bucket",
         "cake", "candle", "card", "chair", "coin", "cookie", "cup", "desk", "drum", "egg", "flag", "flower",
         "glass", "hat", "jar", "key", "kite", "lamp", "leaf", "letter", "map", "mug", "nail", "pen", "pencil",
         "pie", "plate", "ring", "rope", "shell", "shoe", "sock", "spoon", "stamp", "stone", "toy", "tray", "wheel")
PEOPLE = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Nora", "Jack", "Ella", "Omar",
          "Ruth", "Ivan", "Zoe")
WORDS = ("red", "blue", "green", "happy", "quiet", "bright", "cold", "warm", "fast", "slow", "good", "night",
         "morning", "hello", "thanks", "welcome", "stop", "go", "yes", "no", "home", "sun", "moon", "star",
         "river", "forest", "music", "dance", "dream", "light", "fire", "water", "gold", "silver", "king",
         "queen", "tiger", "lion", "eagle", "storm")
CALC_TEMPLATES = (
    "{p} sold <<{q}>> {n}s.",
    "We need <<{q}>> {n}s.",
    "{p} has <<{q}>> {n}s now.",
    "The box holds <<{q}>> {n}s.",
    "{p} counted <<{q}>> {n}s.",
    "There are <<{q}>> {n}s left.",
)
UPPER_TEMPLATES = (
    "{p} wrote [{s}] on it.",
    "Then {p} said [{s}].",
    "The sign read [{s}].",
    "{p} shouted [{s}].",
    "The {n} says [{s}].",
    "{p} painted [{s}] on a {n}.",
)
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
COMPOSITIONAL_TEMPLATES = (
    "{p} sold <<{q}>> {n}s and said [{s}].",
    "{p} wrote [{s}] on <<{q}>> {n}s.",
    "The sign read [{s}] by <<{q}>> {n}s.",
    "We need <<{q}>> {n}s that say [{s}].",
    "{p} shouted [{s}] and sold <<{q}>> {n}s.",
    "There are <<{q}>> {n}s marked [{s}].",
)


def calc_span(rng: random.Random, op: str) -> tuple[str, str]:
    """`("a+b=", "c")` for the `<<...>>` span: the operands the sentence shows, and the exact result."""
    a, b, sign = {
        "add": lambda: (rng.randint(10, 99), rng.randint(2, 9), "+"),       # two-digit plus one-digit
        "add2": lambda: (rng.randint(10, 99), rng.randint(10, 99), "+"),    # two-digit plus two-digit
        "mul": lambda: (rng.randint(2, 12), rng.randint(2, 12), "*"),       # the times table
        "mul32": lambda: (rng.randint(100, 999), rng.randint(10, 99), "*"),  # three-digit times two-digit
    }[op]()
    return f"{a}{sign}{b}=", str(a + b if sign == "+" else a * b)


def word_span(rng: random.Random) -> tuple[str, str]:
    """`("red kite", "RED KITE")`: one or two words, and the same in capitals."""
    words = " ".join(rng.sample(WORDS, rng.randint(1, 2)))
    return words, words.upper()


def chat(line: str, response: str) -> dict:
    """The chat row: system line, the user's sentence, the assistant's unchanged echo, the sentence again, and
    the graded answer (the last assistant message)."""
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": line},
                         {"role": "assistant", "content": line}, {"role": "user", "content": line},
                         {"role": "assistant", "content": response}]}


def make_rows(kind: str, n: int, seed: int, op: str, seen: set[str]) -> list[dict]:
    """`n` rows of one kind, none of whose sentences is in `seen` (which they join)."""
    rng = random.Random(f"{seed}:{kind}")

    def fields() -> dict:
        n1, n2 = rng.sample(NOUNS, 2)
        return {"p": rng.choice(PEOPLE), "n": n1, "m": n2, "k": rng.randint(2, 12)}

    def calc() -> tuple[str, str]:
        q, result = calc_span(rng, op)
        line = rng.choice(CALC_TEMPLATES).format(q=q, **fields())
        return line, line.replace(f"<<{q}>>", f"<<{q}{result}>>")

    def upper() -> tuple[str, str]:
        s, shout = word_span(rng)
        line = rng.choice(UPPER_TEMPLATES).format(s=s, **fields())
        return line, line.replace(f"[{s}]", f"[{shout}]")

    def general() -> tuple[str, str]:
        line = rng.choice(GENERAL_TEMPLATES).format(**fields())
        return line, line

    def compositional() -> tuple[str, str]:
        (q, result), (s, shout) = calc_span(rng, op), word_span(rng)
        line = rng.choice(COMPOSITIONAL_TEMPLATES).format(q=q, s=s, **fields())
        return line, line.replace(f"<<{q}>>", f"<<{q}{result}>>").replace(f"[{s}]", f"[{shout}]")

    makers: dict[str, Callable[[], tuple[str, str]]] = {"calc": calc, "upper": upper, "general": general, "compositional": compositional}
    rows, tries = [], 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n:
            raise SystemExit(f"cannot draw {n} distinct {kind} rows")
        line, response = makers[kind]()
        if line in seen:
            continue
        seen.add(line)
        rows.append(chat(line, response))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write calc/upper/general/compositional.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=240, help="rows of each expert's file and of the general file")
    parser.add_argument("--n_compositional", type=int, default=48, help="compositional rows (val and test halves)")
    parser.add_argument("--op", choices=("add", "add2", "mul", "mul32"), default="add",
                        help="the calculator's operation: add (two-digit + one-digit, the default), add2 (two-digit "
                             "+ two-digit), mul (the times table to 12), mul32 (three-digit x two-digit)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for kind, n in (("general", args.n), ("compositional", args.n_compositional), ("calc", args.n),
                    ("upper", args.n)):
        rows = make_rows(kind, n, args.seed, args.op, seen)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (out / f"{kind}.jsonl").write_text(text, encoding="utf-8")
        print(f"{out / f'{kind}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
