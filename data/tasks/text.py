"""The text task (`task.name: text`): experts own skill intervals in the responses of your own data.

Rows come from files (JSONL/JSON/Parquet/CSV, or a hub dataset where there is network) holding either a
`prompt` and a `response` field, or a chat `messages` list. Each expert trains on its own files
(`experts[i].data`) and owns the text inside its interval (`experts[i].interval`, see
`compose.intervals`): e.g. `<<48/2=24>>` for a calculator, `[CAT]` for shouting. `task.general` holds rows
that need no skill (background training and evaluation, regularizer rows); `task.compositional` holds
rows that need several skills at once (the composition's validation and test halves).

Row layout (the columns of `data.tasks.base`): `input_ids = prompt_ids + response_ids + [eos]`;
`targets` score the response and the EOS (`-100` on the prompt); each expert's mask row is
`token_interval_mask(response, offsets, spec)` placed at the target positions predicting the response
tokens (the EOS target is in no mask); `output_start`/`output_len` span the response tokens.

The prompt and the response are tokenized separately (the response with `add_special_tokens=False` and
offsets relative to it), so a token never merges across the prompt/response boundary; at inference the
composed model is prompted with exactly those prompt ids, so training and decoding agree. A prompt
always starts with the tokenizer's BOS token when it has one (added unless the text already starts with
it, e.g. through a chat template).
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from compose.intervals import (
    IntervalSpec,
    byte_piece_delimiters,
    check_balanced,
    interval_char_spans,
    token_interval_mask,
)
from compose.metrics import ExactMatch
from compose.operator import compose_logprobs
from data.collate import Collator, CorruptionRate
from data.foreign_spans import FOREIGN_POOLS, expert_pool, insert_foreign_spans, start_delimiter_length
from data.generation import greedy_decode
from data.rows import DataFileError, one_line, read_rows
from data.splits import derive_seed
from data.tasks import register_task
from data.tasks.base import (
    EVAL_SPLITS,
    EXPERT_FEATURES,
    ROW_FEATURES,
    SPLITS,
    Expert,
    Task,
    TaskError,
    check_split,
)
from data.tokenizer import TokenizerFolderError, load_tokenizer_folder
from losses import IGNORE_INDEX

TEACHER_FORCED_BATCH = 8  # rows per teacher-forced forward (k+1 components x [B, T, V] log-probs)


@dataclass
class TextConfig:
    """Settings of the text task (the `task:` config node with `name: text`).

    Attributes:
        tokenizer: a local Hugging Face tokenizer folder or a hub name; the pipeline's tokenizer (a
            pretrained model's) wins when it passes one. Must be a fast tokenizer (offset mapping).
        general: files of rows that need no skill: the background's training and held-out rows, and the
            experts' regularizer rows when `expert.reg_data` is `background` or `own+background`.
        compositional: files of rows that need several skills at once; shuffled with the run's seed and
            split in halves, the first (larger) half for validation, the other for test.
        holdout: rows of each expert's files, and of the general files, kept out of training for
            validation and test (halved between them, validation gets the odd one): a fraction if < 1,
            else a count; at least 2.
        prompt_field, response_field: the fields of prompt/response rows.
        messages_field: the field of chat rows: a list of `{"role", "content"}`; the prompt is every message
            before the last assistant message (rendered with the tokenizer's chat template,
            `add_generation_prompt=True`), the response is that message's content.
        chat_template: None: a file whose rows have `messages_field` is read as chat rows, otherwise as
            prompt/response rows; True/False: always/never chat rows.
        max_length: rows longer than this many tokens (prompt + response + EOS) are dropped (counted in
            `notes`).
        max_new_tokens: greedy decoding budget at evaluation; a prediction that has not emitted EOS by then
            counts as wrong.
        stop_strings: a prediction also ends before the first of these (e.g. `["\n"]` for a base model prompted
            with a pattern of one-line outputs: it goes on with the pattern's next line instead of emitting EOS).
        limit: at most this many rows per split of each source (each expert, general, compositional).
        eval_limit: at most this many held-out rows per split (`val`, `test`) of each source; the training rows
            stay whole (a shorter evaluation of the same training run).
        trust_remote_code: passed to `AutoTokenizer.from_pretrained` (`data.tokenizer.load_tokenizer_folder`).
        foreign_spans: `[min, max]`: each `own+foreign` regularizer row gets a number of random foreign spans
            drawn uniformly from this range (fewer where the response has fewer word boundaries). Raise `max`
            towards the number of other skills a composed row holds, so the expert meets as many spans as there.
        foreign_words: the random spans' words of letters are, half the time, real words (the general training
            rows' own, lowercase or uppercase) instead of random letters, so the spans' contents tokenize as the
            text inside another skill's interval does; still drawn without knowing any other skill.
        foreign_rewrites: in the experts' `own+foreign` rows, half the span contents not kept from the prompt are
            a rewrite of the prompt's contents by a fixed family of string transforms (letters shifted, vowels
            dropped, letters sorted, letters doubled: `data.foreign_spans.REWRITES`) instead of a fresh draw, as a
            real skill's output is a function of its input. The background's rows (`background_spans`) are
            unchanged, so a tuned background serves runs with and without it.
        foreign_pool: the delimiter pairs of the experts' random spans (`data.foreign_spans.expert_pool`):
            `brackets`, a fixed pool of ASCII and common bracket pairs; `brackets+unicode`, those and, as often,
            every opening/closing pair Unicode places side by side (`⟦⟧`, `⦃⦄`, `〔〕`...), so that an expert meets
            the continuation bytes of many multi-byte delimiters. The background's rows keep `brackets`.
        foreign_exclude: characters no expert's random span delimiter holds (e.g. a later expert's delimiter, to
            show that composing with it does not rest on the pool holding it).
        background_spans: the background's training rows are the general rows and, besides each, the same row
            with random foreign spans from the whole delimiter pool (`task.foreign_spans` of them; contents kept or
            redrawn in the response): a background tuned to the rows' format, spans included, so that no expert
            has to learn that part on its own (docs/own_models_and_data.md). Like every `background.*` training
            setting, it does nothing when `background.path` names an existing background.
        cross_eval: also decode the background and each expert alone on the compositional rows of the split
            (`compositional/exact_match`, `compositional/<expert>/skill_accuracy`, `compositional/off_interval_kl`)
            and the background on every expert's held-out rows (`<expert>/skill_accuracy`): every model's
            accuracy on every skill, next to the composition's. Costs that many more greedy decodings.
    """

    tokenizer: str | None = None
    general: list[str] = field(default_factory=list)
    compositional: list[str] = field(default_factory=list)
    holdout: float = 0.2
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    chat_template: bool | None = None
    max_length: int = 1024
    max_new_tokens: int = 256
    stop_strings: list[str] = field(default_factory=list)
    limit: int | None = None
    eval_limit: int | None = None
    trust_remote_code: bool = False
    foreign_spans: list[int] = field(default_factory=lambda: [1, 2])
    foreign_words: bool = False
    foreign_rewrites: bool = False
    foreign_pool: str = "brackets"
    foreign_exclude: str = ""
    background_spans: bool = False
    cross_eval: bool = False

    def __post_init__(self) -> None:
        if self.holdout <= 0 or (self.holdout >= 1 and self.holdout != int(self.holdout)):
            raise TaskError(f"task.holdout must be a fraction in (0, 1) or a whole count >= 1, got {self.holdout}")
        for key in ("max_length", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise TaskError(f"task.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("limit", "eval_limit"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise TaskError(f"task.{key} must be None or >= 1, got {getattr(self, key)}")
        for key in ("general", "compositional", "stop_strings"):
            value = getattr(self, key)
            if isinstance(value, str):
                setattr(self, key, [value])
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise TaskError(f"task.stop_strings must be non-empty strings, got {list(self.stop_strings)!r}")
        given = self.foreign_spans
        spans = list(given) if isinstance(given, Sequence) and not isinstance(given, str) else [given]
        if len(spans) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in spans) \
                or not 1 <= spans[0] <= spans[1]:
            raise TaskError(f"task.foreign_spans must be [min, max] whole counts with 1 <= min <= max, got {spans!r}")
        self.foreign_spans = spans
        if self.foreign_pool not in FOREIGN_POOLS:
            raise TaskError(f"task.foreign_pool must be one of {', '.join(FOREIGN_POOLS)}, got {self.foreign_pool!r}")


@dataclass(frozen=True)
class Example:
    """One prompt/response pair read from a file; `where` names it in errors ("FILE row N"). `foreign_spans`: in
    a row given random foreign spans, each span's `(start, end)` in the response, delimiters included."""

    prompt: str
    response: str
    where: str
    foreign_spans: tuple[tuple[int, int], ...] = ()


@dataclass
class Encoded:
    """An example tokenized: prompt ids (BOS first where the tokenizer has one), response ids, the
    response tokens' character offsets (relative to the response) and special-token flags."""

    example: Example
    prompt_ids: list[int]
    response_ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids) + 1


# --- reading files ---------------------------------------------------------------------------------
def read_examples(path: str, cfg: TextConfig, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    """Every row of `path` (read by `data.rows.read_rows`) as an `Example` (chat rows rendered with the
    tokenizer's chat template); a row that lacks a field or whose field is not text is one line naming it."""
    try:
        rows = read_rows(path)
    except DataFileError as err:
        raise TaskError(str(err)) from None
    columns = list(dict.fromkeys(key for row in rows for key in row.fields))
    if _is_chat(cfg, columns):
        if cfg.messages_field not in columns:
            raise TaskError(f"{path}: task.chat_template=true but the rows lack the field "
                            f"{cfg.messages_field!r} (they have {columns})")
        if not getattr(tokenizer, "chat_template", None):
            raise TaskError(f"{path}: rows are chat messages but the tokenizer has no chat template "
                            f"(set task.chat_template=false and give {cfg.prompt_field!r}/{cfg.response_field!r})")
        return [Example(*render_messages(row.fields.get(cfg.messages_field), tokenizer, row.where), row.where)
                for row in rows]
    fields = (cfg.prompt_field, cfg.response_field)
    missing = [f for f in fields if f not in columns]
    if missing:
        raise TaskError(f"{path}: rows lack the field(s) {missing} (they have {columns}; set task.prompt_field/"
                        f"task.response_field, or give a {cfg.messages_field!r} list)")
    out = []
    for row in rows:
        lacking = [f for f in fields if f not in row.fields]
        if lacking:
            raise TaskError(f"{row.where}: the row lacks the field(s) {lacking} (it has {list(row.fields)})")
        prompt, response = (row.fields[f] for f in fields)
        for key, value in zip(fields, (prompt, response), strict=True):
            if not isinstance(value, str):
                raise TaskError(f"{row.where}: field {key!r} is not text: {value!r:.80}")
        out.append(Example(prompt, response, row.where))
    return out


def _is_chat(cfg: TextConfig, columns: Sequence[str]) -> bool:
    return cfg.messages_field in columns if cfg.chat_template is None else bool(cfg.chat_template)


def render_messages(messages: Any, tokenizer: PreTrainedTokenizerBase, where: str) -> tuple[str, str]:
    """`(prompt, response)` of a chat row: the messages before the last assistant message, rendered with
    `add_generation_prompt=True`, and that message's content."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TaskError(f"{where}: messages must be a list of {{role, content}} objects, got {messages!r:.80}")
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise TaskError(f"{where}: messages have no assistant message (the response)")
    response = messages[last].get("content")
    if not isinstance(response, str):
        raise TaskError(f"{where}: the last assistant message's content is not text: {response!r:.80}")
    try:
        prompt = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - template errors are the row's
        raise TaskError(f"{where}: the chat template failed: {one_line(err)}") from None
    return prompt, response


# --- tokenizing and rows ---------------------------------------------------------------------------
def resolve_tokenizer(cfg: TextConfig, tokenizer: PreTrainedTokenizerBase | None) -> PreTrainedTokenizerBase:
    """The given tokenizer, else `cfg.tokenizer` loaded; must be fast (offsets) and have an EOS token."""
    if tokenizer is None:
        if not cfg.tokenizer:
            raise TaskError("task.tokenizer is not set (a local tokenizer folder or a hub name) and the "
                            "pipeline passed none")
        try:
            tokenizer = load_tokenizer_folder(cfg.tokenizer, where="task.tokenizer",
                                              trust_remote_code=cfg.trust_remote_code)
        except TokenizerFolderError as err:
            raise TaskError(str(err)) from None
    if not getattr(tokenizer, "is_fast", False):
        raise TaskError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer: the text task needs "
                        "offset mappings (use a tokenizer.json / PreTrainedTokenizerFast)")
    if tokenizer.eos_token_id is None:
        raise TaskError(f"tokenizer {type(tokenizer).__name__} has no EOS token (every response ends with it)")
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Prompt ids: `text` without added special tokens, BOS first when the tokenizer has one."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None and ids[:1] != [bos] else ids


def encode_examples(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> list[Encoded]:
    """Tokenize prompts and responses (responses in one batch, offsets relative to each response)."""
    if not examples:
        return []
    enc = tokenizer([e.response for e in examples], add_special_tokens=False, return_offsets_mapping=True)
    # Special tokens written inside the text (a literal "<eos>") are flagged too, as the detector skips them;
    # `return_special_tokens_mask` would flag only the ones the tokenizer added.
    special_ids = set(tokenizer.all_special_ids)
    out = []
    for i, e in enumerate(examples):
        prompt_ids = encode_prompt(tokenizer, e.prompt)
        if not prompt_ids:
            raise TaskError(f"{e.where}: empty prompt and the tokenizer has no BOS token: nothing predicts the "
                            "response's first token")
        out.append(Encoded(e, prompt_ids, list(enc["input_ids"][i]),
                           [tuple(o) for o in enc["offset_mapping"][i]],
                           [int(t in special_ids) for t in enc["input_ids"][i]]))
    return out


def response_mask(enc: Encoded, spec: IntervalSpec) -> list[int]:
    """The expert's mask of one row over the `targets` positions (1 where it predicts a token inside)."""
    try:
        inside = token_interval_mask(enc.example.response, enc.offsets, spec, enc.special)
    except ValueError as err:
        raise TaskError(f"{enc.example.where}: the tokenizer's offsets do not fit the interval masks: {err}") from None
    p = len(enc.prompt_ids)
    return [0] * (p - 1) + inside + [0, 0]


SPAN_POSITION_FEATURES = {  # expert rows: `after_close_positions`, `inside_foreign_positions`, `at_open_positions`
    column: datasets.List(datasets.Value("int8")) for column in ("after_close", "inside_foreign", "at_open")}


def after_close_positions(enc: Encoded, spec: IntervalSpec) -> list[int]:
    """1 at the target position predicting the first token after each interval of `spec` closes, and after each
    foreign span of the row (`Example.foreign_spans`): where the text goes on once a span is done (the EOS target
    when the span ends the response). Over the `targets` positions, as `response_mask`. The regularizer can weigh
    these positions more (`expert.reg_after_close`): there two experts that each drift a little drift alike."""
    ends = {b for _, b in interval_char_spans(enc.example.response, spec)} | {b for _, b in enc.example.foreign_spans}
    p, starts = len(enc.prompt_ids), [s for s, _ in enc.offsets]
    after = [0] * (p - 1) + [0] * len(starts) + [0, 0]
    for end in ends:  # the first token that begins at or after the end (a token straddling it is inside)
        j = next((j for j, s in enumerate(starts) if s >= end and not enc.special[j]), len(starts))
        after[p - 1 + j] = 1
    return after


def at_open_positions(enc: Encoded, spec: IntervalSpec) -> list[int]:
    """1 at the target position predicting the token that holds the first character of each start delimiter: of
    `spec`'s intervals and of each foreign span of the row (`Example.foreign_spans`), over the `targets` positions
    as `response_mask`. There the text chooses to open a span, which in a composition is another expert's (or
    this one's) interval: an expert that lowers the opening a little, beside others that do too, keeps it from
    being written (`expert.reg_at_open` weighs these positions more)."""
    response = enc.example.response
    opens = {a - start_delimiter_length(response, a, spec) for a, _ in interval_char_spans(response, spec)}
    opens |= {a for a, _ in enc.example.foreign_spans}
    p = len(enc.prompt_ids)
    marks = [0] * (p - 1) + [0] * len(enc.offsets) + [0, 0]
    for start in opens:  # the token that holds it (a token holding the space before it and the delimiter too)
        j = next((j for j, (_, e) in enumerate(enc.offsets) if e > start and not enc.special[j]), None)
        if j is not None:
            marks[p - 1 + j] = 1
    return marks


def inside_foreign_positions(enc: Encoded) -> list[int]:
    """1 at each target position predicting a token that begins inside a random foreign span of the row
    (`Example.foreign_spans`; a token holding the space before the span and its start delimiter begins outside, as
    an interval's mask starts after its opening), over the `targets` positions as `response_mask`. There a
    composition has another expert active, and whatever this expert changes is multiplied into that expert's
    choice (`expert.reg_inside_foreign` weighs these positions more)."""
    spans = enc.example.foreign_spans
    inside = [int(not enc.special[j] and any(a <= s < b for a, b in spans)) for j, (s, _) in enumerate(enc.offsets)]
    return [0] * (len(enc.prompt_ids) - 1) + inside + [0, 0]


def make_row(enc: Encoded, specs: Sequence[IntervalSpec], eos: int, **extra: Any) -> dict[str, Any]:
    """One row (columns of `data.tasks.base`) with one mask per spec."""
    p, response = len(enc.prompt_ids), enc.response_ids
    return {
        "input_ids": enc.prompt_ids + response + [eos],
        "targets": [IGNORE_INDEX] * (p - 1) + response + [eos, IGNORE_INDEX],
        "masks": [response_mask(enc, spec) for spec in specs],
        "output_start": p,
        "output_len": len(response),
        "x": enc.example.prompt,
        "y": enc.example.response,
        **extra,
    }


def rows_to_dataset(rows: Sequence[dict[str, Any]], expert_columns: bool = False) -> datasets.Dataset:
    """Rows as a `datasets.Dataset` with fixed column types (also when there are none)."""
    features = datasets.Features({**ROW_FEATURES, **(EXPERT_FEATURES | SPAN_POSITION_FEATURES if expert_columns else {})})
    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in features}, features=features)


# --- evaluation helpers ----------------------------------------------------------------------------
def normalize_whitespace(text: str) -> str:
    """Runs of whitespace collapsed to one space, ends stripped."""
    return " ".join(text.split())


def exact_match(preds: Sequence[str], refs: Sequence[str], ended: Sequence[bool]) -> float:
    """Fraction of predictions that ended with EOS and equal their reference after `normalize_whitespace`."""
    metric = ExactMatch()
    metric.update([normalize_whitespace(p) for p in preds], [normalize_whitespace(r) for r in refs], ended)
    return float(metric.compute())


def interval_texts(text: str, spec: IntervalSpec) -> list[str]:
    """The text inside each interval of `text` (content plus end delimiter; an interval still open at the
    end runs to the end), whitespace-normalized."""
    return [normalize_whitespace(text[a:b]) for a, b in interval_char_spans(text, spec)]


def skill_counts(preds: Sequence[str], refs: Sequence[str], spec: IntervalSpec) -> tuple[int, int]:
    """`(correct, total)` over the reference intervals of `spec`: the i-th interval of a reference is correct
    iff the prediction has an i-th interval with the same text (matched by order of occurrence)."""
    correct = total = 0
    for pred, ref in zip(preds, refs, strict=True):
        wanted, got = interval_texts(ref, spec), interval_texts(pred, spec)
        total += len(wanted)
        correct += sum(i < len(got) and got[i] == w for i, w in enumerate(wanted))
    return correct, total


def missing_intervals(preds: Sequence[str], refs: Sequence[str], spec: IntervalSpec) -> int:
    """How many reference intervals of `spec` have no counterpart at all in the prediction (its i-th interval
    is missing: the prediction wrote fewer of them), as against written with the wrong text."""
    return sum(max(0, len(interval_texts(ref, spec)) - len(interval_texts(pred, spec)))
               for pred, ref in zip(preds, refs, strict=True))


# --- the task --------------------------------------------------------------------------------------
@register_task("text")
class TextTask(Task):
    """Experts own skill intervals (`experts[i].interval`) in the responses of text rows.

    Splits (all seeded with the run's seed and the source's name, so adding an expert leaves the
    others' splits unchanged): each expert's rows and the general rows lose `task.holdout` rows to
    validation/test (halved); the compositional rows are halved into validation and test.
    Regularizer rows, as many as the expert has training rows (drawn without replacement, cycling if the pool
    has fewer), each with the expert's own mask (all zero on rows without its interval), by `reg_data`:
    `background`/`own+background`: general training rows (`is_task=0`, `task_on_mask=0`); `own+samples`: the
    general training prompts with the background's own sampled continuations as responses (drawn and cached by
    the pipeline, `set_background_samples`; samples holding the expert's own delimiters are left out);
    `own+foreign`: general and own training rows in turn, each with random foreign spans (one or two unless
    `task.foreign_spans` says otherwise; `data.foreign_spans`; own rows keep `task_on_mask=1`, so the skill is
    learnt beside a foreign span too).
    None of them holds anything of another expert: an expert trained alone on them has never met the others.
    `reg_data=composition` needs co-training on composed rows, which this task does not make.
    """

    config_class = TextConfig
    extra_reg_data = ("own+samples", "own+foreign")
    marks_span_positions = True

    def __init__(self, cfg: TextConfig, experts: Sequence[Expert], *, tokenizer: PreTrainedTokenizerBase | None = None,
                 **kwargs: Any) -> None:
        super().__init__(cfg, experts, tokenizer=tokenizer, **kwargs)
        if self.reg_data in ("composition", "random_rules"):
            raise TaskError(f"expert.reg_data={self.reg_data} needs rows rewritten by skills (every expert's, or "
                            "random letter rules); the text task has none: use own, background or own+background")
        for key in ("general", "compositional"):
            if not getattr(cfg, key):
                raise TaskError(f"task.{key} is empty: give at least one data file")
        self._notes: list[str] = []
        self._tokenizer = resolve_tokenizer(cfg, tokenizer)
        if tokenizer is not None and cfg.tokenizer:
            self._notes.append(f"task.tokenizer={cfg.tokenizer!r} was not used: the pipeline passed a tokenizer")
        self.eos = int(self._tokenizer.eos_token_id)
        pad = self._tokenizer.pad_token_id
        self.pad = self.eos if pad is None else int(pad)
        self.specs = [_parse_spec(i, e) for i, e in enumerate(self.experts)]
        self._datasets: dict[tuple[str, str], datasets.Dataset] = {}
        self._samples: list[Encoded] | None = None  # own+samples: the background's continuations
        self._load_and_check()

    # --- construction ------------------------------------------------------------------------------
    def _read(self, paths: Sequence[str]) -> list[Example]:
        return [ex for path in paths for ex in read_examples(str(path), self.cfg, self._tokenizer)]

    def _load_and_check(self) -> None:
        """Read every file, check rows and specs, split and tokenize (everything before training)."""
        general = self._read(self.cfg.general)
        compositional = self._read(self.cfg.compositional)
        own: dict[str, list[Example]] = {}
        for i, e in enumerate(self.experts):
            if not e.data and e.name in self.trained:
                raise TaskError(f"experts[{i}] ({e.name}).data is empty: a trained expert needs its data files")
            if e.data:
                own[e.name] = self._read(e.data)
                self._check_expert_rows(i, own[e.name])
        self._check_general(general)
        self._check_compositional(compositional)
        self._note_byte_pieces()
        self.general = self._split_encode("general", general, holdout=True)
        self.compositional = self._split_encode("compositional", compositional, holdout=False)
        self.own = {name: self._split_encode(f"expert {name!r}", rows, holdout=True) for name, rows in own.items()}
        self._check_overlaps()
        self._check_budget()

    def _check_expert_rows(self, i: int, examples: Sequence[Example]) -> None:
        """The expert's delimiters occur in its training rows, and every row balances its interval."""
        e, spec = self.experts[i], self.specs[i]
        texts = [ex.response for ex in examples]
        for key, delimiter in (("start", spec.start), ("end", spec.end)):
            found = any(re.search(delimiter, t) for t in texts) if spec.regex else any(delimiter in t for t in texts)
            if not found:
                raise TaskError(f"experts[{i}] ({e.name}).interval.{key}={delimiter!r} never occurs in the responses "
                                f"of its training rows ({', '.join(map(str, e.data))})")
        for ex in examples:
            _check_row_balanced(ex, spec, e.name)

    def _note_byte_pieces(self) -> None:
        """Note each expert whose delimiters the tokenizer writes with byte pieces (`byte_piece_delimiters`)."""
        for name, spec in zip(self.expert_names, self.specs, strict=True):
            if pieces := byte_piece_delimiters(spec, self._tokenizer):
                self._notes.append(f"expert {name!r}: the tokenizer writes {', '.join(map(repr, pieces))} with byte "
                                   "pieces, where a few experts' small rises of a sibling piece can overturn the "
                                   "background under the product rule; delimiters of whole tokens compose safer")

    def _check_general(self, examples: Sequence[Example]) -> None:
        """General rows balance every interval (regularizer rows carry the masks); count those that hold one."""
        for name, spec in zip(self.expert_names, self.specs, strict=True):
            n = 0
            for ex in examples:
                _check_row_balanced(ex, spec, name)
                n += bool(interval_char_spans(ex.response, spec))
            if n:
                self._notes.append(f"{n} of {len(examples)} general rows hold an interval of expert {name!r} "
                                   "(the background learns it there)")

    def _check_compositional(self, examples: Sequence[Example]) -> None:
        """Compositional rows balance every interval, and some hold an interval of some expert (rows holding none
        are noted: a run of some of the experts a test set was written for sees such rows)."""
        counts, without = [0] * len(self.specs), []
        for ex in examples:
            found = False
            for j, (name, spec) in enumerate(zip(self.expert_names, self.specs, strict=True)):
                _check_row_balanced(ex, spec, name)
                if interval_char_spans(ex.response, spec):
                    counts[j] += 1
                    found = True
            if not found:
                without.append(ex)
        if examples and len(without) == len(examples):
            raise TaskError(f"{examples[0].where.rsplit(' line ', 1)[0]}: no compositional row holds an interval of "
                            f"any expert ({', '.join(self.expert_names)})")
        if without:
            self._notes.append(f"{len(without)} of {len(examples)} compositional rows hold no interval of these "
                               f"experts (first: {without[0].where})")
        for name, n in zip(self.expert_names, counts, strict=True):
            if n < len(examples):
                self._notes.append(f"expert {name!r} has an interval in {n} of {len(examples)} compositional rows")

    def _split_encode(self, source: str, examples: Sequence[Example], holdout: bool) -> dict[str, list[Encoded]]:
        """Seeded split of `examples` (train/val/test, or val/test), `limit`ed, tokenized, too long dropped."""
        order = list(range(len(examples)))
        _shuffle(order, derive_seed(self.seed, "text", source))
        if holdout:
            n_hold = self._n_holdout(source, len(order))
            held, parts = order[:n_hold], {"train": order[n_hold:]}
        else:
            held, parts = order, {}
            if len(held) < 2:
                raise TaskError(f"task.compositional has {len(held)} row(s); need >= 2 (val and test halves)")
        half = (len(held) + 1) // 2
        parts |= {"val": held[:half], "test": held[half:]}
        out = {}
        for split, idx in parts.items():
            if self.cfg.limit is not None:
                idx = idx[: self.cfg.limit]
            if split != "train" and self.cfg.eval_limit is not None:
                idx = idx[: self.cfg.eval_limit]
            encoded = encode_examples(self._tokenizer, [examples[i] for i in idx])
            kept = [enc for enc in encoded if len(enc) <= self.cfg.max_length]
            if len(kept) < len(encoded):
                self._notes.append(f"{source} {split}: dropped {len(encoded) - len(kept)} of {len(encoded)} rows "
                                   f"longer than task.max_length={self.cfg.max_length} tokens")
            if not kept:
                raise TaskError(f"{source}: no {split} row left (task.max_length={self.cfg.max_length}, "
                                f"task.holdout={self.cfg.holdout})")
            out[split] = kept
        return out

    def _n_holdout(self, source: str, n: int) -> int:
        h = self.cfg.holdout
        n_hold = round(h * n) if h < 1 else int(h)
        n_hold = max(n_hold, 2)
        if n_hold >= n:
            raise TaskError(f"{source}: {n} rows cannot give task.holdout={h} (>= 2) held-out rows and keep "
                            "training rows")
        return n_hold

    def _check_overlaps(self) -> None:
        """Two experts' masks must not share a position of a compositional row (unless allow_overlap)."""
        k = len(self.specs)
        for split, encoded in self.compositional.items():
            for enc in encoded:
                masks = [response_mask(enc, spec) for spec in self.specs]
                for a in range(k):
                    for b in range(a + 1, k):
                        if any(x and y for x, y in zip(masks[a], masks[b], strict=True)):
                            pair = f"experts {self.expert_names[a]!r} and {self.expert_names[b]!r}"
                            if not self.allow_overlap:
                                raise TaskError(f"{enc.example.where}: the intervals of {pair} overlap (set "
                                                "allow_overlap to accept it)")
                            self._notes.append(f"the intervals of {pair} overlap on compositional rows ({split})")
                            return

    def _check_budget(self) -> None:
        longest = max((len(enc.response_ids) + 1 for part in self._eval_parts() for enc in part), default=0)
        if longest > self.cfg.max_new_tokens:
            self._notes.append(f"task.max_new_tokens={self.cfg.max_new_tokens} is below the longest held-out "
                               f"response ({longest} tokens with EOS): those rows cannot match")

    def _eval_parts(self) -> list[list[Encoded]]:
        sources = [self.general, self.compositional, *self.own.values()]
        return [source[split] for source in sources for split in EVAL_SPLITS]

    # --- what the pipeline reads -------------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    @property
    def corruption_ids(self) -> list[int]:
        """Every non-special token id (what prefix corruption writes)."""
        special = set(self._tokenizer.all_special_ids)
        return sorted(i for i in self._tokenizer.get_vocab().values() if i not in special)

    def collator(self, corruption_prob: CorruptionRate = 0.0) -> Collator:
        return Collator(self.pad, self.corruption_ids, corruption_prob)

    def background_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, SPLITS)
        def rows() -> datasets.Dataset:
            general = list(self.general[split])
            if split == "train" and self.cfg.background_spans:
                spanned = self.spanned(general, None, derive_seed(self.seed, "text", "background spans"))
                general += [enc for enc in spanned if len(enc) <= self.cfg.max_length]
            return rows_to_dataset([make_row(enc, [], self.eos) for enc in general])

        return self._cached(("background", split), rows)

    def expert_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, SPLITS)
        return self._cached(("experts", split), lambda: rows_to_dataset(self._expert_rows(split), expert_columns=True))

    def _expert_rows(self, split: str) -> list[dict[str, Any]]:
        rows = []
        for j, name in enumerate(self.trained):
            spec = self.specs[self.expert_names.index(name)]
            own = self.own[name][split]
            row = functools.partial(self._expert_row, spec=spec, expert_index=j)
            rows += [row(enc, 1, 1) for enc in own]
            if split == "train" and self.reg_data in ("background", "own+background"):
                rows += [row(enc, 0, 0) for enc in self._regularizer_examples(name, len(own), self.general["train"])]
            elif split == "train" and self.reg_data == "own+samples":
                rows += [row(enc, 0, 0)
                         for enc in self._regularizer_examples(name, len(own), self._sampled_pool(name, spec))]
            elif split == "train" and self.reg_data == "own+foreign":
                rows += [row(enc, 0, int(from_own)) for enc, from_own in self._foreign_examples(name, spec, len(own))]
        return rows

    def _expert_row(self, enc: Encoded, is_task: int, task_on_mask: int, *, spec: IntervalSpec,
                    expert_index: int) -> dict[str, Any]:
        return make_row(enc, [spec], self.eos, expert_index=expert_index, is_task=is_task, task_on_mask=task_on_mask,
                        after_close=after_close_positions(enc, spec), inside_foreign=inside_foreign_positions(enc),
                        at_open=at_open_positions(enc, spec))

    def _regularizer_examples(self, name: str, n: int, pool: Sequence[Encoded]) -> list[Encoded]:
        if not pool:
            raise TaskError(f"expert {name!r}: no regularizer row to draw from (reg_data={self.reg_data})")
        order = list(range(len(pool)))
        _shuffle(order, derive_seed(self.seed, "text", "regularizer", name))
        return [pool[order[i % len(order)]] for i in range(n)]

    def background_sample_prompts(self) -> list[list[int]]:
        """The general training rows' prompt ids (`reg_data=own+samples` regularizes on their continuations)."""
        return [enc.prompt_ids for enc in self.general["train"]] if self.reg_data == "own+samples" else []

    def set_background_samples(self, responses: Sequence[str]) -> None:
        """The background's sampled continuation of each general training prompt, in order."""
        rows = self.general["train"]
        if len(responses) != len(rows):
            raise TaskError(f"{len(responses)} background samples for {len(rows)} general training prompts")
        examples = [Example(enc.example.prompt, text, f"{enc.example.where} (background sample)")
                    for enc, text in zip(rows, responses, strict=True)]
        self._samples = [enc for enc in encode_examples(self._tokenizer, examples) if len(enc) <= self.cfg.max_length]
        self._datasets.pop(("experts", "train"), None)

    def _sampled_pool(self, name: str, spec: IntervalSpec) -> list[Encoded]:
        """The background samples that hold none of the expert's own delimiters."""
        if self._samples is None:
            raise TaskError("expert.reg_data=own+samples: the background's samples are not drawn yet "
                            "(lightning_modules.pipeline.reg_samples.draw_background_samples)")
        return [enc for enc in self._samples if not _holds_delimiter(enc.example.response, spec)]

    def _foreign_examples(self, name: str, spec: IntervalSpec, n: int) -> list[tuple[Encoded, bool]]:
        """`n` rows with random foreign spans (`data.foreign_spans`), from general and own training rows in turn
        (seeded by the run's seed and the expert's name); `(row, from its own rows)`."""
        general = self._regularizer_examples(name, (n + 1) // 2, self.general["train"])
        own = self._regularizer_examples(name, n // 2, self.own[name]["train"])
        sources = [(enc, i % 2 == 1) for i, enc in enumerate(_interleave(general, own))]
        pool = expert_pool(spec, self.cfg.foreign_pool, self.cfg.foreign_exclude)
        if not pool:
            raise TaskError(f"expert {name!r}: no foreign span delimiter pair is free of its own delimiters "
                            f"({spec.start!r}, {spec.end!r}) and of task.foreign_exclude {self.cfg.foreign_exclude!r}")
        encoded = self.spanned([enc for enc, _ in sources], spec, derive_seed(self.seed, "text", "foreign", name),
                               pool=pool, rewrite=self.cfg.foreign_rewrites)
        return [(enc, from_own) for enc, (_, from_own) in zip(encoded, sources, strict=True)
                if len(enc) <= self.cfg.max_length]

    def spanned(self, rows: Sequence[Encoded], own: IntervalSpec | None, seed: int,
                pool: Sequence[tuple[str, str]] | None = None, rewrite: bool = False) -> list[Encoded]:
        """`rows` with random foreign spans (`data.foreign_spans`; `own`: the expert's interval they keep clear of,
        None for the background; `pool`: the delimiter pairs to draw from, by default those `own` allows;
        `rewrite`: some contents rewritten rather than redrawn, `insert_foreign_spans`),
        re-encoded, one for each row (the caller drops those past `task.max_length`)."""
        rng = random.Random(seed)
        words = self._general_words() if self.cfg.foreign_words else ()
        examples = []
        for enc in rows:
            prompt, response, spans = insert_foreign_spans(enc.example.prompt, enc.example.response, own, rng,
                                                           n_spans=rng.randint(*self.cfg.foreign_spans), pool=pool,
                                                           words=words, rewrite=rewrite)
            examples.append(Example(prompt, response, f"{enc.example.where} (foreign spans)", tuple(spans)))
        return encode_examples(self._tokenizer, examples)

    def _general_words(self) -> list[str]:
        """The distinct words of letters (two or more, lowercased) of the general training responses, sorted."""
        return sorted({w.lower() for enc in self.general["train"]
                       for w in re.findall(r"[A-Za-z]{2,}", enc.example.response)})

    def compositional_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, EVAL_SPLITS)
        return self._cached(("compositional", split),
                            lambda: rows_to_dataset([make_row(enc, self.specs, self.eos)
                                                     for enc in self.compositional[split]]))

    def _cached(self, key: tuple[str, str], build) -> datasets.Dataset:
        if key not in self._datasets:
            self._datasets[key] = build()
        return self._datasets[key]

    # --- evaluation --------------------------------------------------------------------------------
    def greedy_outputs(self, model, prompts: Sequence[Sequence[int]], batch_size: int) -> tuple[list[str], list[bool]]:
        """Greedy outputs of `model` (a `ComposedLM`) for prompt ids, up to EOS, and whether each ended."""
        return greedy_decode(model, self._tokenizer, prompts, batch_size, self.cfg.max_new_tokens,
                             stop_strings=self.cfg.stop_strings)

    def _decode_rows(self, model, input_ids: Sequence[Sequence[int]], output_start: Sequence[int],
                     batch_size: int) -> tuple[list[str], list[bool]]:
        prompts = [list(ids[:s]) for ids, s in zip(input_ids, output_start, strict=True)]
        return self.greedy_outputs(model, prompts, batch_size)

    def evaluate_background(self, model, split: str, batch_size: int) -> dict[str, float]:
        """Exact match (whitespace-normalized, ended with EOS) on the held-out general rows, and their
        `general_perplexity` when `model` scores (a `ComposedLM`). With `task.cross_eval`: each expert's skill
        accuracy on its held-out rows (`<expert>/skill_accuracy`) and the `compositional/*` metrics."""
        check_split(split, EVAL_SPLITS)
        rows = self.general[split]
        preds, ended = self.greedy_outputs(model, [enc.prompt_ids for enc in rows], batch_size)
        results = {"exact_match": exact_match(preds, [enc.example.response for enc in rows], ended),
                   "n_test": len(rows)}
        if self.cfg.cross_eval:
            for name, spec in zip(self.expert_names, self.specs, strict=True):
                if name in self.own:
                    own = self.own[name][split]
                    preds, _ = self.greedy_outputs(model, [enc.prompt_ids for enc in own], batch_size)
                    correct, total = skill_counts(preds, [enc.example.response for enc in own], spec)
                    if total:
                        results[f"{name}/skill_accuracy"] = correct / total
                        results[f"{name}/skill_accuracy_n"] = total
        return results | self._model_extras(model, split, batch_size)

    def evaluate_expert(self, model, name: str, split: str, batch_size: int) -> dict[str, float]:
        """Exact match and `skill_accuracy` (its intervals right, by order) on the expert's held-out rows, and
        `general_perplexity` when `model` scores; with `task.cross_eval` the `compositional/*` metrics too."""
        check_split(split, EVAL_SPLITS)
        if name not in self.own:
            raise TaskError(f"expert {name!r} has no data files here: nothing to evaluate it on")
        rows = self.own[name][split]
        refs = [enc.example.response for enc in rows]
        preds, ended = self.greedy_outputs(model, [enc.prompt_ids for enc in rows], batch_size)
        results = {"exact_match": exact_match(preds, refs, ended), "n_test": len(rows)}
        correct, total = skill_counts(preds, refs, self.specs[self.expert_names.index(name)])
        if total:
            results["skill_accuracy"], results["skill_accuracy_n"] = correct / total, total
        return results | self._model_extras(model, split, batch_size)

    def _model_extras(self, model, split: str, batch_size: int) -> dict[str, float]:
        """`general_perplexity` (when `model` scores) and, with `task.cross_eval`, `compositional/<key>` for every
        key of `evaluate_composition` on the compositional rows of `split` (but its general perplexity)."""
        results = {}
        if _scores(model):
            results["general_perplexity"] = self.general_perplexity(model, split, batch_size)
        if self.cfg.cross_eval:
            comp = self._evaluate_composition(model, self.compositional_dataset(split), batch_size, split=None)
            results |= {f"compositional/{key}": value for key, value in comp.items()}
        return results

    def evaluate_composition(self, model, dataset: datasets.Dataset, batch_size: int) -> dict[str, float]:
        """Exact match, `<expert>/skill_accuracy` per expert with an interval in the references (the i-th
        interval of the reference against the i-th of the prediction), `<expert>/intervals_missing` (the share of
        them the prediction does not write at all, `missing_intervals`), and `failures/no_eos`. When `model`
        scores (a `ComposedLM`, soft or gated), also `off_interval_kl` on `dataset` and `general_perplexity` on
        the held-out general rows of the split `dataset` comes from (see `off_interval_kl`,
        `general_perplexity`)."""
        return self._evaluate_composition(model, dataset, batch_size, split=self._split_of(dataset))

    def _evaluate_composition(self, model, dataset: datasets.Dataset, batch_size: int,
                              split: str | None) -> dict[str, float]:
        refs = list(dataset["y"])
        preds, ended = self._decode_rows(model, dataset["input_ids"], dataset["output_start"], batch_size)
        results = {"exact_match": exact_match(preds, refs, ended), "exact_match_n": len(refs)}
        for name, spec in zip(self.expert_names, self.specs, strict=True):
            correct, total = skill_counts(preds, refs, spec)
            if total:
                results[f"{name}/skill_accuracy"] = correct / total
                results[f"{name}/skill_accuracy_n"] = total
                results[f"{name}/intervals_missing"] = missing_intervals(preds, refs, spec) / total
        results["failures/no_eos"] = 1.0 - sum(ended) / len(ended) if ended else 0.0
        if _scores(model):
            results["off_interval_kl"] = self.off_interval_kl(model, dataset, batch_size)
            if split is not None:
                results["general_perplexity"] = self.general_perplexity(model, split, batch_size)
        return results

    # --- teacher-forced scores of any model on the task's rows -------------------------------------
    def general_perplexity(self, model, split: str, batch_size: int) -> float:
        """exp(mean NLL per token) of `model`'s (composed, gated when `model.composition == "gated"`)
        teacher-forced distribution on the responses + EOS of the held-out general rows of `split`: how much a
        model that should leave general text alone costs it (compare with the background's)."""
        check_split(split, EVAL_SPLITS)
        key = ("general_scored", split)
        if key not in self._datasets:
            self._datasets[key] = rows_to_dataset([make_row(enc, self.specs, self.eos) for enc in self.general[split]])
        nll, n, _, _ = self._teacher_forced(model, self._datasets[key], batch_size)
        return math.exp(nll / n) if n else float("nan")

    def off_interval_kl(self, model, dataset: datasets.Dataset, batch_size: int) -> float:
        """Mean KL(p_b ‖ p_model) over the target positions of `dataset` (rows with one mask per expert in play)
        that lie in no expert's interval: how far `model` moves the text the background owns (0 for the
        background, and for a gated composition by construction)."""
        _, _, kl, n = self._teacher_forced(model, dataset, batch_size)
        return kl / n if n else 0.0

    @torch.no_grad()
    def _teacher_forced(self, model, dataset: datasets.Dataset, batch_size: int) -> tuple[float, int, float, int]:
        """`(sum NLL, scored tokens, sum off-interval KL(p_b ‖ p_model), off-interval tokens)` of `model`
        teacher-forced on `dataset`. A gated model gates each expert with an interval spec by the rows' masks
        (the teacher-forced stopping times, as `token_interval_mask` computes them); the others act everywhere."""
        collate = self.collator()
        gated = getattr(model, "composition", "soft") == "gated"
        columns = [self.expert_names.index(n) if n in self.expert_names else None for n in model.names]
        specs = getattr(model, "specs", None) or [{} for _ in model.names]
        nll = kl = 0.0
        n = n_off = 0
        rows = [dataset[i] for i in range(len(dataset))]
        for start in range(0, len(rows), max(1, min(batch_size, TEACHER_FORCED_BATCH))):
            batch = collate(rows[start:start + max(1, min(batch_size, TEACHER_FORCED_BATCH))])
            lp_b, lp_e = model.component_logprobs(batch["input_ids"], batch["attention_mask"])
            targets, masks = batch["targets"].to(lp_b.device), batch["masks"].to(lp_b.device)  # masks [B, k, T]
            gates = None
            if gated and lp_e.shape[0]:
                always = torch.ones_like(targets, dtype=torch.bool)
                gates = torch.stack([masks[:, j] if j is not None and "interval" in spec else always
                                     for j, spec in zip(columns, specs, strict=True)])
            lp = compose_logprobs(lp_b, lp_e, model.weights, gates, model.min_logprob)
            valid = targets != IGNORE_INDEX
            token_lp = lp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            nll -= float(token_lp[valid].sum())
            n += int(valid.sum())
            off = valid & ~masks.any(1)
            if off.any():
                lp_b_off = lp_b[off].float()
                kl += float((lp_b_off.exp() * (lp_b_off - lp[off])).sum())
                n_off += int(off.sum())
        return nll, n, kl, n_off

    def _split_of(self, dataset: datasets.Dataset) -> str | None:
        """The split (`val`/`test`) whose compositional rows `dataset` holds (most of its inputs), else None."""
        xs = list(dataset["x"])
        for split in EVAL_SPLITS:
            known = {enc.example.prompt for enc in self.compositional[split]}
            if xs and sum(x in known for x in xs) * 2 > len(xs):
                return split
        return None


# --- small helpers ---------------------------------------------------------------------------------
def _scores(model) -> bool:
    """Whether `model` scores teacher-forced (a `ComposedLM`); a decoding-only stand-in does not."""
    return callable(getattr(model, "component_logprobs", None))


def _parse_spec(i: int, expert: Expert) -> IntervalSpec:
    if "interval" not in expert.spec:
        raise TaskError(f"experts[{i}] ({expert.name}): the text task needs `interval` (start/end delimiters), "
                        f"got {sorted(expert.spec) or 'none'}")
    try:
        return IntervalSpec.from_dict(expert.spec["interval"])
    except ValueError as err:
        raise TaskError(f"experts[{i}] ({expert.name}).interval: {err}") from None


def _check_row_balanced(ex: Example, spec: IntervalSpec, name: str) -> None:
    try:
        check_balanced(ex.response, spec)
    except ValueError as err:
        raise TaskError(f"{ex.where}: response does not balance expert {name!r}'s interval: {err}") from None


def _holds_delimiter(text: str, spec: IntervalSpec) -> bool:
    if spec.regex:
        return any(re.search(p, text) for p in (spec.start, spec.end))
    return spec.start in text or spec.end in text


def _interleave(a: Sequence[Encoded], b: Sequence[Encoded]) -> list[Encoded]:
    """a[0], b[0], a[1], b[1], ... (the rest of the longer one at the end)."""
    out = [x for pair in zip(a, b, strict=False) for x in pair]
    return out + list(a[len(b):]) + list(b[len(a):])


def _shuffle(items: list[int], seed: int) -> None:
    """In-place seeded shuffle, independent of every global RNG."""
    random.Random(seed).shuffle(items)
