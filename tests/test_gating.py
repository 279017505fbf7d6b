"""Gated composition: interval gates in generate, their teacher-forced masks, and gated exports."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, VOCAB, tiny_peft

import compose.composed_lm as composed_lm
from compose import ComposedLM, export_composition
from compose.gating import IntervalGate, gates_from_specs, interval_masks
from data.tokenizer import build_char_tokenizer

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXY[]"  # 5 special tokens + 27 characters = VOCAB ids, all decodable
# Regex delimiters over frequent letters, so the random tiny models open and close them often.
SPECS = [
    {"interval": {"start": "[A-H]", "end": "[I-P]", "regex": True}},
    {"interval": {"start": "[Q-V]", "end": r"[W-Y]|\]", "regex": True}, "rules": {"A": "B"}},
]
KW = dict(max_new_tokens=16, eos_token_id=[], pad_token_id=PAD)


def tokenizer():
    tok = build_char_tokenizer(ALPHABET)
    assert len(tok) == VOCAB and tok.decode(tok("AB[C]").input_ids) == "AB[C]"
    return tok


def prompts():
    ids = torch.randint(5, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    return ids, mask


def composed(**kw) -> ComposedLM:
    return ComposedLM.from_peft(tiny_peft(names=("a", "b")), ["a", "b"], tokenizer=tokenizer(), **kw)


def always(value: bool):
    return lambda prefix: torch.full((prefix.shape[0],), value)


# ---------------------------------------------------------------------------------------------- generate


def test_gated_with_open_gates_equals_soft():
    ids, mask = prompts()
    soft = composed()
    assert soft.composition == "soft" and soft.specs == [{}, {}]
    ref = soft.generate(ids, mask, **KW)
    gated = composed(composition="gated")
    assert torch.equal(gated.generate(ids, mask, gates=[always(True), always(True)], **KW), ref)
    # gated composition of experts without an interval spec is the soft composition
    rules = composed(composition="gated", specs=[{"rules": {"A": "B"}}, {}])
    assert torch.equal(rules.generate(ids, mask, **KW), ref)
    sampled = [m.generate(ids, mask, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(0),
                          **KW) for m in (soft, rules)]
    assert torch.equal(*sampled)


def test_closed_gate_removes_the_expert():
    ids, mask = prompts()
    peft_model = tiny_peft(names=("a", "b"))
    model = ComposedLM.from_peft(peft_model, ["a", "b"], tokenizer=tokenizer(), composition="gated")
    background = ComposedLM.from_peft(peft_model, []).generate(ids, mask, **KW)  # = HF's (test_composed_lm)
    assert torch.equal(model.generate(ids, mask, gates=[always(False), always(False)], **KW), background)
    only_b = ComposedLM.from_peft(peft_model, ["b"]).generate(ids, mask, **KW)
    assert torch.equal(model.generate(ids, mask, gates=[always(False), None], **KW), only_b)
    assert not torch.equal(only_b, background)


def test_interval_gates_equal_teacher_forced_masks(monkeypatch):
    """The composed log-probs used at each decoding step equal score(..., masks=interval_masks)."""
    ids, mask = prompts()
    model = composed(composition="gated", specs=SPECS, one_head=False)  # every step through compose_logprobs
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = composed_lm.compose_logprobs

    def record(background, experts, weights, masks, min_logprob):
        out = inner(background, experts, weights, masks, min_logprob)
        recorded.append((masks.clone(), out.clone()))
        return out

    monkeypatch.setattr(composed_lm, "compose_logprobs", record)
    out = model.generate(ids, mask, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(1), **KW)
    monkeypatch.setattr(composed_lm, "compose_logprobs", inner)
    prompt_len, steps = ids.shape[1], out.shape[1] - ids.shape[1]
    assert len(recorded) == steps == 16

    masks = model.interval_masks(out, prompt_len)
    assert masks.shape == (2, 4, out.shape[1]) and masks.dtype == torch.bool
    decoding_masks = torch.stack([m for m, _ in recorded], dim=-1)  # [k, B, steps]
    assert torch.equal(masks[:, :, prompt_len - 1 : -1], decoding_masks)
    assert not masks[:, :, : prompt_len - 1].any()
    for i in range(2):  # each gate really opened and closed
        assert decoding_masks[i].any() and not decoding_masks[i].all()

    full_mask = torch.cat([mask, torch.ones(4, steps, dtype=mask.dtype)], dim=1)
    scores = model.score(out, full_mask, masks=masks)[:, prompt_len - 1 : -1]
    decoding = torch.stack([s for _, s in recorded], dim=1)
    assert (scores - decoding).abs().max().item() < 1e-4
    assert interval_masks(SPECS, model.tokenizer, out, prompt_len).equal(masks)


def test_gated_export_needs_no_user_code(tmp_path):
    ids, mask = prompts()
    peft_model = tiny_peft(names=("a", "b"))
    tok = tokenizer()
    export_composition(tmp_path / "e", tokenizer=tok, peft_model=peft_model, adapter_names=["a", "b"],
                       specs={"a": SPECS[0], "b": SPECS[1]})
    loaded = ComposedLM.from_manifest(tmp_path / "e", composition="gated")
    assert loaded.composition == "gated" and loaded.specs == SPECS and loaded.names == ["a", "b"]
    gates = gates_from_specs(SPECS, tok, prompt_len=ids.shape[1])
    ref = ComposedLM.from_peft(peft_model, ["a", "b"], tokenizer=tok).generate(ids, mask, gates=gates, **KW)
    assert torch.equal(loaded.generate(ids, mask, **KW), ref)
    soft = ComposedLM.from_manifest(tmp_path / "e")
    assert soft.composition == "soft" and not torch.equal(soft.generate(ids, mask, **KW), ref)
    separate = ComposedLM.from_manifest(tmp_path / "e", backend="separate", composition="gated")
    assert torch.equal(separate.generate(ids, mask, **KW), ref)


# ---------------------------------------------------------------------------------------------- pieces


def test_interval_gate_reads_only_new_columns():
    tok = tokenizer()
    gate = IntervalGate({"start": "[", "end": "]"}, tok, prompt_len=2)
    ids = torch.tensor([tok("[[A]B[").input_ids, tok("]A[BCD").input_ids])
    assert gate(ids[:, :2]).tolist() == [False, False]  # the prompt is never read
    assert gate(ids[:, :3]).tolist() == [False, True]
    assert gate(ids[:, :6]).tolist() == [True, True]
    assert gate.detector.trackers[0].pos == 4
    with pytest.raises(ValueError, match="one gate per generation"):
        gate(ids[:, :5])
    assert gates_from_specs([{"rules": {}}, {}, SPECS[1]], tok, 0)[:2] == [None, None]


def test_specs_and_composition_arguments():
    model = composed(specs={"b": SPECS[1]})
    assert model.specs == [{}, SPECS[1]]
    model.specs = None
    assert model.specs == [{}, {}]
    with pytest.raises(ValueError, match="composition must be one of"):
        composed(composition="hard")
    with pytest.raises(ValueError, match="specs has 1 entries but there are 2 experts"):
        composed(specs=[{}])
    with pytest.raises(ValueError, match="unknown experts"):
        composed(specs={"c": {}})
    no_tokenizer = ComposedLM.from_peft(tiny_peft(names=("a", "b")), ["a", "b"], specs=SPECS, composition="gated")
    with pytest.raises(ValueError, match="give ComposedLM a tokenizer"):
        no_tokenizer.generate(*prompts(), **KW)
