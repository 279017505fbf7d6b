"""ComposedLM: parity with HF generate, backend agreement, gating, sampling, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import (
    EOS,
    PAD,
    VOCAB,
    char_tokenizer,
    mixed_lora_model,
    needs_cpp_compiler,
    tiny_model,
    tiny_peft,
)
from transformers import LlamaForCausalLM

from compose import ComposedLM, compose_logprobs
from compose.decoding import check_compile

ARCHS = ["llama", "gpt2"]


def merged_copy(peft_model, name):
    return copy.deepcopy(peft_model).merge_and_unload(adapter_names=[name]).eval()


def plain_copy(peft_model):
    return copy.deepcopy(peft_model).unload().eval()


def left_padded_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(5, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    for row, n_pad in ((0, 3), (1, 1)):
        ids[row, :n_pad] = PAD
        mask[row, :n_pad] = 0
    return ids, mask


def hf_generate(model, ids, mask, n=12, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                          eos_token_id=EOS, pad_token_id=PAD, **kw)


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_decoding_step_surface_matches_scoring(backend):
    """`step_modules`, `new_caches` and `component_logits` (what compose.decoding drives): a prefill then a cached
    step give the teacher-forced logits of every component."""
    ids, mask = left_padded_batch()
    peft_model = tiny_peft("llama")
    if backend == "adapters":
        composed = ComposedLM.from_peft(peft_model, ["a", "b"])
    else:
        composed = ComposedLM(plain_copy(peft_model), [merged_copy(peft_model, n) for n in ("a", "b")])
    modules = composed.step_modules()
    assert len(modules) == (1 if backend == "adapters" else 3) and modules[0] is composed.base_model
    caches = composed.new_caches()
    assert len(caches) == len(modules)
    background, experts = composed.component_logprobs(ids, mask)
    reference = torch.cat([background[None], experts]).exp()
    from compose.positions import position_ids

    positions = position_ids(ids, mask)
    with composed._running(ids.shape[0]):
        first = composed.component_logits(ids[:, :-1], mask[:, :-1], positions[:, :-1], caches, last_only=True)
        step = composed.component_logits(ids[:, -1:], mask, positions[:, -1:], caches, last_only=True)
    assert first.shape == (3, ids.shape[0], 1, VOCAB) and step.shape == first.shape
    torch.testing.assert_close(first[:, :, 0].softmax(-1), reference[:, :, -2], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step[:, :, 0].softmax(-1), reference[:, :, -1], atol=1e-5, rtol=1e-4)



@pytest.mark.parametrize("arch", ARCHS)
def test_no_experts_equals_background_generate(arch):
    ids, mask = left_padded_batch()
    background = tiny_model(arch)
    ref = hf_generate(background, ids, mask)
    out = ComposedLM(background).generate(ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(out, ref)
    # The adapters backend with no adapter selected runs the bare base model.
    peft_model = tiny_peft(arch)
    ref = hf_generate(plain_copy(peft_model), ids, mask)
    out = ComposedLM.from_peft(peft_model, []).generate(ids, mask, max_new_tokens=12, eos_token_id=EOS,
                                                         pad_token_id=PAD)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_expert_at_weight_one_equals_expert_generate(arch):
    ids, mask = left_padded_batch()
    peft_model = tiny_peft(arch)
    expert, background = merged_copy(peft_model, "a"), plain_copy(peft_model)
    ref = hf_generate(expert, ids, mask)
    assert not torch.equal(ref, hf_generate(background, ids, mask))  # the expert really differs
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ComposedLM(background, [expert]).generate(ids, mask, **kw), ref)
    # Adapters backend vs peft's own generate with that adapter active.
    peft_model.set_adapter("a")
    ref_peft = hf_generate(peft_model, ids, mask)
    assert torch.equal(ComposedLM.from_peft(peft_model, ["a"]).generate(ids, mask, **kw), ref_peft)


def test_eos_stops_each_sequence_and_pads_like_hf():
    ids, mask = left_padded_batch()
    background = tiny_model("llama")
    free = ComposedLM(background).generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    assert free.shape == (3, ids.shape[1] + 12)  # [] disables EOS stopping
    eos = int(free[0, ids.shape[1] + 2])  # row 0 emits this at its 3rd step
    ref = background.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=PAD)
    out = ComposedLM(background).generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(out, ref)
    row0 = out[0, ids.shape[1]:]
    first = int((row0 == eos).nonzero()[0])
    assert first <= 2 and (row0[first + 1:] == PAD).all()


def test_eos_and_pad_default_to_tokenizer_then_generation_config():
    ids, mask = left_padded_batch()
    background = tiny_model("llama")
    free = ComposedLM(background).generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    eos = int(free[1, ids.shape[1] + 1])
    background.generation_config.eos_token_id = eos  # no tokenizer: the generation config decides
    ref = background.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(ComposedLM(background).generate(ids, mask, max_new_tokens=12), ref)
    assert (ref[1, ids.shape[1] + 2:] == PAD).all()
    # A tokenizer wins over the generation config: <eos> is id 2 there.
    tok_eos = ComposedLM(background, tokenizer=char_tokenizer()).generate(ids, mask, max_new_tokens=12)
    assert torch.equal(tok_eos, hf_generate(background, ids, mask))


@pytest.mark.parametrize("arch", ARCHS)
def test_backends_agree(arch):
    ids, mask = left_padded_batch()
    peft_model = tiny_peft(arch)
    weights = [1.0, 0.7]
    adapters = ComposedLM.from_peft(peft_model, ["a", "b"], weights=weights)
    separate = ComposedLM(plain_copy(peft_model), [merged_copy(peft_model, "a"), merged_copy(peft_model, "b")],
                          weights=weights, names=["a", "b"])
    assert adapters.backend == "adapters" and separate.backend == "separate"
    s_adapters, s_separate = adapters.score(ids, mask), separate.score(ids, mask)
    assert s_adapters.shape == (3, 7, VOCAB) and s_adapters.dtype == torch.float32
    assert (s_adapters - s_separate).abs().max().item() < 1e-5
    # The experts really move the composition away from the background.
    bg_lp, _ = separate.component_logprobs(ids, mask)
    assert (s_separate - bg_lp)[mask.bool()].abs().max().item() > 0.1
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(adapters.generate(ids, mask, **kw), separate.generate(ids, mask, **kw))


@pytest.mark.parametrize("arch", ARCHS)
def test_score_is_compose_of_each_component_forward(arch):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 6), generator=g)
    peft_model = tiny_peft(arch)
    background = plain_copy(peft_model)
    experts = [merged_copy(peft_model, "a"), merged_copy(peft_model, "b")]
    masks = torch.rand(2, 2, 6, generator=g) > 0.4
    with torch.no_grad():
        expected = compose_logprobs(background(ids).logits, [e(ids).logits for e in experts], [1.0, 2.0], masks)
        with peft_model.disable_adapter():
            bg_own = peft_model(ids).logits
        own = []
        for name in ("a", "b"):
            peft_model.set_adapter(name)
            own.append(peft_model(ids).logits)
        expected_peft = compose_logprobs(bg_own, own, [1.0, 2.0], masks)
    separate = ComposedLM(background, experts, weights=[1.0, 2.0])
    torch.testing.assert_close(separate.score(ids, masks=masks), expected, atol=1e-6, rtol=0)
    adapters = ComposedLM.from_peft(peft_model, ["a", "b"], weights=[1.0, 2.0])
    torch.testing.assert_close(adapters.score(ids, masks=masks), expected_peft, atol=1e-6, rtol=0)
    bg_lp, ex_lp = adapters.component_logprobs(ids)
    torch.testing.assert_close(bg_lp, bg_own.log_softmax(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ex_lp[1], own[1].log_softmax(-1), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- gates, sampling


def test_gates():
    ids, mask = left_padded_batch()
    peft_model = tiny_peft("llama")
    composed = ComposedLM.from_peft(peft_model, ["a", "b"])
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    background_only = hf_generate(plain_copy(peft_model), ids, mask, n=10)
    never = [lambda prefix: torch.zeros(prefix.shape[0], dtype=torch.bool)] * 2
    assert torch.equal(composed.generate(ids, mask, gates=never, **kw), background_only)
    assert not torch.equal(composed.generate(ids, mask, **kw), background_only)
    # A gate sees the growing prefix [B, t]; only expert "a", only from step 4 on.
    seen = []

    def late(prefix):
        seen.append(prefix.shape[1])
        return torch.full((prefix.shape[0],), prefix.shape[1] >= ids.shape[1] + 4)

    out = composed.generate(ids, mask, gates=[late, never[1]], **kw)
    assert seen == list(range(ids.shape[1], ids.shape[1] + 10))
    assert torch.equal(out[:, : ids.shape[1] + 4], background_only[:, : ids.shape[1] + 4])
    only_a = ComposedLM.from_peft(peft_model, ["a"]).generate(ids, mask, **kw)
    assert not torch.equal(out, only_a) and not torch.equal(out, background_only)
    # score with all-False masks is the background.
    masks = torch.zeros(2, *ids.shape, dtype=torch.bool)
    bg_lp, _ = composed.component_logprobs(ids, mask)
    torch.testing.assert_close(composed.score(ids, mask, masks=masks), bg_lp, atol=1e-6, rtol=0)


def test_sampling_seeded_and_top_k_one_is_greedy():
    ids, mask = left_padded_batch()
    composed = ComposedLM.from_peft(tiny_peft("llama"), ["a", "b"])
    kw = dict(max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    runs = [composed.generate(ids, mask, do_sample=True, temperature=1.5, top_p=0.95,
                              generator=torch.Generator().manual_seed(s), **kw) for s in (11, 11, 12)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    greedy = composed.generate(ids, mask, **kw)
    top1 = composed.generate(ids, mask, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(top1, greedy)
    assert not torch.equal(runs[0], greedy)


@pytest.mark.parametrize("one_head", [True, False])
def test_prefix_is_prefilled_once_then_one_token_per_step(one_head):
    ids, mask = left_padded_batch()
    peft_model = tiny_peft("llama")
    composed = ComposedLM.from_peft(peft_model, ["a", "b"], one_head=one_head)
    assert composed.paths.one_head is one_head  # checked once, before decoding
    lengths = []
    peft_model.get_base_model().get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: lengths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    composed.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    assert lengths == [(9, 7)] + [(9, 1)] * 5  # one (k+1)·B forward per step, never the prefix again


def test_modes_are_restored_and_float32_composition():
    peft_model = tiny_peft("llama")
    peft_model.train()
    composed = ComposedLM.from_peft(peft_model, ["a"])
    ids = torch.randint(3, VOCAB, (1, 5))
    composed.generate(ids, max_new_tokens=2, eos_token_id=[])
    assert peft_model.training and all(m.training for m in peft_model.modules())
    background = tiny_model("llama").to(torch.bfloat16)
    out = ComposedLM(background, [tiny_model("llama", seed=1).to(torch.bfloat16)]).to("cpu").score(ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(1, 5))


# ---------------------------------------------------------------------------------------------- refusals


def _forbid_forward(monkeypatch, *models):
    def boom(*args, **kwargs):
        raise AssertionError("forward ran before the vocabulary check")

    for m in models:
        monkeypatch.setattr(m, "forward", boom)


def test_different_vocab_sizes_refused_before_forward(monkeypatch):
    background, other = tiny_model("llama"), tiny_model("llama", seed=1, vocab=VOCAB + 1)
    _forbid_forward(monkeypatch, background, other)
    with pytest.raises(ValueError, match=r"expert 'wide'.*vocab"):
        ComposedLM(background, [other], names=["wide"])
    gpt2 = tiny_model("gpt2", vocab=VOCAB - 2)
    _forbid_forward(monkeypatch, gpt2)
    with pytest.raises(ValueError, match="expert 'expert_1'"):
        ComposedLM(background, [tiny_model("llama", seed=2), gpt2])


def test_different_tokenizers_refused_before_forward(monkeypatch):
    background, expert = tiny_model("llama"), tiny_model("llama", seed=1)
    _forbid_forward(monkeypatch, background, expert)
    same = ComposedLM(background, [expert], tokenizer=[char_tokenizer(), char_tokenizer()])
    assert same.tokenizer.get_vocab() == char_tokenizer().get_vocab()
    with pytest.raises(ValueError, match="expert 'expert_0'.*vocabulary"):
        ComposedLM(background, [expert], tokenizer=[char_tokenizer(), char_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXZY")])
    other_eos = char_tokenizer()
    other_eos.eos_token = "<sep>"
    with pytest.raises(ValueError, match="expert 'expert_0'.*special tokens"):
        ComposedLM(background, [expert], tokenizer=[char_tokenizer(), other_eos])


def test_bad_arguments():
    peft_model = tiny_peft("llama")
    with pytest.raises(ValueError, match="'zz' is not in the PeftModel"):
        ComposedLM.from_peft(peft_model, ["a", "zz"])
    with pytest.raises(ValueError, match="weights has 1 entries but there are 2"):
        ComposedLM.from_peft(peft_model, ["a", "b"], weights=[1.0])
    with pytest.raises(ValueError, match="gates has 1 entries"):
        ComposedLM.from_peft(peft_model, ["a", "b"]).generate(torch.ones(1, 3, dtype=torch.long), gates=[None])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_stacked_lora_path_equals_peft_mixed_batch_and_separate_models(monkeypatch, k):
    """The adapters backend's stacked-LoRA path (one batched matmul per layer) gives what peft's own mixed batch
    and the separate backend (each adapter merged into a full copy) give, with different ranks and targets."""
    import compose.grouped_lora as gl

    model = mixed_lora_model(k)
    names, weights = [f"e{i}" for i in range(k)], [1.0, 0.5, -0.3][:k]
    composed = ComposedLM.from_peft(model, names, weights=weights)
    assert gl.grouped_lora_supported(model, names)
    state = set(model.state_dict())
    ids = torch.randint(5, 24, (3, 9), generator=torch.Generator().manual_seed(k))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding
    fast_score = composed.score(ids, attn)
    fast_gen = composed.generate(ids, attn, max_new_tokens=6, eos_token_id=[])
    # The layers' forwards are restored and no module was added or dropped.
    assert set(model.state_dict()) == state
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(gl.owns_storage(p) for name, p in model.named_parameters() if "lora_" in name)
    separate = ComposedLM(plain_copy(model), [merged_copy(model, n) for n in names], weights=weights, names=names)
    torch.testing.assert_close(separate.score(ids, attn), fast_score, atol=1e-5, rtol=1e-5)
    assert torch.equal(separate.generate(ids, attn, max_new_tokens=6, eos_token_id=[]), fast_gen)
    one = ids[1:2]  # B = 1: the experts' row blocks are a slice of the batch axis (`_expert_blocks`)
    torch.testing.assert_close(separate.score(one), composed.score(one), atol=1e-5, rtol=1e-5)
    assert torch.equal(separate.generate(one, max_new_tokens=6, eos_token_id=[]),
                       composed.generate(one, max_new_tokens=6, eos_token_id=[]))
    monkeypatch.setattr(gl, "grouped_lora_supported", lambda *a: False)
    torch.testing.assert_close(composed.score(ids, attn), fast_score, atol=1e-5, rtol=1e-5)
    assert torch.equal(composed.generate(ids, attn, max_new_tokens=6, eos_token_id=[]), fast_gen)
    assert not any(m._disable_adapters for m in model.modules() if hasattr(m, "_disable_adapters"))


def test_stacked_lora_path_on_a_bfloat16_base_with_float32_adapters(monkeypatch):
    """A bf16 base with float32 LoRA weights (peft's default autocast) takes the stacked path's cast branch: the base
    output is added to in float32 and cast back, as peft's own forward does, so both give the same scores."""
    import compose.grouped_lora as gl

    model = mixed_lora_model(2)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    composed = ComposedLM.from_peft(model, ["e0", "e1"], weights=[1.0, -0.5])
    ids, attn = torch.randint(5, 24, (2, 7), generator=torch.Generator().manual_seed(3)), None
    fast = composed.score(ids, attn)
    monkeypatch.setattr(gl, "grouped_lora_supported", lambda *a: False)
    torch.testing.assert_close(fast, composed.score(ids, attn), atol=2e-2, rtol=2e-2)


def test_stacked_lora_pads_ranks_and_absent_experts_with_zeros_and_shares_storage():
    import compose.grouped_lora as gl

    model = mixed_lora_model(3)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj  # e0 (r 4), e1 (r 2); e2 absent
    weight_a, weight_b = q_proj.lora_A["e1"].weight, q_proj.lora_B["e1"].weight
    before = weight_a.detach().clone(), weight_b.detach().clone()
    stacked = gl.StackedLoRA(q_proj, ["e0", "e1", "e2"])  # one block per expert, none for the background
    assert stacked.lora_a.shape == (3, 4, 32) and stacked.lora_b.shape == (3, 32, 4)
    assert stacked.scale == 2.0  # e0 and e1 both scale by alpha / r = 2: one float for baddbmm
    torch.testing.assert_close(stacked.lora_a[1, :2], before[0], atol=0, rtol=0)
    torch.testing.assert_close(stacked.lora_b[1, :, :2], before[1], atol=0, rtol=0)
    assert not stacked.lora_a[1, 2:].any() and not stacked.lora_b[1, :, 2:].any()
    assert not stacked.lora_a[2].any() and not stacked.lora_b[2].any()
    k_proj = model.get_base_model().model.layers[0].self_attn.k_proj  # e0 scales by 2, e2 by 1: per block
    mixed = gl.StackedLoRA(k_proj, ["e0", "e1", "e2"])
    assert isinstance(mixed.scale, torch.Tensor) and mixed.scale.flatten()[[0, 2]].tolist() == [2.0, 1.0]
    mixed.release()
    # The peft parameters are views into the stacks (one copy of the weights), then get their own storage back.
    def storage(t):
        return t.untyped_storage().data_ptr()

    assert storage(weight_a) == storage(stacked.lora_a) and storage(weight_b) == storage(stacked.lora_b)
    stacked.release()
    assert gl.owns_storage(weight_a) and gl.owns_storage(weight_b)
    assert torch.equal(weight_a, before[0]) and torch.equal(weight_b, before[1])


# ---------------------------------------------------------------------------------------------- long sequences


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_chunked_score_equals_unchunked_and_holds_one_block_of_logits(monkeypatch, backend):
    """``score`` runs the heads, log-softmax and composition over blocks of positions: the same result for every
    block size, and no logits tensor ever spans more than ``chunk_size`` positions (a head per component; the
    one-head path's blocks are tested in test_one_head)."""
    import compose.composed_lm as clm

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    masks = torch.rand(2, 2, 11, generator=g) > 0.3
    peft_model = tiny_peft("llama")
    if backend == "adapters":
        composed = ComposedLM.from_peft(peft_model, ["a", "b"], weights=[1.0, 0.6], one_head=False)
        head = peft_model.get_base_model().get_output_embeddings()
    else:
        experts = [merged_copy(peft_model, "a"), merged_copy(peft_model, "b")]
        composed = ComposedLM(plain_copy(peft_model), experts, weights=[1.0, 0.6], one_head=False)
        head = composed.background.get_output_embeddings()
    with torch.no_grad():  # the unchunked reference: every component's full logits at once
        bg, ex = composed.component_logprobs(ids)
    reference = compose_logprobs(bg, ex, [1.0, 0.6], masks)
    positions, composed_shapes = [], []
    head.register_forward_hook(lambda mod, args, out: positions.append(out.shape[1]))
    real_compose = clm.compose_logprobs
    monkeypatch.setattr(clm, "compose_logprobs",
                        lambda b, e, *a: composed_shapes.append(tuple(e.shape)) or real_compose(b, e, *a))
    for chunk in (1, 4, 11, 64, None):
        positions.clear()
        composed_shapes.clear()
        torch.testing.assert_close(composed.score(ids, masks=masks, chunk_size=chunk), reference,
                                   atol=1e-5, rtol=1e-5)
        limit = 11 if chunk is None else min(chunk, 11)
        assert max(positions) <= limit and all(s[:2] == (2, 2) and s[2] <= limit for s in composed_shapes)
        assert sum(s[2] for s in composed_shapes) == 11  # every position composed exactly once
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        composed.score(ids, chunk_size=0)
    blocks = list(composed.component_logit_blocks(ids, chunk_size=4))
    assert [p for p, _ in blocks] == [slice(0, 4), slice(4, 8), slice(8, 11)]
    lp = torch.cat([logits for _, logits in blocks], dim=2).log_softmax(-1)
    torch.testing.assert_close(lp[0], bg, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[1:], ex, atol=1e-5, rtol=0)


def test_score_chunk_size_fits_the_budget():
    from compose.composed_lm import score_chunk_size

    # V = 256k, k = 2 experts, B = 1: 256 MiB hold 87 positions of 3 float32 logit rows.
    assert score_chunk_size(3, 1, 256_000) == (1 << 28) // (4 * 3 * 256_000) == 87
    assert score_chunk_size(9, 64, 256_000) == 1  # never below one position
    assert score_chunk_size(3, 1, 32, budget=4 * 3 * 32 * 5) == 5


def test_score_falls_back_when_the_head_post_processes_logits():
    """A model that changes its logits after the head (here doubles them) is scored from its full logits."""

    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    background = tiny_model("llama")
    doubled = Doubled(background.config).eval()
    doubled.load_state_dict(tiny_model("llama", seed=1).state_dict())
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = compose_logprobs(background(ids).logits, [doubled(ids).logits])
    composed = ComposedLM(background, [doubled])
    torch.testing.assert_close(composed.score(ids, chunk_size=2), expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- padding


def test_right_padding_from_a_right_padding_tokenizer_generates_like_unpadded_rows():
    """A tokenizer that pads on the right (SmolLM2's default): rows come out as if decoded one by one."""
    tok = char_tokenizer()
    tok.padding_side = "right"
    texts = ["ABCDEFG", "HIJ", "KLMNO"]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][:, -1].tolist() == [1, 0, 0]  # really right-padded
    peft_model = tiny_peft("llama")
    composed = ComposedLM.from_peft(peft_model, ["a", "b"])
    kw = dict(max_new_tokens=8, eos_token_id=[], pad_token_id=PAD)
    out = composed.generate(batch["input_ids"], batch["attention_mask"], **kw)
    width = batch["input_ids"].shape[1]
    for row, text in enumerate(texts):
        alone = composed.generate(tok([text], return_tensors="pt")["input_ids"], **kw)
        assert torch.equal(out[row, width:], alone[0, -8:]), row
        # the prompt part is the same tokens, now left-padded
        assert out[row, :width][batch["attention_mask"][row].flip(0).bool()].tolist() == alone[0, :-8].tolist()
    # score: right-padded rows score their tokens like unpadded ones (causal attention, positions from the mask)
    scored = composed.score(batch["input_ids"], batch["attention_mask"])
    for row, text in enumerate(texts):
        ids = tok([text], return_tensors="pt")["input_ids"]
        assert torch.allclose(scored[row, : ids.shape[1]], composed.score(ids)[0], atol=1e-5), row


def test_missing_attention_mask_where_pad_is_eos():
    """pad = EOS (SmolLM2): a leading run is left padding; a row ending with it is refused, never guessed."""
    ids, mask = left_padded_batch()
    background = tiny_model("llama")
    composed = ComposedLM(background)
    kw = dict(max_new_tokens=6, eos_token_id=[], pad_token_id=PAD)
    ref = composed.generate(ids, mask, **kw)
    # pad = EOS = PAD, no mask: the leading pads are inferred as padding, the output is the masked one's
    out = composed.generate(ids, None, max_new_tokens=6, eos_token_id=PAD, pad_token_id=PAD)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    with_mask = composed.generate(ids, mask, max_new_tokens=6, eos_token_id=PAD, pad_token_id=PAD)
    assert torch.equal(out, with_mask)
    right = ids.clone()
    right[1] = torch.cat([ids[1, 1:], ids.new_tensor([PAD])])  # row 1 now right-padded
    with pytest.raises(ValueError, match="row 1 of input_ids ends with the pad token 0, which is also EOS"):
        composed.generate(right, None, max_new_tokens=6, eos_token_id=PAD, pad_token_id=PAD)
    # with its mask the same batch is fine, and equals the left-padded batch's new tokens
    right_mask = mask.clone()
    right_mask[1] = torch.cat([mask[1, 1:], mask.new_tensor([0])])
    out = composed.generate(right, right_mask, **kw)
    assert torch.equal(out[:, ids.shape[1]:], ref[:, ids.shape[1]:])


# ---------------------------------------------------------------------------------------------- compiled decoding

def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@needs_cpp_compiler
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decoding_gives_the_eager_tokens_and_compiles_once(arch):
    """generate(compile=True): static KV caches, each step one compiled graph; same tokens as eager decoding on
    both backends (left padding, gates, EOS), and later calls with the same shapes reuse the graph."""
    ids, mask = left_padded_batch()
    peft_model = tiny_peft(arch)
    adapters = ComposedLM.from_peft(peft_model, ["a", "b"])
    separate = ComposedLM(plain_copy(peft_model), [merged_copy(peft_model, "a"), merged_copy(peft_model, "b")],
                          names=["a", "b"])
    late = [None, lambda prefix: torch.full((prefix.shape[0],), prefix.shape[1] >= ids.shape[1] + 3)]
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    for composed in (adapters, separate):
        eager = composed.generate(ids, mask, **kw)
        before = _graphs_compiled()
        assert torch.equal(composed.generate(ids, mask, compile=True, **kw), eager)
        compiled = _graphs_compiled()
        assert compiled > before  # the steps really ran through torch.compile
        # Same batch, a shorter prompt and another length: one cache size (STATIC_CACHE_STEP), no new graph.
        assert torch.equal(composed.generate(ids[:, 2:], mask[:, 2:], compile=True, **kw),
                           composed.generate(ids[:, 2:], mask[:, 2:], **kw))
        assert torch.equal(composed.generate(ids, mask, gates=late, compile=True, **kw),
                           composed.generate(ids, mask, gates=late, **kw))
        assert _graphs_compiled() == compiled
        # One row: a new batch shape, so one new graph, and only one over all its steps.
        assert torch.equal(composed.generate(ids[2:], mask[2:], compile=True, **kw),
                           composed.generate(ids[2:], mask[2:], **kw))
        assert _graphs_compiled() == compiled + 1
    assert not torch.equal(eager, hf_generate(plain_copy(peft_model), ids, mask))  # the experts matter here


def test_compiled_decoding_refuses_lazy_and_packed_weights():
    ids, mask = left_padded_batch()
    composed = ComposedLM.from_peft(tiny_peft("llama"), ["a", "b"])
    with pytest.raises(TypeError, match="compile must be a bool or a torch.compile mode"):
        composed.generate(ids, mask, max_new_tokens=4, compile=1)
    with pytest.raises(ValueError, match="compile='fast' is not a torch.compile mode; expected true, false or one of"):
        composed.generate(ids, mask, max_new_tokens=4, compile="fast")
    assert check_compile("True") is True and check_compile("false") is False  # as command lines give them
    assert check_compile("reduce-overhead") == "reduce-overhead"
    with pytest.raises(ValueError, match="does not combine with lazy"):
        composed.generate(ids, mask, max_new_tokens=4, gates=[None, None], lazy=True, compile=True)
    with composed.packed_weights(batch_size=3) as packed:
        if packed:  # oneDNN present
            with pytest.raises(ValueError, match="compile and packed_weights do not combine"):
                composed.generate(ids, mask, max_new_tokens=4, compile=True)
            with composed.packed_weights(batch_size=3):  # a nested block (already packed: packs nothing)
                pass
            with pytest.raises(ValueError, match="compile and packed_weights do not combine"):
                composed.generate(ids, mask, max_new_tokens=4, compile=True)
    assert not vars(composed)["_packed"]
