"""Lazy gated decoding: experts whose gate is closed are skipped, then caught up; same tokens as plain gating."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import PAD, VOCAB, mixed_lora_model, random_lora, tiny_peft
from transformers import LlamaConfig, LlamaForCausalLM

import compose.composed_lm as clm
import compose.decoding as dec
import compose.grouped_lora as gl
from compose import ComposedLM
from data.tokenizer import build_char_tokenizer

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXY[]"  # 5 special tokens + 27 characters = VOCAB ids
# Regex delimiters over frequent letters, so the random tiny models open and close the intervals often; the
# third is a literal bracket interval, rarer.
SPECS = [
    {"interval": {"start": "[A-D]", "end": "[I-P]", "regex": True}},
    {"interval": {"start": "[Q-S]", "end": r"[W-Y]|\]", "regex": True}},
    {"interval": {"start": "[", "end": "]"}},
]
KW = dict(max_new_tokens=20, eos_token_id=[], pad_token_id=PAD)


def tokenizer():
    tok = build_char_tokenizer(ALPHABET)
    assert len(tok) == VOCAB
    return tok


def prompts(batch: int, seed: int = 3):
    ids = torch.randint(5, VOCAB - 2, (batch, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :2], mask[0, :2] = PAD, 0  # left padding
    return ids, mask


def composed(backend: str, names=("a", "b", "c")) -> ComposedLM:
    peft_model = tiny_peft(names=names)
    common = dict(tokenizer=tokenizer(), specs=SPECS[: len(names)], composition="gated")
    if backend == "adapters":
        return ComposedLM.from_peft(peft_model, list(names), **common)
    experts = [copy.deepcopy(peft_model).merge_and_unload(adapter_names=[n]).eval() for n in names]
    return ComposedLM(copy.deepcopy(peft_model).unload().eval(), experts, names=list(names), **common)


@pytest.fixture
def active_sets(monkeypatch):
    """The experts each lazy step runs (recorded from ``_active_experts``)."""
    recorded: list[list[int]] = []
    inner = clm._active_experts

    def record(masks, unfinished):
        out = inner(masks, unfinished)
        recorded.append(out)
        return out

    monkeypatch.setattr(clm, "_active_experts", record)
    return recorded


def caught_up(sets: list[list[int]], k: int) -> bool:
    """Some expert was skipped at some step and ran at a later one (a catch-up prefill)."""
    return any(i not in sets[s] and any(i in later for later in sets[s + 1:]) for i in range(k) for s in range(len(sets)))


@pytest.mark.parametrize("backend", ["adapters", "separate"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("do_sample", "lazy"), [(False, True), (True, True), (False, "decode")])
def test_lazy_equals_gated_token_for_token(active_sets, backend, batch, do_sample, lazy):
    model = composed(backend)
    ids, mask = prompts(batch)
    sample = dict(do_sample=True, temperature=1.5) if do_sample else {}
    out = [model.generate(ids, mask, lazy=mode, generator=torch.Generator().manual_seed(0), **sample, **KW)
           for mode in (False, lazy)]
    assert torch.equal(out[0], out[1])
    assert len(active_sets) == out[1].shape[1] - ids.shape[1]  # one record per lazy step
    assert any(len(s) < 3 for s in active_sets) and caught_up(active_sets, 3)
    if batch > 1:  # rows whose intervals open at different steps
        masks = model.interval_masks(out[1], ids.shape[1])[:, :, ids.shape[1] - 1:]
        first_open = [int(m.float().argmax()) if m.any() else -1 for m in masks[0]]
        assert len(set(first_open)) > 1


@pytest.mark.parametrize("lazy", [True, "decode"])
def test_short_catch_ups_join_the_step_long_ones_run_alone(monkeypatch, lazy):
    """Adapters backend: an expert that missed few tokens joins the step's forward, the other members rolled back
    to its length; with the limit at 0 every catch-up is a prefill of its own. The same tokens either way."""
    model = composed("adapters")
    batch = 4  # rows whose intervals open and close at different steps: experts re-join after a few tokens
    ids, mask = prompts(batch)
    plain = model.generate(ids, mask, **KW)
    shapes: list[tuple[int, int]] = []  # (rows, tokens) of every lazy forward
    model.base_model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    fused = model.generate(ids, mask, lazy=lazy, **KW)
    fused_shapes, shapes[:] = shapes[:], []
    monkeypatch.setattr(dec, "FUSED_CATCH_UP_TOKENS", 0)
    alone = model.generate(ids, mask, lazy=lazy, **KW)
    assert torch.equal(fused, plain) and torch.equal(alone, plain)
    steps = plain.shape[1] - ids.shape[1]
    assert len(fused_shapes) == steps < len(shapes)  # no forward of its own for any catch-up (the prompt is short)
    # a decoding step over several rows and several tokens: the joining expert's missed ones and the new one
    assert any(rows > batch and tokens > 1 for rows, tokens in fused_shapes[1:])


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_lazy_with_rows_finishing_at_different_steps(active_sets, backend):
    """Finished rows do not keep an expert running; their tokens are padding as without lazy."""
    model = composed(backend)
    ids, mask = prompts(4, seed=5)
    plain = model.generate(ids, mask, **KW)
    eos = int(plain[0, ids.shape[1] + 4])  # a token row 0 emits early
    kw = dict(KW, eos_token_id=eos)
    out = [model.generate(ids, mask, lazy=lazy, **kw) for lazy in (False, True)]
    assert torch.equal(out[0], out[1])
    generated = out[1][:, ids.shape[1]:]
    ends = [int((row == PAD).float().argmax()) if (row == PAD).any() else len(row) for row in generated]
    assert len(set(ends)) > 1 and min(ends) < len(generated[0])


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_lazy_without_gates_is_the_plain_path(backend):
    model = composed(backend, names=("a", "b"))
    model.composition = "soft"
    ids, mask = prompts(3)
    assert torch.equal(model.generate(ids, mask, lazy=True, **KW), model.generate(ids, mask, **KW))
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="lazy must be one of"):
            model.generate(ids, mask, lazy=bad, **KW)


def token_gate(residue: int):
    """A stateless user gate: open on the rows whose last token is ``residue`` mod 3."""
    return lambda prefix: prefix[:, -1] % 3 == residue


@pytest.mark.parametrize("stacked", [True, False])
def test_lazy_with_user_gates_mixed_ranks_and_peft_fallback(monkeypatch, active_sets, stacked):
    """Per-subset slices of the stacked LoRA (ranks, scalings, targets differ), and peft's mixed batch when the
    stacked path is unsupported; LoRA layers and parameter storage are restored afterwards."""
    if not stacked:
        monkeypatch.setattr(gl, "grouped_lora_supported", lambda *a: False)
    model = mixed_lora_model()
    names = ["e0", "e1", "e2"]
    composed_lm = ComposedLM.from_peft(model, names, weights=[1.0, 0.5, -0.3])
    gates = [token_gate(0), token_gate(1), None]  # e2 always on
    ids = torch.randint(5, 24, (3, 9), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    kw = dict(max_new_tokens=12, eos_token_id=[], gates=gates)
    out = [composed_lm.generate(ids, attn, lazy=lazy, **kw) for lazy in (False, True)]
    assert torch.equal(out[0], out[1])
    assert all(2 in s for s in active_sets) and caught_up(active_sets, 3)
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(gl.owns_storage(p) for name, p in model.named_parameters() if "lora_" in name)


def test_split_and_merge_caches_round_trip():
    from transformers import DynamicCache

    config = LlamaConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    cache = DynamicCache(config=config)
    for layer in range(2):
        cache.update(torch.randn(6, 1, 5, 4), torch.randn(6, 1, 5, 4), layer)
    parts = dec._split_cache(cache, 3)
    assert [p.layers[1].keys.shape[0] for p in parts] == [2, 2, 2] and parts[2].get_seq_length() == 5
    merged = dec._merge_caches(parts)
    for a, b in zip(merged.layers, cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_lazy_on_the_interval_task(active_sets, backend):
    """The interval task's tokenizer, experts (``upper`` on ``[ ]``, ``reverse`` on ``( )``) and compositional
    inputs, on a tiny model whose head favours the delimiters (so the sampled outputs open and close both)."""
    from data.generation import left_padded
    from data.tasks import Expert, task_class
    from data.tasks.intervals import IntervalsConfig

    experts = [Expert("upper", {"interval": {"start": "[", "end": "]"}}),
               Expert("reverse", {"interval": {"start": "(", "end": ")"}})]
    task = task_class("intervals")(IntervalsConfig(n_train=8, n_val=4, n_test=4), experts, seed=0)
    tok = task.tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id)).eval()
    with torch.no_grad():
        for delimiter in "[]()":
            model.lm_head.weight[tok.convert_tokens_to_ids(delimiter)] *= 3
    peft_model = random_lora(model, ("upper", "reverse"))
    common = dict(tokenizer=tok, specs=[e.spec for e in experts], composition="gated")
    if backend == "adapters":
        composed_lm = ComposedLM.from_peft(peft_model, ["upper", "reverse"], **common)
    else:
        merged = [copy.deepcopy(peft_model).merge_and_unload(adapter_names=[n]).eval() for n in ("upper", "reverse")]
        composed_lm = ComposedLM(copy.deepcopy(peft_model).unload().eval(), merged, names=["upper", "reverse"],
                                 **common)
    xs = task.compositional_dataset("test")["x"][:4]
    ids, attn = left_padded([[tok.bos_token_id, *tok.convert_tokens_to_ids(list(x)), tok.sep_token_id] for x in xs],
                            tok.pad_token_id)
    out = [composed_lm.generate(ids, attn, max_new_tokens=24, eos_token_id=[], lazy=lazy, do_sample=True,
                                generator=torch.Generator().manual_seed(0)) for lazy in (False, True)]
    assert torch.equal(out[0], out[1])
    assert [] in active_sets and [0, 1] in active_sets and caught_up(active_sets, 2)
