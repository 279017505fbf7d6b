"""Skill intervals: spec validation, tracker semantics, and masks == stopping-time detectors on real tokenizers."""

from __future__ import annotations

import random

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from compose.intervals import (
    MAX_PENDING_TOKENS,
    IncrementalDetokenizer,
    IntervalSpec,
    IntervalTracker,
    StoppingTimeDetector,
    byte_piece_delimiters,
    check_balanced,
    interval_char_spans,
    open_states,
    token_interval_mask,
)

BRACKETS = IntervalSpec("[", "]")
ANGLES = IntervalSpec("<<", ">>")
FENCE = IntervalSpec(r"```\w*\n", "```", regex=True)
SPECS = [
    BRACKETS,
    ANGLES,
    IntervalSpec("=2", "]b"),
    IntervalSpec("]", "["),
    IntervalSpec("a]", "€"),
    IntervalSpec(r"\[a+", r"\]", regex=True),
    IntervalSpec(r"<+", r">{2}|=", regex=True),
]
SPECIALS = ["<pad>", "<eos>"]


def states_str(text: str, spec) -> str:
    return "".join("1" if s else "0" for s in open_states(text, spec))


# ---------------------------------------------------------------------------------------------- spec


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"end": "]"}, "'start' is missing"),
        ({"start": "", "end": "]"}, "'start' is missing or empty"),
        ({"start": "["}, "'end' is missing"),
        ({"start": "[", "end": "]", "stop": "x"}, r"unknown key\(s\) \['stop'\]"),
        ({"start": "(", "end": "]", "regex": True}, "'start' regex '\\(' does not compile: missing \\)"),
        ({"start": "a", "end": "b[", "regex": True}, "'end' regex 'b\\[' does not compile"),
        ({"start": "a*", "end": "b", "regex": True}, "'start' regex 'a\\*' can match the empty string"),
        ({"start": "a", "end": r"\b", "regex": True}, "'end' regex .* can match the empty string"),
        ({"start": "a", "end": "b", "regex": "yes"}, "'regex' must be true or false"),
        ({"start": "a", "end": "b", "max_delimiter_chars": 0}, "positive integer"),
        (["[", "]"], "must be a mapping"),
    ],
)
def test_spec_errors(d, match):
    with pytest.raises(ValueError, match=match):
        IntervalSpec.from_dict(d)


def test_spec_roundtrip_and_omegaconf():
    d = {"start": r"```\w*\n", "end": "```", "regex": True}
    assert IntervalSpec.from_dict(d) == FENCE and FENCE.to_dict() == d
    assert IntervalSpec.from_dict(OmegaConf.create({"start": "[", "end": "]"})) == BRACKETS
    assert BRACKETS.to_dict() == {"start": "[", "end": "]", "regex": False}
    odd = IntervalSpec("a", "b", max_delimiter_chars=8)
    assert IntervalSpec.from_dict(odd.to_dict()) == odd


# ---------------------------------------------------------------------------------------------- tracker


def test_tracker_hand_examples():
    # start delimiter outside, end delimiter inside; nested start while open is text; end while closed is text
    assert states_str("a[b]c", BRACKETS) == "001100"
    assert states_str("[[a]]", BRACKETS) == "011100"
    assert states_str("]a[", BRACKETS) == "0001"
    assert states_str("x<<y>>z", ANGLES) == "00011100"
    assert states_str("<<<>>", ANGLES) == "001110"  # the third '<' is content
    # delimiters do not overlap the previous one: '<<>' does not close with end '<>'
    assert states_str("<<>", IntervalSpec("<<", "<>")) == "0011"
    assert states_str("<<<>", IntervalSpec("<<", "<>")) == "00110"
    # start == end
    assert states_str("$a$b$", IntervalSpec("$", "$")) == "011001"
    assert interval_char_spans("a[b]c[d", BRACKETS) == [(2, 4), (6, 7)]


def test_tracker_regex_fence():
    text = "x```py\ncode```y```\nz```"
    spans = interval_char_spans(text, FENCE)
    assert [text[a:b] for a, b in spans] == ["code```", "z```"]
    check_balanced(text, FENCE)  # the fences that open are not stray ends
    states = open_states(text, FENCE)
    assert states[text.index("\n")] is False and states[text.index("\n") + 1] is True


def test_tracker_window_and_incremental_feed():
    spec = IntervalSpec(r"<a+>", r"</a+>", regex=True, max_delimiter_chars=6)
    assert states_str("<aaaa>x</a>", spec) == "000000111110"  # '<aaaa>' fits in 6 chars
    assert not any(open_states("<aaaaaa>x", spec))  # 8-char start exceeds the window
    tracker = IntervalTracker(FENCE)
    for piece in ["x``", "`p", "y\ncode", "`", "``"]:
        tracker.feed(piece)
    assert tracker.pos == 14 and not tracker.is_open and tracker.delimiter_begin == 11


def test_check_balanced():
    check_balanced("a[b]c[d]", BRACKETS)
    check_balanced("[[a]", BRACKETS)
    with pytest.raises(ValueError, match=r"end delimiter '\]' at char 5 while the interval is closed"):
        check_balanced("a[b]c]", BRACKETS)
    with pytest.raises(ValueError, match=r"ends with the interval open \(start delimiter '\[' at char 1\)"):
        check_balanced("a[b", BRACKETS)
    with pytest.raises(ValueError, match="at char 0 while the interval is closed"):
        check_balanced(">>x<<y>>", ANGLES)
    with pytest.raises(ValueError, match="at char 2 while"):
        check_balanced("a ``` b", FENCE)


# ---------------------------------------------------------------------------------------------- tokenizers


def char_level(alphabet: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a seeded corpus where delimiters merge with their neighbours."""
    rng = random.Random(0)
    pieces = list("ab=2[]<> ") + ["€", "—", "…", "™", "é", "[a", "]b", "<<", ">>", "=2", "]€", "]—", "]…", "]™", "[é"]
    corpus = ["".join(rng.choice(pieces) for _ in range(rng.randint(5, 30))) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


# '→', '∑' start with the byte 0xE2 like '€' but are rare: BPE leaves them split ("]â" + byte tokens)
ALPHABET = "ab=2[]<> €é→∑🙂"
WORDS = list(ALPHABET) + ["<<", ">>", "=2", "[a", "]b", "[=", "]€", "]→"]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def detector_states(ids: list[int], spec, tokenizer) -> list[int]:
    detector = StoppingTimeDetector(spec, tokenizer, batch_size=1)
    states = []
    for token_id in ids:
        states.append(int(detector.is_open()[0]))
        detector.update([token_id])
    return states


def check_agreement(text: str, spec, tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert tokenizer.decode(enc.input_ids) == text
    mask = token_interval_mask(text, enc.offset_mapping, spec)
    assert detector_states(enc.input_ids, spec, tokenizer) == mask, (text, spec)
    return enc.input_ids, enc.offset_mapping


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.start}..{s.end}")
def test_agreement_char_tokenizer(spec):
    tokenizer = char_level(ALPHABET)
    for text in random_texts(150, seed=1):
        ids, offsets = check_agreement(text, spec, tokenizer)
        assert token_interval_mask(text, offsets, spec) == [int(s) for s in open_states(text, spec)[:-1]]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.start}..{s.end}")
def test_agreement_byte_level_bpe(bpe, spec):
    for text in random_texts(150, seed=2) + ["x]→[a]b<<é>>", "a]€=2]b]∑", "🙂[a]→[]]b"]:
        check_agreement(text, spec, bpe)


def test_bpe_test_data_has_the_hard_cases(bpe):
    """Tokens merging a delimiter with neighbours, delimiters split across tokens, split multi-byte chars."""
    vocab = bpe.get_vocab()
    assert {"[a", "]b", "<<", "=2", ">>", "]â"} <= set(vocab)
    seen = set()
    for text in random_texts(150, seed=2):
        enc = bpe(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc.offset_mapping
        for j, (s, e) in enumerate(offsets):
            piece = text[s:e]
            if len(piece) > 1 and ("[" in piece or "]" in piece):
                seen.add("bracket merged with a neighbour")
            if j and offsets[j - 1] == (s, e):
                seen.add("tokens sharing one character")
            if j and offsets[j - 1][1] > s and text[offsets[j - 1][0]] in "[]":
                seen.add("bracket merged with the first byte of the next character")  # "]â" + "Ĩ" + "Ĵ" = "]→"
        starts = {s for s, _ in offsets}
        for delimiter in ("<<", ">>"):
            p = text.find(delimiter)
            while p >= 0:
                if p + 1 in starts:
                    seen.add(f"{delimiter!r} split across tokens")
                p = text.find(delimiter, p + 1)
    assert len(seen) == 5, seen


def test_special_tokens_are_not_text():
    tokenizer = char_level("ab[]<>")
    text = "a[<eos>b]"
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    special = [int(i in tokenizer.all_special_ids) for i in enc.input_ids]
    assert special == [0, 0, 1, 0, 0]
    spec = IntervalSpec("[<", ">b")  # would match across '<eos>' if it were read as text
    mask = token_interval_mask(text, enc.offset_mapping, spec, special)
    assert mask == detector_states(enc.input_ids, spec, tokenizer) == [0, 0, 0, 0, 0]
    assert token_interval_mask(text, enc.offset_mapping, spec) == [0, 0, 0, 1, 0]


def test_trimmed_offsets_are_refused():
    with pytest.raises(ValueError, match=r"uncovered before token 1.*trim_offsets=False"):
        token_interval_mask("a b", [(0, 1), (2, 3)], BRACKETS)
    with pytest.raises(ValueError, match="outside the text"):
        token_interval_mask("ab", [(0, 1), (1, 3)], BRACKETS)


# ---------------------------------------------------------------------------------------------- detector


def test_detector_batch_and_tensor_updates(bpe):
    texts = ["[a]b", "x[é", "<<a>>"]
    ids = [bpe(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, ids))
    padded = torch.tensor([row + [bpe.pad_token_id] * (width - len(row)) for row in ids])
    detector = StoppingTimeDetector({"start": "[", "end": "]"}, bpe, batch_size=3)
    for column in padded.T:
        detector.update(column)
    assert detector.is_open().tolist() == [False, True, False]
    with pytest.raises(ValueError, match="2 ids for a batch of 3"):
        detector.update([1, 2])


def test_detector_decodes_a_bounded_window(bpe):
    """Incrementality: each update decodes at most 2 · MAX_PENDING_TOKENS tokens, at most twice."""
    text = "".join(random_texts(40, seed=3)) * 3
    ids = bpe(text, add_special_tokens=False).input_ids
    assert len(ids) > 500
    detector = StoppingTimeDetector(BRACKETS, bpe, batch_size=1)
    lengths: list[list[int]] = []
    inner = detector.detokenizers[0].decode
    detector.detokenizers[0].decode = lambda window: lengths[-1].append(len(window)) or inner(window)
    for token_id in ids:
        lengths.append([])
        detector.update([token_id])
    assert max(len(calls) for calls in lengths) <= 2
    assert max(max(calls) for calls in lengths) <= 2 * MAX_PENDING_TOKENS
    assert detector.trackers[0].pos == len(text)


def test_detokenizer_invalid_bytes_are_flushed(bpe):
    """Lone continuation bytes never complete: emitted after MAX_PENDING_TOKENS, the window stays bounded."""
    byte = bpe.convert_tokens_to_ids("Ĩ")  # 0x86, a continuation byte
    detok = IncrementalDetokenizer(lambda ids: bpe.backend_tokenizer.decode(ids, skip_special_tokens=True))
    out = "".join(detok.push(byte) for _ in range(5 * MAX_PENDING_TOKENS))
    assert out == "\ufffd" * (5 * MAX_PENDING_TOKENS)
    assert len(detok.ids) - detok.prefix_offset <= 2 * MAX_PENDING_TOKENS
    a = bpe.convert_tokens_to_ids("a")
    assert detok.push(a) == "a"


def test_byte_piece_delimiters(bpe):
    """Delimiters the tokenizer can only write with byte pieces ('→', '∑' stay split in `bpe`) are named; whole
    tokens ('<<', '€' merged) and regex specs are not."""
    assert [bpe.decode([i]) for i in bpe.encode("→", add_special_tokens=False)].count("\ufffd") >= 1
    assert byte_piece_delimiters(IntervalSpec("→", "∑"), bpe) == ["→", "∑"]
    assert byte_piece_delimiters({"start": "<<", "end": "→"}, bpe) == ["→"]
    assert byte_piece_delimiters(IntervalSpec("<<", ">>"), bpe) == []
    assert byte_piece_delimiters(IntervalSpec("[", "€"), bpe) == []
    assert byte_piece_delimiters(IntervalSpec("→", "∑", regex=True), bpe) == []
