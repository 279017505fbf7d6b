"""Merge baselines and the linear-setting bridge (docs/method.md, when the rule is exact)."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from compose import ComposedLM
from compose.merges import max_logprob_gap, merge_adapters, task_arithmetic


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 24, (3, 10), generator=g)


def lora_model(background, names=("a", "b"), seed=2):
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(background), config, adapter_name=names[0])
    for n in names[1:]:
        model.add_adapter(n, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def test_linear_setting_task_arithmetic_equals_composition():
    """Experts that differ only in the output layer: merged logits = composed logits + per-position const."""
    background = tiny_llama()
    experts = []
    for i in range(3):
        e = copy.deepcopy(background)
        with torch.no_grad():
            e.lm_head.weight.add_(torch.randn_like(e.lm_head.weight, generator=None) * (0.5 + i))
        experts.append(e)
    weights = [1.0, 0.5, 1.0]
    ids = inputs()
    merged = task_arithmetic(background, experts, weights)
    with torch.no_grad():
        merged_lp = merged(input_ids=ids).logits.log_softmax(-1)
    composed_lp = ComposedLM(background, experts, weights=weights).score(ids)
    assert (merged_lp - composed_lp).abs().max() < 1e-4
    assert max_logprob_gap(merged_lp, composed_lp) < 1e-4


def test_outside_linear_setting_the_two_differ():
    background = tiny_llama()
    model = lora_model(background)
    ids = inputs()
    composed_lp = ComposedLM.from_peft(model, ["a", "b"]).score(ids)
    name = merge_adapters(model, ["a", "b"], "task_arithmetic")
    merged_lp = ComposedLM.from_peft(model, [name]).score(ids)
    assert max_logprob_gap(merged_lp, composed_lp) > 1e-2


def test_lora_task_arithmetic_is_the_sum_of_deltas():
    """peft's `cat` merge of LoRA adapters equals θ_b + Σ(θ_i − θ_b) on merged full copies."""
    background = tiny_llama()
    model = lora_model(background)
    full = []
    for n in ("a", "b"):
        single = lora_model(background)  # same seed → same adapters
        single.set_adapter(n)
        full.append(single.merge_and_unload(adapter_names=[n]))
    ids = inputs()
    with torch.no_grad():
        expected = task_arithmetic(background, full)(input_ids=ids).logits.log_softmax(-1)
    name = merge_adapters(model, ["a", "b"], "task_arithmetic")
    got = ComposedLM.from_peft(model, [name]).score(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # DARE keeping every entry (density 1) is the same sum of deltas
    dare = merge_adapters(model, ["a", "b"], "dare", density=1.0, merged_name="dare_all")
    torch.testing.assert_close(ComposedLM.from_peft(model, [dare]).score(ids), expected, atol=1e-3, rtol=1e-3)


def test_ties_and_dare_add_an_adapter_that_differs_from_task_arithmetic():
    model = lora_model(tiny_llama())
    ids = inputs()
    scores = {}
    for method in ("task_arithmetic", "ties", "dare"):
        name = merge_adapters(model, ["a", "b"], method, seed=0)
        assert name in model.peft_config
        scores[method] = ComposedLM.from_peft(model, [name]).score(ids)
    assert (scores["ties"] - scores["task_arithmetic"]).abs().max() > 1e-4
    assert (scores["dare"] - scores["task_arithmetic"]).abs().max() > 1e-4


def test_unknown_merge_method_is_refused():
    model = lora_model(tiny_llama())
    with pytest.raises(ValueError, match="merge method 'avg' is not one of task_arithmetic, ties, dare"):
        merge_adapters(model, ["a", "b"], "avg")


def test_a_merge_for_a_block_is_gone_afterwards_and_the_active_adapter_is_back(recwarn):
    from compose.merges import merged_adapter

    model = lora_model(tiny_llama())
    model.set_adapter("b")
    with merged_adapter(model, ["a", "b"], "ties", seed=0) as name:
        assert name in model.peft_config
        model.set_adapter(name)  # decoded as one model: the merge is the active adapter
        ComposedLM(model, []).score(inputs())
    assert name not in model.peft_config and model.active_adapter == "b"
    assert not [w for w in recwarn if "deleted" in str(w.message)]  # peft's warning on deleting the active adapter
    with pytest.raises(RuntimeError), merged_adapter(model, ["a", "b"]) as name:
        raise RuntimeError("the block fails")
    assert name not in model.peft_config and model.active_adapter == "b"
