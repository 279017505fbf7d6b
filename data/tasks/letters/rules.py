"""The generative letter-replacement task (docs/method.md), without Lightning.

A sequence is ``<bos> x <sep> y <eos>``: ``x`` a random string over the alphabet, ``y`` the same string
with some letters replaced, position by position. An expert owns a :class:`RuleSet` (``{source: target}``,
e.g. ``{"A": "B"}``); the background copies (``y == x``). The mask of an expert is the set of positions
whose *target* is a letter of ``y`` aligned with one of the expert's source letters in ``x``.

Layout of one row, for ``n = len(x)``::

    position   0      1 .. n    n+1     n+2 .. 2n+1   2n+2
    input_ids  <bos>  x         <sep>   y             <eos>
    targets    -100   -100      y[0]    y[1..n-1] <eos>  -100

``targets`` are already shifted: ``logits[:, t]`` is scored against ``targets[:, t]``.

The *position-aligned* format (the paper authors' appendix set-up, :func:`build_aligned_dataset`) drops the
generated half: ``<bos> x``, and the logits at the position holding ``x[j]`` predict ``y[j]``.
:data:`DATA_FORMATS` names the two; :func:`dataset_builder` picks the builder of one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from torch import LongTensor
from transformers import PreTrainedTokenizerBase

from data.generation import decode_until_eos, left_padded
from data.tasks.base import ROW_FEATURES
from data.tokenizer import validate_alphabet
from losses import IGNORE_INDEX

# Column names build_letters_dataset writes itself; extra_columns may not reuse them.
_BASE_COLUMNS = ("x", "y", "input_ids", "targets", "masks", "output_start", "output_len")


@dataclass(frozen=True)
class RuleSet:
    """One expert's letter rules: ``{source letter: target letter}``, applied position-wise.

    ``rules`` is copied into a plain ``dict`` (so an OmegaConf ``DictConfig`` is accepted).
    """

    name: str
    rules: Mapping[str, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", {str(k): str(v) for k, v in dict(self.rules).items()})

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.rules.items()))))

    @property
    def sources(self) -> frozenset[str]:
        """The letters this expert rewrites."""
        return frozenset(self.rules)

    def apply(self, x: str) -> str:
        """``x`` with every source letter replaced by its target (position-wise, not chained)."""
        return "".join(self.rules.get(ch, ch) for ch in x)


def validate_rule_sets(
    rule_sets: Sequence[RuleSet], alphabet: str, allow_overlap: bool = False
) -> list[str]:
    """Check a set of experts' rules against ``alphabet`` and against each other.

    Raises:
        ValueError: (one line, naming the expert and the entry) if a name is empty or duplicated, an
            expert has no rules, a rules key or value is not a single letter of ``alphabet``, a rule maps
            a letter to itself, or two experts share a source letter while ``allow_overlap`` is False.

    Returns:
        With ``allow_overlap``: one human-readable line per shared source letter (empty if none).
        Otherwise ``[]``.
    """
    validate_alphabet(alphabet)
    letters = set(alphabet)
    owner: dict[str, str] = {}
    names: set[str] = set()
    overlaps: list[str] = []
    for rs in rule_sets:
        if not isinstance(rs, RuleSet):
            raise ValueError(f"expected a RuleSet, got {type(rs).__name__}: {rs!r}")
        if not isinstance(rs.name, str) or not rs.name.strip():
            raise ValueError(f"rule set with rules {dict(rs.rules)!r} has an empty name")
        if rs.name in names:
            raise ValueError(f"rule set name {rs.name!r} is used by more than one expert")
        names.add(rs.name)
        if not rs.rules:
            raise ValueError(f"rule set {rs.name!r} has no rules")
        for src, tgt in rs.rules.items():
            for role, ch in (("key", src), ("value", tgt)):
                if len(ch) != 1 or ch not in letters:
                    raise ValueError(
                        f"rule set {rs.name!r}: rules {role} {ch!r} (in {src!r}->{tgt!r}) is not a single "
                        f"letter of the alphabet {alphabet!r}"
                    )
            if src == tgt:
                raise ValueError(f"rule set {rs.name!r}: rule {src!r}->{tgt!r} maps a letter to itself")
            if src in owner:
                msg = f"source letter {src!r} is shared by experts {owner[src]!r} and {rs.name!r}"
                if not allow_overlap:
                    raise ValueError(f"{msg} (pass allow_overlap=True to permit overlapping experts)")
                overlaps.append(msg)
            else:
                owner[src] = rs.name
    return overlaps


def combined_rules(rule_sets: Sequence[RuleSet]) -> dict[str, str]:
    """All experts' rules merged into one ``{source: target}`` map.

    Raises:
        ValueError: if two experts map the same source letter to different targets.
    """
    merged: dict[str, str] = {}
    who: dict[str, str] = {}
    for rs in rule_sets:
        for src, tgt in rs.rules.items():
            if src in merged and merged[src] != tgt:
                raise ValueError(
                    f"experts {who[src]!r} and {rs.name!r} map source letter {src!r} to different targets "
                    f"({merged[src]!r} vs {tgt!r}): the composed target is undefined"
                )
            merged[src], who[src] = tgt, rs.name
    return merged


def apply_rules(x: str, rule_sets: Sequence[RuleSet]) -> str:
    """Apply every expert's rules to ``x`` at once.

    The substitution is simultaneous and position-wise on the *input* letters, not chained:
    ``{A: B}`` and ``{B: C}`` turn ``"AB"`` into ``"BC"``. No rule sets gives ``x`` back (copy task).
    """
    merged = combined_rules(rule_sets)
    return "".join(merged.get(ch, ch) for ch in x)


def _check_lengths(n: int, min_len: int, max_len: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")


def _sample_one(
    rng: random.Random, alphabet: str, min_len: int, max_len: int, must_contain: Sequence[Sequence[str]]
) -> str:
    length = rng.randint(min_len, max_len)
    chars = [rng.choice(alphabet) for _ in range(length)]
    for pos, options in zip(rng.sample(range(length), len(must_contain)), must_contain, strict=True):
        chars[pos] = rng.choice(options)
    return "".join(chars)


def _letter_sets(must_contain: Sequence[Iterable[str]], alphabet: str) -> list[list[str]]:
    """Each set as a sorted list (set iteration order is not reproducible across processes)."""
    out = []
    for i, group in enumerate(must_contain):
        options = sorted(set(group))
        if not options:
            raise ValueError(f"must_contain[{i}] is empty")
        bad = [ch for ch in options if ch not in alphabet]
        if bad:
            raise ValueError(f"must_contain[{i}] has letters {bad} outside the alphabet {alphabet!r}")
        out.append(options)
    return out


def sample_strings(
    n: int,
    alphabet: str,
    min_len: int,
    max_len: int,
    seed: int,
    must_contain: Sequence[Iterable[str]] = (),
) -> list[str]:
    """``n`` random strings over ``alphabet`` with lengths uniform in ``[min_len, max_len]``.

    Each string contains at least one letter of every set in ``must_contain``: one letter of each set is
    planted at a random position, all positions distinct. Deterministic given ``seed``.

    Raises:
        ValueError: if ``min_len < len(must_contain)`` (no room to plant), a set is empty or holds letters
            outside the alphabet, or the lengths are invalid.
    """
    validate_alphabet(alphabet)
    _check_lengths(n, min_len, max_len)
    groups = _letter_sets(must_contain, alphabet)
    if min_len < len(groups):
        raise ValueError(
            f"cannot plant {len(groups)} required letters in strings as short as min_len={min_len}: "
            f"need min_len >= len(must_contain)"
        )
    rng = random.Random(seed)
    return [_sample_one(rng, alphabet, min_len, max_len, groups) for _ in range(n)]


def expert_inputs(
    n: int,
    alphabet: str,
    min_len: int,
    max_len: int,
    seed: int,
    rule_set: RuleSet,
    source_prob: float = 0.5,
) -> list[str]:
    """Inputs for one expert's task: ``round(source_prob * n)`` of them (at random places in the list)
    are planted with one of the expert's source letters, the rest are plain random strings."""
    if not 0.0 <= source_prob <= 1.0:
        raise ValueError(f"source_prob must be in [0, 1], got {source_prob}")
    validate_alphabet(alphabet)
    _check_lengths(n, min_len, max_len)
    groups = _letter_sets([rule_set.sources], alphabet)
    rng = random.Random(seed)
    planted = set(rng.sample(range(n), round(source_prob * n)))
    return [
        _sample_one(rng, alphabet, min_len, max_len, groups if i in planted else []) for i in range(n)
    ]


def compositional_inputs(
    n: int,
    alphabet: str,
    min_len: int,
    max_len: int,
    seed: int,
    rule_sets: Sequence[RuleSet],
    min_experts: int | None = None,
) -> list[str]:
    """Inputs that need several experts at once.

    With ``min_experts=None`` every string contains a source letter of every expert in ``rule_sets``;
    otherwise each string contains sources of a random subset of at least ``min_experts`` (>= 2) experts.
    """
    validate_alphabet(alphabet)
    _check_lengths(n, min_len, max_len)
    k = len(rule_sets)
    if k == 0:
        raise ValueError("compositional_inputs needs at least one rule set")
    groups = _letter_sets([rs.sources for rs in rule_sets], alphabet)
    if min_experts is None:
        return sample_strings(n, alphabet, min_len, max_len, seed, must_contain=groups)
    if not 2 <= min_experts <= k:
        raise ValueError(f"min_experts must be in [2, {k}] for {k} rule sets, got {min_experts}")
    if min_len < min_experts:
        raise ValueError(f"min_len={min_len} is shorter than min_experts={min_experts}: no room to plant")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subset = sorted(rng.sample(range(k), rng.randint(min_experts, min(k, min_len))))
        out.append(_sample_one(rng, alphabet, min_len, max_len, [groups[j] for j in subset]))
    return out


def random_rule_outputs(xs: Sequence[str], own: RuleSet, alphabet: str, seed: int) -> list[str]:
    """Each input with ``own``'s rules applied and, per row, *random rules* on every other letter: a rate ``q``
    is drawn for the row (density ``2q`` on [0, 1]: heavy rates are common, as in a k-way composition of short
    inputs, where every letter may be some expert's source), and each letter outside ``own``'s sources is
    rewritten (everywhere in the row, position-wise, like another expert's rule) with probability ``q`` to a
    uniformly drawn different letter. These are the prefixes a composition with unknown experts writes, drawn
    without knowing any of them, consistent within a row. Deterministic given ``seed``."""
    validate_alphabet(alphabet)
    rng = random.Random(seed)
    others = [ch for ch in alphabet if ch not in own.sources]
    out = []
    for x in xs:
        q = rng.random() ** 0.5
        rules = {ch: rng.choice([t for t in alphabet if t != ch]) for ch in others if rng.random() < q}
        out.append("".join(own.rules.get(ch) or rules.get(ch, ch) for ch in x))
    return out


def _special_id(tokenizer: PreTrainedTokenizerBase, attr: str) -> int:
    value = getattr(tokenizer, attr, None)
    if value is None:
        raise ValueError(f"tokenizer has no {attr} (build it with data.tokenizer.build_char_tokenizer)")
    return int(value)


def _check_extra_columns(extra_columns: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(extra_columns or {})
    for key, value in extra.items():
        if key in _BASE_COLUMNS:
            raise ValueError(f"extra column {key!r} clashes with a built-in column {_BASE_COLUMNS}")
        if not isinstance(value, int | float):
            raise ValueError(f"extra column {key!r} must be an int or float constant, got {value!r}")
    return extra


def _letter_vocab(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    specials = set(tokenizer.all_special_tokens)
    return {tok: i for tok, i in tokenizer.get_vocab().items() if tok not in specials}


def _check_inputs(xs: Sequence[str], merged: Mapping[str, str], vocab: Mapping[str, int]) -> None:
    for src, tgt in merged.items():
        for ch in (src, tgt):
            if ch not in vocab:
                raise ValueError(f"rule letter {ch!r} is not a letter of the tokenizer's vocabulary")
    for i, x in enumerate(xs):
        if not isinstance(x, str) or not x:
            raise ValueError(f"xs[{i}] must be a non-empty string, got {x!r}")
        bad = sorted({ch for ch in x if ch not in vocab})
        if bad:
            raise ValueError(f"xs[{i}]={x!r} has characters {bad} that are not letters of the tokenizer")


# One row's layout: (x, y) -> (input_ids, targets, masks, output_start).
_RowLayout = Callable[[str, str], tuple[list[int], list[int], list[list[int]], int]]


def _encode_dataset(xs: list[str], merged: Mapping[str, str], extra: dict[str, Any],
                    layout: _RowLayout, ys: list[str] | None = None) -> datasets.Dataset:
    """Map ``xs`` through ``layout`` into a ``datasets.Dataset`` with the letter-task columns (``y`` from
    ``merged``, or ``ys`` as given)."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in _BASE_COLUMNS[1:]}
        given = batch.get("y")
        for i, x in enumerate(batch["x"]):
            y = given[i] if given is not None else "".join(merged.get(ch, ch) for ch in x)
            input_ids, targets, masks, output_start = layout(x, y)
            for key, value in zip(
                _BASE_COLUMNS[1:], (y, input_ids, targets, masks, output_start, len(x)), strict=True
            ):
                out[key].append(value)
        for key, value in extra.items():
            out[key] = [value] * len(batch["x"])
        return out

    features = datasets.Features(
        {
            **ROW_FEATURES,
            **{
                key: datasets.Value("float32" if isinstance(v, float) else "int64")
                for key, v in extra.items()
            },
        }
    )
    columns = {"x": xs} if ys is None else {"x": xs, "y": ys}
    base = datasets.Dataset.from_dict(columns, features=datasets.Features({c: datasets.Value("string") for c in columns}))
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return base.map(encode, batched=True, batch_size=1000, features=features, keep_in_memory=True)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def build_letters_dataset(
    xs: Sequence[str],
    target_rule_sets: Sequence[RuleSet],
    mask_rule_sets: Sequence[RuleSet],
    tokenizer: PreTrainedTokenizerBase,
    extra_columns: dict[str, Any] | None = None,
    ys: Sequence[str] | None = None,
) -> datasets.Dataset:
    """Tokenize inputs into a ``datasets.Dataset`` of the letter task (generative format).

    Args:
        xs: input strings.
        target_rule_sets: rules that produce ``y`` (all applied at once); empty for the copy task.
        mask_rule_sets: the ``k`` experts whose masks to write (``masks`` has ``k`` rows per example).
        tokenizer: a character tokenizer with ``bos/sep/eos`` tokens (see ``build_char_tokenizer``).
        extra_columns: constant integer (or float) columns added to every row, e.g.
            ``{"expert_index": 1, "is_task": 1}``.
        ys: the outputs, one per input (same lengths, letters of the tokenizer), instead of
            ``target_rule_sets`` (e.g. :func:`random_rule_outputs`, rules that differ per row).

    Returns:
        Columns ``x``, ``y``, ``input_ids``, ``targets`` (already shifted, ``-100`` off the output),
        ``masks`` (``k`` lists of 0/1: 1 where the target is a letter of ``y`` aligned with a source
        letter of that expert; the ``<eos>`` target is in no mask), ``output_start`` (index of ``y[0]``
        in ``input_ids``, ``len(x) + 2``), ``output_len`` (``len(y)``), plus ``extra_columns``.
    """
    xs = list(xs)
    extra = _check_extra_columns(extra_columns)
    bos, sep, eos = (_special_id(tokenizer, a) for a in ("bos_token_id", "sep_token_id", "eos_token_id"))
    vocab = _letter_vocab(tokenizer)
    merged = combined_rules(target_rule_sets)
    _check_inputs(xs, merged, vocab)
    if ys is not None:
        ys = list(ys)
        _check_inputs(ys, {}, vocab)
        if len(ys) != len(xs) or any(len(x) != len(y) for x, y in zip(xs, ys, strict=True)):
            raise ValueError("ys must hold one output per input, each as long as its input")
    mask_sources = [set(rs.sources) for rs in mask_rule_sets]

    def layout(x: str, y: str) -> tuple[list[int], list[int], list[list[int]], int]:
        n = len(x)
        input_ids = [bos, *(vocab[ch] for ch in x), sep, *(vocab[ch] for ch in y), eos]
        targets = [IGNORE_INDEX] * len(input_ids)
        targets[n + 1 : 2 * n + 2] = input_ids[n + 2 : 2 * n + 3]
        masks = []
        for sources in mask_sources:
            row = [0] * len(input_ids)
            for j, ch in enumerate(x):
                if ch in sources:
                    row[n + 1 + j] = 1
            masks.append(row)
        return input_ids, targets, masks, n + 2

    return _encode_dataset(xs, merged, extra, layout, ys)


def build_aligned_dataset(
    xs: Sequence[str],
    target_rule_sets: Sequence[RuleSet],
    mask_rule_sets: Sequence[RuleSet],
    tokenizer: PreTrainedTokenizerBase,
    extra_columns: dict[str, Any] | None = None,
) -> datasets.Dataset:
    """Tokenize inputs into a ``datasets.Dataset`` of the *position-aligned* letter task.

    The set-up of the paper's appendix: the model reads ``<bos> x`` and the logits at the position holding
    ``x[j]`` are scored against ``y[j] = rule(x[j])``. Nothing is generated and outputs never feed back
    (no ``<sep>``, no ``<eos>``); the prediction is the argmax at each target position. For
    ``n = len(x)``::

        position   0      1 .. n
        input_ids  <bos>  x[0] .. x[n-1]
        targets    -100   y[0] .. y[n-1]

    Args: as :func:`build_letters_dataset` (only ``bos`` of the special tokens is used).

    Returns:
        The same columns as :func:`build_letters_dataset`: ``x``, ``y``, ``input_ids``, ``targets``
        (``logits[:, t]`` is scored against ``targets[:, t]``), ``masks`` (``k`` lists of 0/1: 1 at the
        positions whose *input* letter is a source of that expert), ``output_start`` (``1``),
        ``output_len`` (``len(x)``), plus ``extra_columns``.
    """
    xs = list(xs)
    extra = _check_extra_columns(extra_columns)
    bos = _special_id(tokenizer, "bos_token_id")
    vocab = _letter_vocab(tokenizer)
    merged = combined_rules(target_rule_sets)
    _check_inputs(xs, merged, vocab)
    mask_sources = [set(rs.sources) for rs in mask_rule_sets]

    def layout(x: str, y: str) -> tuple[list[int], list[int], list[list[int]], int]:
        input_ids = [bos, *(vocab[ch] for ch in x)]
        targets = [IGNORE_INDEX, *(vocab[ch] for ch in y)]
        masks = [[0, *(int(ch in sources) for ch in x)] for sources in mask_sources]
        return input_ids, targets, masks, 1

    return _encode_dataset(xs, merged, extra, layout)


DATA_FORMATS = ("generative", "aligned")
_BUILDERS = {"generative": build_letters_dataset, "aligned": build_aligned_dataset}


def check_format(format: str) -> str:
    """Return ``format`` if it is one of :data:`DATA_FORMATS`, else raise a one-line ``ValueError``."""
    if format not in DATA_FORMATS:
        raise ValueError(f"data format {format!r} is not one of {list(DATA_FORMATS)}")
    return format


def dataset_builder(format: str) -> Callable[..., datasets.Dataset]:
    """The dataset builder of a data format: ``build_letters_dataset`` (``"generative"``) or
    ``build_aligned_dataset`` (``"aligned"``); both take ``(xs, target_rule_sets, mask_rule_sets,
    tokenizer, extra_columns=None)``."""
    return _BUILDERS[check_format(format)]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, xs: Sequence[str]) -> list[list[int]]:
    """Token ids of the prompts ``<bos> x <sep>``."""
    bos, sep = (_special_id(tokenizer, a) for a in ("bos_token_id", "sep_token_id"))
    vocab = _letter_vocab(tokenizer)
    out = []
    for b, x in enumerate(xs):
        try:
            out.append([bos, *(vocab[ch] for ch in x), sep])
        except KeyError as err:
            raise ValueError(f"xs[{b}]={x!r} has a character that is not a letter of the tokenizer") from err
    return out


def prompt_batch(tokenizer: PreTrainedTokenizerBase, xs: Sequence[str]) -> tuple[LongTensor, LongTensor]:
    """Prompts ``<bos> x <sep>`` for generation, LEFT-padded with the pad id.

    Returns:
        ``(input_ids, attention_mask)``, both ``[B, 2 + max len(x)]`` long tensors.
    """
    if not xs:
        raise ValueError("prompt_batch got no inputs")
    return left_padded(prompt_ids(tokenizer, xs), _special_id(tokenizer, "pad_token_id"))


def aligned_batch(tokenizer: PreTrainedTokenizerBase, xs: Sequence[str]) -> tuple[LongTensor, LongTensor]:
    """Inputs ``<bos> x`` of the position-aligned format, RIGHT-padded with the pad id (so every ``x[j]``
    sits at position ``j + 1`` in every row).

    Returns:
        ``(input_ids, attention_mask)``, both ``[B, 1 + max len(x)]`` long tensors.
    """
    if not xs:
        raise ValueError("aligned_batch got no inputs")
    bos, pad = (_special_id(tokenizer, a) for a in ("bos_token_id", "pad_token_id"))
    vocab = _letter_vocab(tokenizer)
    width = 1 + max(len(x) for x in xs)
    input_ids = torch.full((len(xs), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(xs), width), dtype=torch.long)
    for b, x in enumerate(xs):
        try:
            ids = [bos, *(vocab[ch] for ch in x)]
        except KeyError as err:
            raise ValueError(f"xs[{b}]={x!r} has a character that is not a letter of the tokenizer") from err
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
    return input_ids, attention_mask


def decode_outputs(
    tokenizer: PreTrainedTokenizerBase, generated: LongTensor, prompt_len: int
) -> list[tuple[str, bool]]:
    """Read the outputs out of generated sequences ``[B, prompt_len + new]`` (prompt, then what was generated).

    Returns:
        One ``(text, ended_with_eos)`` per row: ``text`` holds the tokens after the prompt up to the first
        ``<eos>`` (exclusive). Special tokens generated before ``<eos>`` are kept in ``text`` (as
        ``"<sep>"`` etc.), so a malformed output never matches a letter string.
    """
    return decode_until_eos(tokenizer, generated, prompt_len, _special_id(tokenizer, "eos_token_id"))
