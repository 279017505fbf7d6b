"""Skills that live in natural intervals of a one-line response, each checked by a program.

A skill marks a span of a sentence with its own delimiters; the user's sentence holds the span's input, the
answer the span done right:

* `calc`      `<<...>>`  exact arithmetic:          `<<47+8=>>`       ->  `<<47+8=55>>`
* `upper`     `[...]`    the words in capitals:     `[good night]`    ->  `[GOOD NIGHT]`
* `reverse`   `«...»`    the word spelled backwards: `«kite»`          ->  `«etik»`
* `translate` `{...}`    English to French from `FRENCH`: `{cat}`     ->  `{chat}`
* `unit`      `⟦...⟧`    the quantity in the smaller unit: `⟦5 km=⟧` ->  `⟦5 km=5000 m⟧` (km, kg, L; x 1000)

Each `Skill` carries a `draw` (a seeded random input and its right span) and a `verify` (a pure function:
given the span's input and a model's span, is it right?). `check_row` checks a reference row with the
verifiers; `skill_counts` scores a model's answers span by span. Pure Python: no model, no tokenizer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WORDS = ("red", "blue", "green", "happy", "quiet", "bright", "cold", "warm", "fast", "slow", "good", "night",
         "morning", "hello", "thanks", "welcome", "stop", "go", "yes", "no", "home", "sun", "moon", "star",
         "river", "forest", "music", "dance", "dream", "light", "fire", "water", "gold", "silver", "king",
         "queen", "tiger", "lion", "eagle", "storm")
REVERSE_WORDS = ("apple", "basket", "bottle", "bright", "bucket", "candle", "cookie", "dance", "dream", "drum",
                 "eagle", "flower", "forest", "glass", "green", "happy", "hello", "kite", "lamp", "leaf",
                 "letter", "light", "lion", "music", "pencil", "plate", "queen", "quiet", "river", "shell",
                 "silver", "stamp", "stone", "storm", "thanks", "tiger", "water", "wheel", "winter", "yellow")
FRENCH = {"cat": "chat", "dog": "chien", "house": "maison", "bread": "pain", "water": "eau", "apple": "pomme",
          "book": "livre", "tree": "arbre", "sun": "soleil", "moon": "lune", "flower": "fleur", "bird": "oiseau",
          "fish": "poisson", "horse": "cheval", "cheese": "fromage", "milk": "lait", "door": "porte",
          "chair": "chaise", "car": "voiture", "road": "route", "city": "ville", "sea": "mer",
          "mountain": "montagne", "garden": "jardin", "king": "roi", "queen": "reine", "friend": "ami",
          "child": "enfant", "night": "nuit", "day": "jour", "rain": "pluie", "snow": "neige", "fire": "feu",
          "butter": "beurre", "hat": "chapeau", "red": "rouge", "green": "vert", "black": "noir",
          "white": "blanc", "small": "petit"}
CALC_OPS = ("add", "add2", "mul", "mul32")
_CALC = re.compile(r"(\d+)([+*])(\d+)=")
UNITS = {"km": "m", "kg": "g", "L": "mL"}  # each unit and the unit a thousandth of it
_UNIT = re.compile(r"(\d+) (km|kg|L)=")


class SkillError(ValueError):
    """A skill set or a reference row that cannot be used (one line naming the skill or the row)."""


@dataclass(frozen=True)
class Skill:
    """One skill: its delimiters, how to draw an input with its right span, and how to check a span.

    Attributes:
        name: the expert's name.
        start, end: the span's delimiters (literal strings).
        draw: `rng -> (input, right span)`, the text between the delimiters in the question and in the answer.
        verify: `(input, span) -> bool`: whether `span` is a right answer to `input`.
        instruction: one line saying what the span asks (the system line of a few-shot prompt).
    """

    name: str
    start: str
    end: str
    draw: Callable[[random.Random], tuple[str, str]]
    verify: Callable[[str, str], bool]
    instruction: str

    def spans(self, text: str) -> list[str]:
        """The text between each pair of this skill's delimiters in `text`, in order (an unclosed span is
        not one)."""
        return re.findall(re.escape(self.start) + "(.*?)" + re.escape(self.end), text, flags=re.S)


# --- the verifiers ---------------------------------------------------------------------------------
def verify_calc(source: str, span: str) -> bool:
    """`47+8=` answered by `47+8=55`: the operands copied, then the exact result."""
    m = _CALC.fullmatch(source)
    if m is None:
        return False
    a, sign, b = int(m[1]), m[2], int(m[3])
    return span == f"{source}{a + b if sign == '+' else a * b}"


def verify_upper(source: str, span: str) -> bool:
    """`good night` answered by `GOOD NIGHT`."""
    return source != source.upper() and span == source.upper()


def verify_reverse(source: str, span: str) -> bool:
    """`kite` answered by `etik`."""
    return source != source[::-1] and span == source[::-1]


def verify_translate(source: str, span: str) -> bool:
    """`cat` answered by `chat` (the word's entry in `FRENCH`)."""
    return source in FRENCH and span == FRENCH[source]


def verify_unit(source: str, span: str) -> bool:
    """`5 km=` answered by `5 km=5000 m`: the quantity copied, then the same in the smaller unit."""
    m = _UNIT.fullmatch(source)
    return m is not None and span == f"{source}{int(m[1]) * 1000} {UNITS[m[2]]}"


# --- the draws -------------------------------------------------------------------------------------
def calc_span(rng: random.Random, op: str) -> tuple[str, str]:
    """`("a+b=", "c")`: the operands the sentence shows, and the exact result. `op`: `add` (two-digit +
    one-digit), `add2` (two-digit + two-digit), `mul` (the times table to 12), `mul32` (three-digit x two-digit)."""
    if op not in CALC_OPS:
        raise SkillError(f"calc op {op!r} is not one of {', '.join(CALC_OPS)}")
    a, b, sign = {
        "add": lambda: (rng.randint(10, 99), rng.randint(2, 9), "+"),
        "add2": lambda: (rng.randint(10, 99), rng.randint(10, 99), "+"),
        "mul": lambda: (rng.randint(2, 12), rng.randint(2, 12), "*"),
        "mul32": lambda: (rng.randint(100, 999), rng.randint(10, 99), "*"),
    }[op]()
    return f"{a}{sign}{b}=", str(a + b if sign == "+" else a * b)


def word_span(rng: random.Random) -> tuple[str, str]:
    """`("red kite", "RED KITE")`: one or two words, and the same in capitals."""
    words = " ".join(rng.sample(WORDS, rng.randint(1, 2)))
    return words, words.upper()


def unit_span(rng: random.Random) -> tuple[str, str]:
    """`("5 km=", "5 km=5000 m")`: 2 to 99 km, kg or L, and the same quantity in m, g or mL after the = sign."""
    amount, unit = rng.randint(2, 99), rng.choice(tuple(UNITS))
    source = f"{amount} {unit}="
    return source, f"{source}{amount * 1000} {UNITS[unit]}"


def make_skill(name: str, op: str = "add") -> Skill:
    """The skill called `name` (`SKILL_NAMES`); `op` is the calculator's operation (see `calc_span`)."""
    if name == "calc":
        def draw_calc(rng: random.Random) -> tuple[str, str]:
            q, result = calc_span(rng, op)
            return q, q + result
        return Skill("calc", "<<", ">>", draw_calc, verify_calc,
                     "Repeat the message; inside << >> write the exact result after the = sign.")
    if name == "upper":
        return Skill("upper", "[", "]", word_span, verify_upper,
                     "Repeat the message; write the words inside [ ] in capital letters.")
    if name == "reverse":
        def draw_reverse(rng: random.Random) -> tuple[str, str]:
            word = rng.choice(REVERSE_WORDS)
            return word, word[::-1]
        return Skill("reverse", "«", "»", draw_reverse, verify_reverse,
                     "Repeat the message; spell the word inside « » backwards, letter by letter.")
    if name == "translate":
        def draw_translate(rng: random.Random) -> tuple[str, str]:
            word = rng.choice(sorted(FRENCH))
            return word, FRENCH[word]
        return Skill("translate", "{", "}", draw_translate, verify_translate,
                     "Repeat the message; translate the English word inside { } into French.")
    if name == "unit":
        return Skill("unit", "⟦", "⟧", unit_span, verify_unit,
                     "Repeat the message; inside ⟦ ⟧ write the quantity in the smaller unit after the = sign.")
    raise SkillError(f"unknown skill {name!r}: choose from {', '.join(SKILL_NAMES)}")


SKILL_NAMES = ("calc", "upper", "reverse", "translate", "unit")


# --- checks and scores -----------------------------------------------------------------------------
def check_skills(skills: Sequence[Skill]) -> None:
    """Each skill's delimiters are its own: no two skills share a name or a delimiter, and no delimiter of one
    occurs inside a delimiter of another (`<` and `<<` would claim the same text)."""
    for i, a in enumerate(skills):
        for b in skills[i + 1:]:
            if a.name == b.name:
                raise SkillError(f"skill {a.name!r} is given twice")
            for x in (a.start, a.end):
                for y in (b.start, b.end):
                    if x in y or y in x:
                        raise SkillError(f"skills {a.name!r} and {b.name!r} share the delimiter {min(x, y, key=len)!r}: "
                                         "each expert needs delimiters of its own")


def check_row(skills: Sequence[Skill], question: str, answer: str, where: str) -> None:
    """A reference row is right: for every skill, the answer has as many spans as the question and each
    verifies against the question's span at the same place (`where` names the row in the error)."""
    for skill in skills:
        sources, spans = skill.spans(question), skill.spans(answer)
        if len(sources) != len(spans):
            raise SkillError(f"{where}: skill {skill.name!r}: the question has {len(sources)} span(s), the answer "
                             f"{len(spans)}")
        for source, span in zip(sources, spans, strict=True):
            if not skill.verify(source, span):
                raise SkillError(f"{where}: skill {skill.name!r}'s verifier rejects its reference span "
                                 f"{skill.start}{span}{skill.end} for {skill.start}{source}{skill.end}")


def skill_counts(skill: Skill, questions: Sequence[str], answers: Sequence[str]) -> tuple[int, int]:
    """`(right, total)` over the skill's spans in `questions`: the i-th span of a question is right iff the
    answer has an i-th span that the verifier accepts."""
    right = total = 0
    for question, answer in zip(questions, answers, strict=True):
        sources, spans = skill.spans(question), skill.spans(answer)
        total += len(sources)
        right += sum(i < len(spans) and skill.verify(s, spans[i]) for i, s in enumerate(sources))
    return right, total
