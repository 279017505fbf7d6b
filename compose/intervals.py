"""Skill intervals: where an expert acts, as masks for training and as stopping-time detectors for decoding.

An expert's interval is given by an :class:`IntervalSpec`, a start and an end delimiter (literal strings,
or Python regular expressions over the decoded text). Everything derives from ONE character-level
definition, implemented by :class:`IntervalTracker`, which reads text character by character:

* The interval is CLOSED at the beginning. It OPENS once a start delimiter has been completely read, and
  CLOSES once an end delimiter has been completely read (after it opened). So the start delimiter's
  characters are outside the interval (the background writes them) and the end delimiter's characters
  are inside it (the expert decides when to close).
* While open, a start delimiter is plain text; while closed, an end delimiter is plain text (but
  :func:`check_balanced` rejects such a row for training).
* A delimiter only counts if it begins after the last state change: delimiters never overlap the one
  before them (with start ``<<`` and end ``<>``, ``<<>`` opens and stays open).
* Literal delimiter: "completely read" = the text read so far ends with it. Regex delimiter: the text
  read since the last state change, at most the last ``max_delimiter_chars`` (default 64) characters of
  it, has a non-empty match of the pattern that ends exactly at the current position
  (``re.search(f"(?:{pattern})\\Z", window)``). Anchors and lookbehinds therefore see that window only.

Token masks (training) and detectors (decoding) are derived from it and agree exactly:

* :func:`token_interval_mask`: token ``j`` of a response is in the expert's mask iff the interval is
  open before its first character, ``open_states(text)[offsets[j][0]]``. Equivalently, the target
  position predicting token ``j`` is in the expert's mask iff the prefix before that token has the
  interval open. A token that straddles the start boundary (begins before the start delimiter is
  complete) belongs to the background; one that straddles the end boundary (begins inside) belongs to
  the expert: the start delimiter is excluded, the end delimiter included. Whether a position is in the
  mask is decidable from the prefix alone: the interval bounds are stopping times (docs/method.md, when the rule is exact).
* :class:`StoppingTimeDetector`: from generated token ids alone, incrementally, whether the interval is
  open for the NEXT token. Fed a response's tokens one by one, its ``is_open()`` before each token equals
  :func:`token_interval_mask` of that response.

Assumptions of that agreement: the tokenizer round-trips the text (``decode(encode(text)) == text``, no
normalizer or added prefix space), its offsets are untrimmed character spans of the original text (e.g.
``ByteLevel(trim_offsets=False)``; checked: offsets that leave characters uncovered raise), and the text
has no U+FFFD character (the detector holds a trailing "\\ufffd" back as a possibly incomplete UTF-8
sequence until the next token, or ``MAX_PENDING_TOKENS`` tokens). Special tokens (EOS, pad, ...) are not
text: the detector decodes with ``skip_special_tokens=True`` and :func:`token_interval_mask` skips the
characters of tokens flagged in ``special_tokens_mask``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MAX_DELIMITER_CHARS = 64
MAX_PENDING_TOKENS = 8
_SPEC_KEYS = ("start", "end", "regex", "max_delimiter_chars")
_EMPTY_PROBES = ("", "a", "A", "0", " ", "\n", "a b\n", "[]<>{}()", "```")


@dataclass(frozen=True)
class IntervalSpec:
    """Start and end delimiters of a skill interval (literal strings, or regexes if ``regex``).

    Raises:
        ValueError: empty delimiter, a regex that does not compile or can match the empty string, or a
            non-positive ``max_delimiter_chars``.
    """

    start: str
    end: str
    regex: bool = False
    max_delimiter_chars: int = MAX_DELIMITER_CHARS

    def __post_init__(self) -> None:
        for key in ("start", "end"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"interval spec: {key!r} must be a non-empty string, got {value!r}")
        if not isinstance(self.regex, bool):
            raise ValueError(f"interval spec: 'regex' must be true or false, got {self.regex!r}")
        w = self.max_delimiter_chars
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"interval spec: 'max_delimiter_chars' must be a positive integer, got {w!r}")
        if self.regex:
            for key in ("start", "end"):
                _check_regex(key, getattr(self, key))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IntervalSpec:
        """From ``{"start": .., "end": .., "regex": bool}`` (a dict or an OmegaConf DictConfig)."""
        if isinstance(d, IntervalSpec):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"interval spec must be a mapping with keys start, end[, regex], got {d!r}")
        unknown = sorted(str(k) for k in d if k not in _SPEC_KEYS)
        if unknown:
            raise ValueError(f"interval spec: unknown key(s) {unknown} (allowed: {', '.join(_SPEC_KEYS)})")
        for key in ("start", "end"):
            if d.get(key) in (None, ""):
                raise ValueError(f"interval spec: {key!r} is missing or empty")
        return cls(**{k: d[k] for k in _SPEC_KEYS if k in d})

    def to_dict(self) -> dict[str, Any]:
        """The plain dict (``max_delimiter_chars`` only when not the default); ``from_dict`` inverts it."""
        d: dict[str, Any] = {"start": self.start, "end": self.end, "regex": self.regex}
        if self.max_delimiter_chars != MAX_DELIMITER_CHARS:
            d["max_delimiter_chars"] = self.max_delimiter_chars
        return d


def _check_regex(key: str, pattern: str) -> None:
    try:
        compiled = re.compile(pattern)
        re.compile(f"(?:{pattern})\\Z")
    except re.error as err:
        raise ValueError(f"interval spec: {key!r} regex {pattern!r} does not compile: {err}") from err
    for probe in _EMPTY_PROBES:
        if any(m.end() == m.start() for m in compiled.finditer(probe)):
            raise ValueError(f"interval spec: {key!r} regex {pattern!r} can match the empty string")


class _Delimiter:
    """Finds a non-empty delimiter occurrence ending at the end of a buffer."""

    def __init__(self, pattern: str, regex: bool) -> None:
        self.literal = None if regex else pattern
        self.compiled = re.compile(f"(?:{pattern})\\Z") if regex else None

    def match_start(self, buf: str) -> int | None:
        """Index in ``buf`` where the occurrence ending at ``len(buf)`` begins, or None."""
        if self.literal is not None:
            return len(buf) - len(self.literal) if buf.endswith(self.literal) else None
        m = self.compiled.search(buf)
        return m.start() if m is not None and m.end() > m.start() else None


class IntervalTracker:
    """Reads text incrementally and says whether the interval is open (module docstring semantics).

    Attributes:
        pos: characters read so far.
        last_change: ``pos`` at the latest state change (0 if none).
        delimiter_begin: char offset where the delimiter that caused the latest change began (or None).
    """

    def __init__(self, spec: IntervalSpec | Mapping[str, Any]) -> None:
        self.spec = IntervalSpec.from_dict(spec)
        self._start = _Delimiter(self.spec.start, self.spec.regex)
        self._end = _Delimiter(self.spec.end, self.spec.regex)
        literal_window = max(len(self.spec.start), len(self.spec.end))
        self._window = self.spec.max_delimiter_chars if self.spec.regex else literal_window
        self._buf = ""  # text since the last state change, at most the last `_window` characters
        self._open = False
        self.pos = 0
        self.last_change = 0
        self.delimiter_begin: int | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def feed(self, chars: str) -> None:
        """Read ``chars``; costs ``O(len(chars) · window)``."""
        for ch in chars:
            self._step(ch)

    def _step(self, ch: str) -> None:
        self.pos += 1
        buf = self._buf + ch
        if len(buf) > self._window:
            buf = buf[-self._window :]
        begin = (self._end if self._open else self._start).match_start(buf)
        if begin is None:
            self._buf = buf
            return
        self.delimiter_begin = self.pos - len(buf) + begin
        self._open, self._buf, self.last_change = not self._open, "", self.pos


# ---------------------------------------------------------------------- character level


def open_states(text: str, spec: IntervalSpec | Mapping[str, Any]) -> list[bool]:
    """State after reading ``text[:p]`` for every ``p`` (length ``len(text) + 1``, one tracker pass)."""
    tracker = IntervalTracker(spec)
    states = [False]
    for ch in text:
        tracker._step(ch)
        states.append(tracker.is_open)
    return states


def _transitions(text: str, spec: IntervalSpec) -> list[tuple[bool, int, int]]:
    """``(opened, delimiter_begin, pos)`` for every state change while reading ``text``."""
    tracker, events = IntervalTracker(spec), []
    for ch in text:
        was = tracker.is_open
        tracker._step(ch)
        if tracker.is_open != was:
            events.append((tracker.is_open, tracker.delimiter_begin, tracker.pos))
    return events


def interval_char_spans(text: str, spec: IntervalSpec | Mapping[str, Any]) -> list[tuple[int, int]]:
    """``(a, b)`` per interval: ``text[a:b]`` is inside (content plus end delimiter); ``b = len(text)``
    for an interval still open at the end."""
    spec = IntervalSpec.from_dict(spec)
    spans, opened_at = [], None
    for opened, _, pos in _transitions(text, spec):
        if opened:
            opened_at = pos
        else:
            spans.append((opened_at, pos))
            opened_at = None
    if opened_at is not None:
        spans.append((opened_at, len(text)))
    return spans


def check_balanced(text: str, spec: IntervalSpec | Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``text`` ends with the interval open, or an end delimiter occurs while it is
    closed (outside any start delimiter: with start ```` ```\\w*\\n ```` and end ```` ``` ````, a fence
    that opens is not a stray end)."""
    spec = IntervalSpec.from_dict(spec)
    events, closed_from = _transitions(text, spec), 0
    for opened, begin, pos in events:
        if opened:
            _raise_stray(spec, text, closed_from, begin)
        else:
            closed_from = pos
    if events and events[-1][0]:
        raise ValueError(f"text ends with the interval open (start delimiter {spec.start!r} at char {events[-1][1]})")
    _raise_stray(spec, text, closed_from, len(text))


def _raise_stray(spec: IntervalSpec, text: str, a: int, b: int) -> None:
    stray = _find(spec, text[a:b])
    if stray is not None:
        raise ValueError(f"end delimiter {spec.end!r} at char {a + stray} while the interval is closed")


def _find(spec: IntervalSpec, segment: str) -> int | None:
    """Offset of the first end delimiter inside ``segment`` (None if none)."""
    if not spec.regex:
        i = segment.find(spec.end)
        return None if i < 0 else i
    m = next((m for m in re.finditer(spec.end, segment) if m.end() > m.start()), None)
    return None if m is None else m.start()


# ---------------------------------------------------------------------- token level


def token_interval_mask(
    text: str,
    offsets: Sequence[Sequence[int]],
    spec: IntervalSpec | Mapping[str, Any],
    special_tokens_mask: Sequence[int] | None = None,
) -> list[int]:
    """1 for each token whose prefix has the interval open: ``open_states[offsets[j][0]]``.

    Args:
        text: the response text.
        offsets: ``(start_char, end_char)`` per token of ``text`` (a fast tokenizer's
            ``return_offsets_mapping=True``, untrimmed); an empty span uses its start.
        spec: the interval.
        special_tokens_mask: optional 1 per special token, e.g. ``[i in tokenizer.all_special_ids for i
            in ids]`` (HF's ``return_special_tokens_mask`` does not flag special tokens written in the
            text); their characters are not read, as the detector decodes with ``skip_special_tokens``.

    Returns:
        one int per token (same length as ``offsets``).

    Raises:
        ValueError: offsets outside the text, or that leave characters uncovered (trimmed offsets).
    """
    spans = [(int(s), int(e)) for s, e in offsets]
    special = [0] * len(spans) if special_tokens_mask is None else [int(x) for x in special_tokens_mask]
    if len(special) != len(spans):
        raise ValueError(f"special_tokens_mask has {len(special)} entries for {len(spans)} tokens")
    _check_offsets(text, spans)
    skip = bytearray(len(text))
    for (s, e), sp in zip(spans, special, strict=True):
        if sp:
            skip[s:e] = b"\x01" * (e - s)
    tracker, states = IntervalTracker(spec), [False]
    for ch, sk in zip(text, skip, strict=True):
        if not sk:
            tracker._step(ch)
        states.append(tracker.is_open)
    return [int(states[s]) for s, _ in spans]


def _check_offsets(text: str, spans: list[tuple[int, int]]) -> None:
    covered = 0
    for j, (s, e) in enumerate(spans):
        if not 0 <= s <= e <= len(text):
            raise ValueError(f"token {j} has offsets ({s}, {e}) outside the text of {len(text)} chars")
        if s > covered and e > s:
            raise ValueError(
                f"offsets leave text[{covered}:{s}]={text[covered:s]!r} uncovered before token {j}; "
                "they must be untrimmed character spans (e.g. ByteLevel trim_offsets=False)"
            )
        covered = max(covered, e)
    if covered < len(text) and spans:
        raise ValueError(f"offsets leave text[{covered}:]={text[covered:]!r} uncovered")


def token_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> text`` without special tokens and without clean-up of spaces (a fast tokenizer's
    backend directly, a ``tokenizers.Tokenizer``, or a slow tokenizer's ``decode``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def byte_piece_delimiters(spec: IntervalSpec | Mapping[str, Any], tokenizer) -> list[str]:
    """The delimiters of a literal ``spec`` that ``tokenizer`` writes with byte pieces: tokens that are no text
    on their own (SmolLM2 writes ``⟦`` as three byte-level tokens, the last shared by every character of its
    Unicode block and by ``é``'s second byte). Under the product rule such a delimiter is fragile: where the
    background is sure of the last piece, each expert's small rise of a sibling piece multiplies with the
    others' (docs/results/skills4.md, the fifth expert's delimiter). A regex spec returns nothing."""
    spec = IntervalSpec.from_dict(spec) if isinstance(spec, Mapping) else spec
    if spec.regex:
        return []
    decode = token_decoder(tokenizer)
    return [d for d in dict.fromkeys((spec.start, spec.end))
            if any("\ufffd" in decode([i]) for i in tokenizer.encode(d, add_special_tokens=False))]


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted piece by piece (HF/vLLM ``prefix_offset``/``read_offset``).

    Each :meth:`push` decodes only ``ids[prefix_offset:]`` (at most ``2 · MAX_PENDING_TOKENS`` tokens):
    ``ids[prefix_offset:read_offset]`` were emitted already and serve as context (e.g. SentencePiece's
    leading space), the rest is new. Characters are emitted as soon as they are final: a trailing run of
    "\\ufffd" (an incomplete UTF-8 sequence) is held back until a later token completes it, or until
    ``MAX_PENDING_TOKENS`` tokens are pending (then it is invalid bytes and emitted as it is).
    """

    def __init__(self, decode: Callable[[list[int]], str], max_pending: int = MAX_PENDING_TOKENS) -> None:
        self.decode, self.max_pending = decode, max_pending
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self._emitted = 0  # characters of decode(ids[prefix_offset:]) emitted so far

    def push(self, token_id: int) -> str:
        """Append one token; return the newly final characters (maybe empty)."""
        self.ids.append(int(token_id))
        text = self.decode(self.ids[self.prefix_offset :])
        complete = not text.endswith("\ufffd") or len(self.ids) - self.read_offset >= self.max_pending
        stable = text if complete else text.rstrip("\ufffd")
        new = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if complete:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._emitted = len(self.decode(self.ids[self.prefix_offset : self.read_offset]))
        return new


class StoppingTimeDetector:
    """Per row of a batch, from generated token ids alone: is the interval open for the NEXT token?

    Fed a response's tokens one at a time, ``is_open()`` before token ``j`` equals
    ``token_interval_mask(text, offsets, spec)[j]`` (module docstring). Each :meth:`update` decodes a
    bounded number of tokens per row (see :class:`IncrementalDetokenizer`).
    """

    def __init__(self, spec: IntervalSpec | Mapping[str, Any], tokenizer, batch_size: int) -> None:
        self.spec = IntervalSpec.from_dict(spec)
        decode = token_decoder(tokenizer)
        self.batch_size = int(batch_size)
        self.detokenizers = [IncrementalDetokenizer(decode) for _ in range(self.batch_size)]
        self.trackers = [IntervalTracker(self.spec) for _ in range(self.batch_size)]

    def update(self, new_ids: Tensor | Sequence[int]) -> None:
        """Append one token per row (``[B]``)."""
        ids = new_ids.reshape(-1).tolist() if isinstance(new_ids, Tensor) else [int(i) for i in new_ids]
        if len(ids) != self.batch_size:
            raise ValueError(f"update got {len(ids)} ids for a batch of {self.batch_size}")
        for detok, tracker, token_id in zip(self.detokenizers, self.trackers, ids, strict=True):
            tracker.feed(detok.push(token_id))

    def is_open(self) -> Tensor:
        """Bool ``[B]``: the interval is open for the next token."""
        return torch.tensor([t.is_open for t in self.trackers], dtype=torch.bool)
