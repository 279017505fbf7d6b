"""oneDNN-prepacked linear weights (compose.packed_weights): same outputs, weights held once, restored exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import mixed_lora_model, tiny_model, tiny_peft
from torch import nn

from compose import ComposedLM
from compose.packed_weights import packed_linear_weights

ARCHS = ["llama", "gpt2"]
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _batch(seed: int = 0):
    ids = torch.randint(5, 24, (3, 9), generator=torch.Generator().manual_seed(seed))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding
    return ids, attn


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_packed_composition_scores_and_generates_like_the_dense_one(backend):
    model = mixed_lora_model(3)
    names = ["e0", "e1", "e2"]
    if backend == "adapters":
        composed = ComposedLM.from_peft(model, names, weights=[1.0, 0.5, -0.3])
    else:
        merged = [copy.deepcopy(model).merge_and_unload(adapter_names=[n]).eval() for n in names]
        background = copy.deepcopy(model).unload().eval()
        composed = ComposedLM(background, merged, weights=[1.0, 0.5, -0.3], names=names)
    ids, attn = _batch()
    dense_score = composed.score(ids, attn)
    dense_tokens = composed.generate(ids, attn, max_new_tokens=8, eos_token_id=[])
    dense_state = {k: v.clone() for k, v in composed.state_dict().items()}
    with composed.packed_weights(batch_size=3) as packed:
        assert packed > 0
        torch.testing.assert_close(composed.score(ids, attn), dense_score, atol=1e-4, rtol=1e-4)
        assert torch.equal(composed.generate(ids, attn, max_new_tokens=8, eos_token_id=[]), dense_tokens)
    # Leaving the block gives every layer its own forward and its exact dense weight back.
    assert not any("forward" in vars(m) for m in composed.modules())
    state = composed.state_dict()
    assert state.keys() == dense_state.keys()
    assert all(torch.equal(state[k], v) for k, v in dense_state.items())


def test_dense_weights_are_freed_except_a_shared_one():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # a tied head, as SmolLM2's
    ids, _ = _batch()
    with torch.no_grad():
        expected = model(ids).logits
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    with torch.no_grad(), packed_linear_weights(model, rows=3) as packed:
        assert packed == len(linears)
        freed = [m for m in linears if m.weight.numel() == 0]
        assert len(freed) == len(linears) - 1 and model.lm_head not in freed  # the tied head stays dense
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
    assert all(m.weight.numel() > 0 for m in linears)


def test_lora_matrices_are_left_alone_and_autograd_is_refused():
    model = tiny_peft("llama")
    with packed_linear_weights(model) as packed:
        lora = [m for n, m in model.named_modules() if ".lora_" in n and type(m) is nn.Linear]
        assert lora and not any("forward" in vars(m) for m in lora)
        assert packed == sum(1 for n, m in model.named_modules() if type(m) is nn.Linear) - len(lora)
        ids, _ = _batch()
        with pytest.raises(RuntimeError, match="packed weights .inference only."):
            model.get_base_model().model.embed_tokens.weight.requires_grad_(True)
            model(ids)
    model.get_base_model().model.embed_tokens.weight.requires_grad_(False)


def test_restored_after_an_exception_and_nothing_packed_where_not_packable():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyError), packed_linear_weights(model):
        raise KeyError("boom")
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    half = tiny_model("llama").to(torch.float64)  # only float32 is packed
    with packed_linear_weights(half) as packed:
        assert packed == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_composes_the_same_packed(arch):
    peft_model = tiny_peft(arch)
    composed = ComposedLM.from_peft(peft_model, ["a", "b"])
    ids, attn = _batch(1)
    dense = composed.generate(ids, attn, max_new_tokens=6, eos_token_id=[])
    with composed.packed_weights(batch_size=3):
        assert torch.equal(composed.generate(ids, attn, max_new_tokens=6, eos_token_id=[]), dense)


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_lazy_gated_decoding_on_packed_weights_gives_the_dense_tokens(backend):
    """Lazy gated decoding (row blocks chosen per step, catch-up prefills) runs on the packed layers too."""
    from test_lazy import KW, composed, prompts

    composed_lm = composed(backend)
    ids, mask = prompts(4)
    dense = composed_lm.generate(ids, mask, lazy=True, **KW)
    assert torch.equal(dense, composed_lm.generate(ids, mask, **KW))
    with composed_lm.packed_weights(batch_size=4) as packed:
        assert packed > 0
        assert torch.equal(composed_lm.generate(ids, mask, lazy=True, **KW), dense)
    assert not any("forward" in vars(m) for m in composed_lm.modules())


def test_bfloat16_is_packed_exactly_where_the_cpu_has_bf16_kernels():
    model = tiny_model("llama").to(torch.bfloat16)
    ids, _ = _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(ids).logits.float()
    with torch.no_grad(), packed_linear_weights(model, rows=3) as packed:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert packed == 0
            return
        assert packed == sum(1 for m in model.modules() if type(m) is nn.Linear)
        torch.testing.assert_close(model(ids).logits.float(), expected, atol=3e-2, rtol=3e-2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
