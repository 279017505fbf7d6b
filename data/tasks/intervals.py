"""The synthetic interval task (docs/method.md, when the rule is exact, skill intervals) behind the task seam.

A row is ``<bos> x <sep> y <eos>``: ``x`` is random plain text (lowercase letters by default) holding
bracketed segments, such as ``ab[cde]f(gh)i``. The background copies (``y == x``). Each expert owns one kind
of segment, given by its delimiters (``Expert.spec["interval"]``), and one *skill*, a named transform of the
segment's content (:data:`SKILLS`): expert ``upper`` with ``[ ]`` writes ``ab[CDE]f(gh)i``, expert ``reverse``
with ``( )`` writes ``ab[cde]f(hg)i``, both together ``ab[CDE]f(hg)i``.

An expert's mask (``compose.intervals.token_interval_mask`` on ``y``, one token per character) covers the
content of its segments and their end delimiter, never the start delimiter: whether a position is in it
is decidable from the prefix alone (a stopping time), so at each step at most one expert differs from the
background and the composition is exact (docs/method.md, when the rule is exact, combined factorizability).

Segments never nest and never touch (at least one plain character between two), and the plain text never
holds a delimiter character. Every split is drawn from its own seed, derived from the run's seed and the
expert's *name* (adding an expert leaves the others' rows unchanged); held-out inputs avoid the training
inputs they could leak from.
"""

from __future__ import annotations

import codecs
import difflib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from compose.intervals import IntervalSpec, interval_char_spans, token_interval_mask
from compose.metrics import ExactMatch, FailureTypes
from data.collate import Collator, CorruptionRate
from data.generation import greedy_decode
from data.splits import derive_seed, draw_excluding
from data.tasks import register_task
from data.tasks.base import (
    EVAL_SPLITS,
    ROW_FEATURES,
    SPLITS,
    Expert,
    Task,
    TaskError,
    check_split,
    check_split_sizes,
)
from data.tokenizer import build_char_tokenizer, validate_alphabet
from losses import IGNORE_INDEX

# --- skills ---------------------------------------------------------------------------------------------

Skill = Callable[[str], str]

SKILLS: dict[str, Skill] = {
    "upper": str.upper,
    "lower": str.lower,
    "reverse": lambda s: s[::-1],
    "rot13": lambda s: codecs.encode(s, "rot13"),
}
"""Named transforms of a segment's content (length-preserving, so outputs stay position-aligned)."""

# (skill, start, end) in the order `standard_experts` hands them out.
_STANDARD = (("upper", "[", "]"), ("reverse", "(", ")"), ("rot13", "{", "}"), ("lower", "[", "]"))


@dataclass
class IntervalsConfig:
    """Settings of the interval task (the `task:` config node with `name: intervals`).

    Attributes:
        alphabet: plain text characters (the tokenizer holds these, their upper- and lowercase, and every
            expert's delimiter characters).
        min_len, max_len: the length of `x` (delimiters included) is uniform in `[min_len, max_len]`,
            raised where the row's segments need more room.
        min_segments, max_segments: segments of one kind in a row that has that kind (expert rows with
            segments, compositional rows; background rows draw `0 .. max_segments` of each kind). Segments
            that do not fit in the row's length are dropped at random (never an expert's last one in a
            compositional row).
        min_segment_len, max_segment_len: characters inside one segment (>= 1), shrunk to fit the row.
        n_train, n_val, n_test: rows per split per expert (the same count again for each expert's
            regularizer rows when `reg_data` adds any; the background and the compositional splits count
            once).
        source_prob: fraction of an expert's task rows that hold its segments; the rest are plain text.
        compositional_min_experts: None: every compositional row holds segments of every expert in play;
            otherwise of a random subset of at least this many (>= 2).
        skills: `{expert name: skill}` (a key of `SKILLS`); an expert not listed uses the skill named like
            it.
    """

    alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    min_len: int = 8
    max_len: int = 24
    min_segments: int = 1
    max_segments: int = 2
    min_segment_len: int = 1
    max_segment_len: int = 6
    n_train: int = 8000
    n_val: int = 500
    n_test: int = 1000
    source_prob: float = 0.8
    compositional_min_experts: int | None = None
    skills: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            validate_alphabet(self.alphabet)
        except ValueError as e:
            raise TaskError(f"task.alphabet: {e}") from None
        for low, high in (("min_len", "max_len"), ("min_segments", "max_segments"),
                          ("min_segment_len", "max_segment_len")):
            a, b = getattr(self, low), getattr(self, high)
            if a < 1 or b < a:
                raise TaskError(f"task: need 1 <= {low} <= {high}, got {low}={a}, {high}={b}")
        check_split_sizes(self, self.max_row_length)
        if not 0.0 <= self.source_prob <= 1.0:
            raise TaskError(f"task.source_prob must be in [0, 1], got {self.source_prob}")
        m = self.compositional_min_experts
        if m is not None and m < 2:
            raise TaskError(f"task.compositional_min_experts must be None or >= 2, got {m}")
        self.skills = {str(k): str(v) for k, v in dict(self.skills or {}).items()}

    @property
    def max_row_length(self) -> int:
        """Tokens in a row `<bos> x <sep> y <eos>` with `x` of max_len (a row may grow to fit its segments)."""
        return 2 * self.max_len + 3


@dataclass(frozen=True)
class _Kind:
    """One expert as the generator sees it: its delimiters and its skill."""

    name: str
    spec: IntervalSpec
    skill: Skill

    def footprint(self, inside: int) -> int:
        return len(self.spec.start) + inside + len(self.spec.end)


# --- text -----------------------------------------------------------------------------------------------

def apply_skills(x: str, kinds: Sequence[_Kind]) -> str:
    """`x` with each kind's skill applied to the content of its own segments (other text unchanged)."""
    chars = list(x)
    for kind in kinds:
        for a, b in interval_char_spans(x, kind.spec):
            end = b - len(kind.spec.end)
            chars[a:end] = kind.skill(x[a:end])
    return "".join(chars)


def segments(text: str, spec: IntervalSpec) -> list[str]:
    """The segments of one kind in order of occurrence, each as content plus end delimiter (an unclosed
    one runs to the end of `text`)."""
    return [text[a:b] for a, b in interval_char_spans(text, spec)]


def _shrink(rng: random.Random, lengths: list[int], excess: int, floor: int) -> None:
    """Take `excess` characters off random segments, none below `floor`."""
    for _ in range(excess):
        i = rng.choice([j for j, n in enumerate(lengths) if n > floor])
        lengths[i] -= 1


def _gaps(rng: random.Random, plain: int, n_segments: int) -> list[int]:
    """`plain` characters split into `n_segments + 1` gaps, the inner ones >= 1."""
    free = plain - max(n_segments - 1, 0)
    cuts = sorted(rng.randint(0, free) for _ in range(n_segments))
    gaps = [b - a for a, b in zip([0, *cuts], [*cuts, free], strict=True)]
    return [g + (0 < i < n_segments) for i, g in enumerate(gaps)]


def sample_text(rng: random.Random, cfg: IntervalsConfig, kinds: Sequence[_Kind], counts: Sequence[int],
                keep: Sequence[int] = ()) -> str:
    """Random plain text holding `counts[i]` segments of `kinds[i]` in random order.

    Segment contents are uniform in `[min_segment_len, max_segment_len]`; when the segments cannot fit in
    `max_len`, random segments are dropped (never the last one of a kind in `keep`) and random contents
    shortened until they do. The length is then uniform between what the segments need (or `min_len`)
    and `max_len`; the plain text fills the gaps (at least one character between two segments).
    """
    order = [i for i, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(order)
    lo = cfg.min_segment_len
    lengths = [rng.randint(lo, cfg.max_segment_len) for _ in order]

    def size(segs: Sequence[int], contents: Sequence[int]) -> int:  # delimiters, contents, inner gaps of 1
        return sum(kinds[i].footprint(n) for i, n in zip(segs, contents, strict=True)) + max(len(segs) - 1, 0)

    while size(order, [lo] * len(order)) > cfg.max_len:
        p = rng.choice([p for p, i in enumerate(order) if i not in keep or order.count(i) > 1])
        del order[p], lengths[p]
    _shrink(rng, lengths, size(order, lengths) - cfg.max_len, lo)
    length = rng.randint(max(cfg.min_len, size(order, lengths)), cfg.max_len)
    delimiters = sum(kinds[i].footprint(0) for i in order)
    gaps = _gaps(rng, length - delimiters - sum(lengths), len(order))
    text = lambda n: "".join(rng.choice(cfg.alphabet) for _ in range(n))  # noqa: E731
    pieces = [text(gaps[0])]
    for i, n, gap in zip(order, lengths, gaps[1:], strict=True):
        pieces += [kinds[i].spec.start, text(n), kinds[i].spec.end, text(gap)]
    return "".join(pieces)


# --- rows -----------------------------------------------------------------------------------------------



def _layout(x: str, y: str, vocab: Mapping[str, int], specials: tuple[int, int, int],
            mask_specs: Sequence[IntervalSpec]) -> dict[str, Any]:
    """One row `<bos> x <sep> y <eos>` (targets shifted: position `len(x) + 1 + j` predicts `y[j]`)."""
    bos, sep, eos = specials
    n, m = len(x), len(y)
    ids = [bos, *(vocab[c] for c in x), sep, *(vocab[c] for c in y), eos]
    targets = [IGNORE_INDEX] * len(ids)
    targets[n + 1: n + 2 + m] = ids[n + 2: n + 3 + m]
    offsets = [(j, j + 1) for j in range(m)]
    masks = []
    for spec in mask_specs:
        row = [0] * len(ids)
        row[n + 1: n + 1 + m] = token_interval_mask(y, offsets, spec)
        masks.append(row)
    return {"x": x, "y": y, "input_ids": ids, "targets": targets, "masks": masks, "output_start": n + 2,
            "output_len": m}


def _dataset(rows: list[dict[str, Any]], extra: Mapping[str, int]) -> datasets.Dataset:
    columns = {key: [r[key] for r in rows] for key in ROW_FEATURES}
    columns.update({key: [int(v)] * len(rows) for key, v in extra.items()})
    features = datasets.Features({**ROW_FEATURES, **{key: datasets.Value("int64") for key in extra}})
    return datasets.Dataset.from_dict(columns, features=features)


# --- the task -------------------------------------------------------------------------------------------

@register_task("intervals")
class IntervalsTask(Task):
    """Skill intervals: experts own delimiters (`experts[i].interval`) and a skill (`task.skills`)."""

    config_class = IntervalsConfig

    def __init__(self, cfg: IntervalsConfig, experts: Sequence[Expert], **kwargs) -> None:
        super().__init__(cfg, experts, **kwargs)
        if self.reg_data == "random_rules":
            raise TaskError("expert.reg_data=random_rules is a letter-task recipe (random rules on other letters); "
                            "use own, background, own+background or composition here")
        tokenizer = kwargs.get("tokenizer")
        self.kinds = [_kind(e, cfg) for e in self.experts]
        _check_experts(self.kinds, cfg, self.allow_overlap)
        self.letters = _case_closure(cfg.alphabet)  # the tokens text may hold: the alphabet, its case variants
        self.token_alphabet = _token_alphabet(cfg.alphabet, self.kinds)
        for kind in self.kinds:
            _check_skill_output(kind, cfg.alphabet, self.token_alphabet)
        self._tokenizer = _check_tokenizer(tokenizer, self.token_alphabet) if tokenizer is not None \
            else build_char_tokenizer(self.token_alphabet)
        self._vocab = {c: self._tokenizer.convert_tokens_to_ids(c) for c in self.token_alphabet}
        self._specials = (self._tokenizer.bos_token_id, self._tokenizer.sep_token_id, self._tokenizer.eos_token_id)
        self._inputs: dict[str, dict[str, list[str]]] = {}  # cache: group -> split -> inputs
        self._datasets: dict[tuple, datasets.Dataset] = {}  # cache: (method, args) -> rows

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    def standard_experts(self, k: int) -> list[dict]:
        """Up to 3 experts with distinct delimiters, named after their skill: upper `[ ]`, reverse `( )`,
        rot13 `{ }` (lower `[ ]` instead of upper for an uppercase alphabet)."""
        chosen: dict[str, dict] = {}
        for skill, start, end in _STANDARD:
            if start not in chosen and SKILLS[skill](self.cfg.alphabet) != self.cfg.alphabet:
                chosen[start] = {"name": skill, "interval": {"start": start, "end": end}}
        if k > len(chosen):
            raise TaskError(f"task 'intervals' has {len(chosen)} standard experts (distinct delimiters and "
                            f"skills); ablation_ks asked for k={k}")
        return list(chosen.values())[:k]

    def collator(self, corruption_prob: CorruptionRate = 0.0) -> Callable[[list[dict]], dict]:
        """Pads rows; corruption replaces output letters (plain and case variants) by other letters and
        never touches a delimiter, so it cannot change the interval structure of a prefix."""
        letters = [self._vocab[c] for c in self.letters]
        delimiters = [self._vocab[c] for c in self.token_alphabet if c not in self.letters]
        return _LettersOnlyCollator(self._tokenizer.pad_token_id, letters, delimiters, corruption_prob)

    # --- inputs -----------------------------------------------------------------------------------------
    def _maker(self, seed: int, n: int, draw: Callable[[random.Random], str]) -> Callable[[int], list[str]]:
        def make(attempt: int) -> list[str]:
            rng = random.Random(derive_seed(seed, attempt))
            return [draw(rng) for _ in range(n)]
        return make

    def _background_row(self, rng: random.Random) -> str:
        counts = [rng.randint(0, self.cfg.max_segments) for _ in self.kinds]
        return sample_text(rng, self.cfg, self.kinds, counts)

    def _expert_row(self, i: int, rng: random.Random) -> str:
        c = self.cfg
        count = rng.randint(c.min_segments, c.max_segments) if rng.random() < c.source_prob else 0
        return sample_text(rng, c, [self.kinds[i]], [count], keep=[0] if count else [])

    def _compositional_row(self, rng: random.Random) -> str:
        c, k = self.cfg, len(self.kinds)
        m = c.compositional_min_experts
        chosen = range(k) if m is None else sorted(rng.sample(range(k), rng.randint(m, k)))
        counts = [rng.randint(c.min_segments, c.max_segments) if i in chosen else 0 for i in range(k)]
        return sample_text(rng, c, self.kinds, counts, keep=list(chosen))

    def _splits(self, group: str, draw: Callable[[random.Random], str], splits: Sequence[str],
                exclude: Callable[[], set[str]] = set) -> dict[str, list[str]]:
        """Inputs per split (cached under `group`), each disjoint from the earlier ones and from `exclude()`."""
        if group not in self._inputs:
            seen, out = exclude(), {}
            for split in splits:
                n = getattr(self.cfg, f"n_{split}")
                out[split] = draw_excluding(self._maker(derive_seed(self.seed, group, split), n, draw), n, seen,
                                            f"intervals {group} {split}")
                seen.update(out[split])
            self._inputs[group] = out
        return self._inputs[group]

    def _background_inputs(self) -> dict[str, list[str]]:
        return self._splits("background", self._background_row, SPLITS)

    def _expert_inputs(self, i: int) -> dict[str, list[str]]:
        return self._splits(f"expert/{self.kinds[i].name}", lambda rng: self._expert_row(i, rng), SPLITS)

    def _compositional_inputs(self) -> dict[str, list[str]]:
        """Held-out compositional inputs, disjoint from the background's and every expert's training inputs."""
        if not self.kinds:
            raise TaskError("task 'intervals': compositional rows need at least one expert")

        def training_inputs() -> set[str]:
            seen = set(self._background_inputs()["train"])
            for i in range(len(self.kinds)):
                seen.update(self._expert_inputs(i)["train"])
            return seen

        return self._splits("compositional", self._compositional_row, EVAL_SPLITS, training_inputs)

    def _regularizer_inputs(self, i: int, kind: str) -> list[str]:
        """Training inputs for expert `i`'s regularizer rows (`copy` or `composition`), disjoint from its own
        and the compositional held-out inputs (so they never change those)."""
        def held_out() -> set[str]:
            return {x for s in EVAL_SPLITS for x in (*self._expert_inputs(i)[s], *self._compositional_inputs()[s])}

        draw = self._background_row if kind == "copy" else self._compositional_row
        return self._splits(f"regularizer-{kind}/{self.kinds[i].name}", draw, ["train"], held_out)["train"]

    # --- rows -------------------------------------------------------------------------------------------
    def _rows(self, xs: Sequence[str], applied: Sequence[_Kind], masked: Sequence[_Kind],
              extra: Mapping[str, int] | None = None) -> datasets.Dataset:
        specs = [k.spec for k in masked]
        rows = [_layout(x, apply_skills(x, applied), self._vocab, self._specials, specs) for x in xs]
        return _dataset(rows, extra or {})

    def background_dataset(self, split: str) -> datasets.Dataset:
        """Copy rows (`y == x`) holding `0 .. max_segments` segments of every kind; no masks."""
        check_split(split, SPLITS)
        return self._cached(("background", split), lambda: self._rows(self._background_inputs()[split], [], []))

    def expert_dataset(self, split: str) -> datasets.Dataset:
        """Task rows of each expert in `trained` (its skill on its own segments, its own mask) plus, for
        `train`, regularizer rows by `reg_data`: copy rows (`background`, `own+background`) or compositional
        rows with every expert's skill applied (`composition`)."""
        check_split(split, SPLITS)
        trained, reg_data = self.trained, self.reg_data
        if not trained:
            raise TaskError("expert_dataset: no experts named in `trained`")
        return self._cached(("expert", split, tuple(trained), reg_data if split == "train" else None),
                            lambda: self._expert_rows(split, trained, reg_data))

    def _expert_rows(self, split: str, trained: Sequence[str], reg_data: str) -> datasets.Dataset:
        parts = []
        for index, name in enumerate(trained):
            i = self._index(name)
            kind = self.kinds[i]
            task = {"expert_index": index, "is_task": 1, "task_on_mask": 1}
            parts.append(self._rows(self._expert_inputs(i)[split], [kind], [kind], task))
            if split == "train" and reg_data in ("background", "own+background"):
                reg = {"expert_index": index, "is_task": 0, "task_on_mask": 0}
                parts.append(self._rows(self._regularizer_inputs(i, "copy"), [], [kind], reg))
            elif split == "train" and reg_data == "composition":
                reg = {"expert_index": index, "is_task": 0, "task_on_mask": 1}
                parts.append(self._rows(self._regularizer_inputs(i, "composition"), self.kinds, [kind], reg))
        return datasets.concatenate_datasets(parts)

    def compositional_dataset(self, split: str) -> datasets.Dataset:
        """Inputs holding segments of every expert (or of `compositional_min_experts` of them), in varying
        number, order and length; `y` = every skill applied; one mask per expert in play."""
        check_split(split, EVAL_SPLITS)
        return self._cached(("compositional", split),
                            lambda: self._rows(self._compositional_inputs()[split], self.kinds, self.kinds))

    def _cached(self, key: tuple, build: Callable[[], datasets.Dataset]) -> datasets.Dataset:
        if key not in self._datasets:
            self._datasets[key] = build()
        return self._datasets[key]

    def _index(self, name: str) -> int:
        if name not in self.expert_names:
            raise TaskError(f"expert {name!r} is not in play (experts: {', '.join(self.expert_names)})")
        return self.expert_names.index(name)

    # --- evaluation -------------------------------------------------------------------------------------
    def outputs(self, model: Any, xs: Sequence[str], batch_size: int) -> tuple[list[str], list[bool]]:
        """Greedy outputs of `<bos> x <sep>` (text up to <eos>, at most `len(x) + 2` new tokens) and whether
        each ended with <eos>."""
        tok = self._tokenizer
        prompts = [[tok.bos_token_id, *tok.convert_tokens_to_ids(list(x)), tok.sep_token_id] for x in xs]
        return greedy_decode(model, tok, prompts, batch_size, lambda chunk: max(map(len, chunk)))  # len(x) + 2

    def evaluate_background(self, model: Any, split: str, batch_size: int) -> dict[str, float]:
        """`exact_match` of the copy on the background's held-out rows."""
        check_split(split, EVAL_SPLITS)
        xs = self._background_inputs()[split]
        return self._judge(model, xs, xs, [], batch_size)

    def evaluate_expert(self, model: Any, name: str, split: str, batch_size: int) -> dict[str, float]:
        """`exact_match` and `skill_accuracy` (its segments reproduced) on the expert's held-out task rows."""
        check_split(split, EVAL_SPLITS)
        kind = self.kinds[self._index(name)]
        xs = self._expert_inputs(self._index(name))[split]
        scores = self._judge(model, xs, [apply_skills(x, [kind]) for x in xs], [kind], batch_size)
        return {"exact_match": scores["exact_match"], "skill_accuracy": scores[f"{name}/skill_accuracy"]}

    def evaluate_composition(self, model: Any, dataset: datasets.Dataset, batch_size: int) -> dict[str, float]:
        """`exact_match`, `<expert>/skill_accuracy` (its reference segments reproduced exactly, matched by
        order of occurrence) and `failures/<kind>` (`compose.metrics.FAILURE_TYPES`)."""
        return self._judge(model, list(dataset["x"]), list(dataset["y"]), self.kinds, batch_size)

    def _judge(self, model: Any, xs: Sequence[str], ys: Sequence[str], kinds: Sequence[_Kind],
               batch_size: int) -> dict[str, float]:
        preds, ended = self.outputs(model, xs, batch_size)
        em = ExactMatch()
        em.update(preds, ys, ended)
        results = {"exact_match": float(em.compute())}
        if not kinds:
            return results
        for kind in kinds:
            results[f"{kind.name}/skill_accuracy"] = skill_accuracy(preds, ys, kind.spec)
        failures = FailureTypes()
        failures.update(preds, ys, xs, ended, [_masked_chars(y, kinds) for y in ys])
        results.update({f"failures/{k}": float(v) for k, v in failures.compute().items()})
        return results


# --- evaluation helpers ---------------------------------------------------------------------------------

def skill_accuracy(preds: Sequence[str], refs: Sequence[str], spec: IntervalSpec) -> float:
    """Fraction of the reference segments of `spec` (content + end delimiter) that the prediction's segment
    of the same rank reproduces exactly; 1.0 when the references hold none."""
    hits = total = 0
    for pred, ref in zip(preds, refs, strict=True):
        want, got = segments(ref, spec), segments(pred, spec)
        total += len(want)
        hits += sum(a == b for a, b in zip(want, got, strict=False))
    return hits / total if total else 1.0


def _masked_chars(y: str, kinds: Sequence[_Kind]) -> set[int]:
    """Character positions of `y` inside some kind's interval (content and end delimiter)."""
    return {j for kind in kinds for a, b in interval_char_spans(y, kind.spec) for j in range(a, b)}


# --- collation ------------------------------------------------------------------------------------------

class _LettersOnlyCollator:
    """`data.collate.Collator`, with corrupted delimiters put back: output letters are replaced at
    `corruption_prob` (by other letters), delimiters never."""

    def __init__(self, pad_token_id: int, letter_ids: Sequence[int], protected_ids: Sequence[int],
                 corruption_prob: CorruptionRate) -> None:
        self.corrupting = Collator(pad_token_id, letter_ids, corruption_prob)
        self.clean = Collator(pad_token_id) if self.corrupting.high > 0 else None
        self.protected = torch.tensor(list(protected_ids), dtype=torch.long)

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.corrupting(rows)
        if self.clean is not None and len(self.protected):
            clean = self.clean(rows)["input_ids"]
            batch["input_ids"] = torch.where(torch.isin(clean, self.protected), clean, batch["input_ids"])
        return batch


# --- validation -----------------------------------------------------------------------------------------

def _case_closure(alphabet: str) -> str:
    """`alphabet` followed by the single-character upper- and lowercase forms it lacks, in order."""
    out = list(alphabet)
    for variant in (str.upper, str.lower):
        out += [v for v in map(variant, alphabet) if len(v) == 1 and v not in out]
    return "".join(dict.fromkeys(out))


def _token_alphabet(alphabet: str, kinds: Sequence[_Kind]) -> str:
    """Plain characters and their case variants, then every delimiter character (sorted)."""
    delimiters = sorted({c for k in kinds for c in k.spec.start + k.spec.end})
    tokens = _case_closure(alphabet) + "".join(delimiters)
    try:
        validate_alphabet(tokens)
    except ValueError as e:
        raise TaskError(f"experts: delimiters cannot be tokens: {e}") from None
    return tokens


def _kind(expert: Expert, cfg: IntervalsConfig) -> _Kind:
    """The expert's delimiters and skill, or a one-line `TaskError`."""
    if set(expert.spec) != {"interval"}:
        raise TaskError(f"expert {expert.name!r}: the intervals task needs `interval` (and no other mask spec), "
                        f"got {sorted(expert.spec) or 'none'}")
    try:
        spec = IntervalSpec.from_dict(expert.spec["interval"])
    except ValueError as e:
        raise TaskError(f"expert {expert.name!r}: {e}") from None
    if spec.regex:
        raise TaskError(f"expert {expert.name!r}: regex interval specs are not supported by the intervals task "
                        f"(it writes literal delimiters); set interval.regex: false")
    skill = cfg.skills.get(expert.name, expert.name)
    if skill not in SKILLS:
        close = difflib.get_close_matches(skill, SKILLS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TaskError(f"expert {expert.name!r}: skill {skill!r} is not one of {', '.join(SKILLS)}{hint}; "
                        f"set task.skills.{expert.name}")
    return _Kind(expert.name, spec, SKILLS[skill])


def _check_experts(kinds: Sequence[_Kind], cfg: IntervalsConfig, allow_overlap: bool = False) -> None:
    """Unique names; delimiters outside the text's characters and not shared between experts (even with
    `allow_overlap`: shared delimiters make the segments ambiguous); room for one segment of every expert in
    `max_len`."""
    plain = set(_case_closure(cfg.alphabet))
    owner: dict[str, str] = {}
    for kind in kinds:
        if kind.name in {k.name for k in kinds if k is not kind}:
            raise TaskError(f"experts: the name {kind.name!r} is used more than once")
        chars = set(kind.spec.start + kind.spec.end)
        if chars & plain:
            raise TaskError(f"expert {kind.name!r}: delimiter character(s) {sorted(chars & plain)} are text "
                            f"characters of task.alphabet {cfg.alphabet!r} (or their case variants)")
        for c in sorted(chars):
            if c in owner and owner[c] != kind.name:
                hint = " (the intervals task cannot allow overlapping experts, allow_overlap or not)" \
                    if allow_overlap else ""
                raise TaskError(f"experts {owner[c]!r} and {kind.name!r} share the delimiter character {c!r}: "
                                f"their intervals could overlap{hint}")
            owner[c] = kind.name
    need = sum(k.footprint(cfg.min_segment_len) for k in kinds) + max(len(kinds) - 1, 0)
    if need > cfg.max_len:
        raise TaskError(f"task.max_len={cfg.max_len} cannot hold one segment of each of the {len(kinds)} "
                        f"experts (needs {need}); raise max_len or lower min_segment_len")
    m = cfg.compositional_min_experts
    if m is not None and m > len(kinds):
        raise TaskError(f"task.compositional_min_experts={m} exceeds the {len(kinds)} experts in play")


def _check_skill_output(kind: _Kind, alphabet: str, tokens: str) -> None:
    out = kind.skill(alphabet)
    if out == alphabet:
        raise TaskError(f"expert {kind.name!r}: its skill leaves every text over task.alphabet unchanged")
    bad = sorted(set(out) - set(tokens))
    if bad or len(out) != len(alphabet):
        raise TaskError(f"expert {kind.name!r}: its skill writes {bad or 'a different number of'} characters "
                        f"outside the tokenizer's alphabet {tokens!r}")


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, tokens: str) -> PreTrainedTokenizerBase:
    """Accept a tokenizer only if it has one token per character of `tokens` and the special tokens."""
    vocab = tokenizer.get_vocab()
    missing = [c for c in tokens if c not in vocab]
    specials = [a for a in ("pad_token_id", "bos_token_id", "sep_token_id", "eos_token_id")
                if getattr(tokenizer, a, None) is None]
    if missing or specials or tokenizer.decode([vocab[c] for c in tokens]) != tokens:
        raise TaskError(f"task 'intervals' needs a character tokenizer (one token per character of {tokens!r}, "
                        f"with pad/bos/sep/eos); missing {missing or specials or 'a round trip'}")
    return tokenizer
