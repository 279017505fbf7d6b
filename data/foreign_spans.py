"""Random foreign spans: text like another skill's interval, drawn without knowing any other skill.

An expert trained alone never sees the spans other experts write, yet in a composition its prefix holds them
(`Tom sold <<47+8=55>> cups and said [GOOD NIGHT].`). Its regularizer rows can hold stand-ins: spans whose
delimiters come from a fixed pool of bracket-like pairs (minus any pair that shares a character with the
expert's own delimiters, so its own interval never opens or closes by accident) and whose contents are random
letters, digits or small sums, or, given a word list (the general rows' own words), real words in lower or upper
case. The pool and the draws are the same whichever experts exist, so rows built with
them carry no knowledge of any other expert (`expert.reg_data: own+foreign`, `data.tasks.text`).

A span goes in at a word boundary of the response outside the expert's own intervals; where the text before
that boundary also occurs in the prompt (the chat rows echo their sentence), the span goes in there too, with
the contents either kept or redrawn in the response (a foreign skill that copies or rewrites its span). With
`rewrite`, half of the redrawn contents are instead a rewrite of the prompt's by one of a fixed family of string
transforms (`REWRITES`): the response's span then differs from the prompt's copy the way a real skill's output
differs from its input (related to it, not independent of it), and the family is the same whatever experts exist.

A composition's delimiters need not be ASCII: `⟦` is three bytes to a byte-level tokenizer, and an expert whose
spans only ever used a few multi-byte brackets may raise a sibling byte (`⟧`, `⟒`) where the background is sure of
the next one. `UNICODE_BRACKETS` widens the pool to every opening/closing pair Unicode places side by side
(`task.foreign_pool: brackets+unicode`), again the same whatever experts exist.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from compose.intervals import IntervalSpec, interval_char_spans

# Bracket-like delimiter pairs found in text and markup; fixed, whatever experts are in play.
DELIMITER_POOL: tuple[tuple[str, str], ...] = (
    ("(", ")"), ("[", "]"), ("{", "}"), ("<", ">"), ("<<", ">>"), ("[[", "]]"), ("{{", "}}"), ("((", "))"),
    ("«", "»"), ("‹", "›"), ("⟨", "⟩"), ("【", "】"), ("「", "」"), ("<|", "|>"), ("|", "|"), ("*", "*"),
    ("**", "**"), ("_", "_"), ("`", "`"), ("~", "~"), ("^", "^"), ("#", "#"), ("%", "%"), ("$", "$"),
    ('"', '"'), ("'", "'"), ("/", "/"), ("\\", "\\"), ("=", "="), ("@", "@"),
)
# Every non-ASCII opening punctuation character (Unicode category Ps) whose next code point closes it (Pe), as of
# Unicode 14: math and ornamental brackets, CJK and full-width brackets, vertical forms, a few scripts' own. Written
# out rather than derived from `unicodedata`, so the pool does not move with the Python version.
UNICODE_BRACKETS: tuple[tuple[str, str], ...] = tuple(tuple(pair) for pair in (
    "༺༻ ༼༽ ᚛᚜ ⁅⁆ ⁽⁾ ₍₎ ⌈⌉ ⌊⌋ 〈〉 ❨❩ ❪❫ ❬❭ ❮❯ ❰❱ ❲❳ ❴❵ ⟅⟆ ⟦⟧ ⟨⟩ ⟪⟫ ⟬⟭ ⟮⟯ ⦃⦄ ⦅⦆ ⦇⦈ ⦉⦊ ⦋⦌ ⦍⦎ ⦏⦐ ⦑⦒ ⦓⦔ ⦕⦖ "
    "⦗⦘ ⧘⧙ ⧚⧛ ⧼⧽ ⸢⸣ ⸤⸥ ⸦⸧ ⸨⸩ ⹕⹖ ⹗⹘ ⹙⹚ ⹛⹜ 〈〉 《》 「」 『』 【】 〔〕 〖〗 〘〙 〚〛 〝〞 ︗︘ ︵︶ ︷︸ ︹︺ ︻︼ ︽︾ "
    "︿﹀ ﹁﹂ ﹃﹄ ﹇﹈ ﹙﹚ ﹛﹜ ﹝﹞ （） ｟｠ ｢｣").split())
FOREIGN_POOLS = ("brackets", "brackets+unicode")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def delimiter_pool(own: IntervalSpec, pairs: Sequence[tuple[str, str]] = DELIMITER_POOL,
                   exclude: str = "") -> list[tuple[str, str]]:
    """The pairs of `pairs` that share no character with `own`'s delimiters (for a regex spec: that its start
    and end patterns match nowhere in them) nor with `exclude`."""
    pairs = [(a, b) for a, b in pairs if not (set(a) | set(b)) & set(exclude)]
    if own.regex:
        import re

        return [(a, b) for a, b in pairs if not any(re.search(p, a + " " + b) for p in (own.start, own.end))]
    used = set(own.start) | set(own.end)
    return [(a, b) for a, b in pairs if not (set(a) | set(b)) & used]


def expert_pool(own: IntervalSpec, kind: str = "brackets", exclude: str = "") -> list[tuple[str, str]]:
    """The delimiter pairs an expert's foreign spans draw from (`task.foreign_pool`): `brackets`, the pairs of
    `DELIMITER_POOL` free of `own`; `brackets+unicode`, those and the free pairs of `UNICODE_BRACKETS`, each half
    drawn as often as the other (a pair listed once per pair of the other half), so the common ASCII brackets keep
    their share. `exclude`: characters no pair may hold (a delimiter kept out of every expert's rows, to check
    that composition does not rest on the pool holding it)."""
    if kind not in FOREIGN_POOLS:
        raise ValueError(f"unknown foreign span pool {kind!r}; choose one of {', '.join(FOREIGN_POOLS)}")
    ascii_pairs = delimiter_pool(own, DELIMITER_POOL, exclude)
    if kind == "brackets":
        return ascii_pairs
    wide = [pair for pair in delimiter_pool(own, UNICODE_BRACKETS, exclude) if pair not in ascii_pairs]
    return [p for p in ascii_pairs for _ in wide] + [p for p in wide for _ in ascii_pairs] or ascii_pairs + wide


def random_content(rng: random.Random, words: Sequence[str] = ()) -> str:
    """One to three random words: lowercase or uppercase letters, digits, or a small sum. With `words`, each
    word of letters is, half the time, one of `words` instead (real words tokenize as text does, random letters
    do not)."""
    kind = rng.randrange(4)
    if kind == 3:
        return f"{rng.randrange(100)}{rng.choice('+-*/=')}{rng.randrange(100)}"
    drawn = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 7)
        if kind == 2:
            word = "".join(rng.choice("0123456789") for _ in range(n))
        elif words and rng.random() < 0.5:
            word = rng.choice(words)
        else:
            word = "".join(rng.choice(_LETTERS) for _ in range(n))
        drawn.append(word.upper() if kind == 1 else word)
    return " ".join(drawn)


def _shift(word: str) -> str:
    """Each letter one on in the alphabet (case kept, z to a), each digit one up (9 to 0)."""
    out = []
    for ch in word:
        if ch.isdigit():
            out.append(str((int(ch) + 1) % 10))
        elif ch.lower() in _LETTERS:
            nxt = _LETTERS[(_LETTERS.index(ch.lower()) + 1) % 26]
            out.append(nxt.upper() if ch.isupper() else nxt)
        else:
            out.append(ch)
    return "".join(out)


def _drop_vowels(word: str) -> str:
    """The word without its vowels after the first character."""
    return word[:1] + "".join(ch for ch in word[1:] if ch.lower() not in "aeiou")


# Generic rewrites of a span's words (`rewrite_content`); fixed, whatever experts are in play, and none of them a
# skill of the shipped suites (no reversal, case change, translation or arithmetic).
REWRITES = (_shift, _drop_vowels, lambda w: "".join(sorted(w)), lambda w: "".join(ch * 2 for ch in w))


def rewrite_content(content: str, rng: random.Random) -> str:
    """`content` with every word rewritten by one transform of `REWRITES`, drawn by `rng`."""
    transform = rng.choice(REWRITES)
    return " ".join(transform(word) for word in content.split(" "))


def _boundaries(text: str, own: IntervalSpec | None) -> list[int]:
    """Indices of the spaces of `text` that lie outside every interval of `own` (delimiters included; every space
    when `own` is None)."""
    if own is None:
        return [i for i, ch in enumerate(text) if ch == " "]
    spans = interval_char_spans(text, own)
    starts = [a - start_delimiter_length(text, a, own) for a, _ in spans]
    return [i for i, ch in enumerate(text) if ch == " "
            and not any(s <= i < b for s, (_, b) in zip(starts, spans, strict=True))]


def start_delimiter_length(text: str, a: int, own: IntervalSpec) -> int:
    """Characters of the start delimiter that ends at `a` (its literal length; a regex start: back to the
    previous space)."""
    if not own.regex:
        return len(own.start)
    space = text.rfind(" ", 0, a)
    return a - (space + 1)


def _shifted(spans: list[tuple[int, int]], at: int, by: int) -> list[tuple[int, int]]:
    return [(a + by * (a > at), b + by * (b > at)) for a, b in spans]


def insert_foreign_spans(prompt: str, response: str, own: IntervalSpec | None, rng: random.Random,
                         n_spans: int = 1, pool: Sequence[tuple[str, str]] | None = None,
                         words: Sequence[str] = (), rewrite: bool = False) -> tuple[str, str, list[tuple[int, int]]]:
    """`(prompt, response, spans)` with up to `n_spans` random foreign spans inserted (fewer when the response has
    fewer word boundaries outside `own`'s intervals); `pool` defaults to `delimiter_pool(own)` (the whole
    `DELIMITER_POOL` when `own` is None: rows for the background, which owns no interval). `spans`: for each
    span, sorted, `(start, end)` in the new response: the index of its start delimiter's first character and of the
    first character after its end delimiter (where the text goes on once the foreign span has closed). `words`: a
    word list the contents may draw from (`random_content`). `rewrite`: half the contents not kept in the response
    are a rewrite of the prompt's (`rewrite_content`) instead of a fresh draw."""
    pairs = list(pool) if pool is not None else list(DELIMITER_POOL) if own is None else delimiter_pool(own)
    if not pairs:
        raise ValueError("no delimiter pair to draw from: the pool is empty" if own is None else
                         f"no delimiter pair of the pool is free of the expert's own ({own.start!r}, {own.end!r})")
    spans: list[tuple[int, int]] = []
    for _ in range(n_spans):
        spaces = _boundaries(response, own)
        if not spaces:
            break
        at = rng.choice(spaces)
        start, end = rng.choice(pairs)
        content = random_content(rng, words)
        if rng.random() < 0.5:
            written = content
        elif rewrite and rng.random() < 0.5:
            written = rewrite_content(content, rng)
        else:
            written = random_content(rng, words)
        before = response[:at]
        new_response = f"{before} {start}{written}{end}{response[at:]}"
        if own is not None and interval_char_spans(new_response, own) != _shifted(
                interval_char_spans(response, own), at, len(new_response) - len(response)):
            continue  # the span would have touched the expert's own intervals (a regex delimiter matched it)
        if before and before in prompt:  # the echoed sentence in the prompt gets the span where it stands
            prompt = prompt.replace(before + " ", f"{before} {start}{content}{end} ")
        added = len(new_response) - len(response)
        spans = sorted([(a + added * (a > at), b + added * (b > at)) for a, b in spans] + [(at + 1, at + added)])
        response = new_response
    return prompt, response, spans
