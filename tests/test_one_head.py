"""The two exact shortcuts of ComposedLM (one output head on mixed hidden states; a shared trunk for experts on the
top layers) against the plain path, and every case where they must not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig
from tiny_models import PAD, VOCAB, lora_experts, tiny_model
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from compose import ComposedLM
from data.tokenizer import build_char_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXY[]"  # 5 special tokens + 27 characters = VOCAB ids
SPECS = [  # frequent letters open and close the intervals often on random tiny models
    {"interval": {"start": "[A-D]", "end": "[I-P]", "regex": True}},
    {"interval": {"start": "[Q-S]", "end": r"[W-Y]|\]", "regex": True}},
    {"interval": {"start": "[E-H]", "end": "[T-V]", "regex": True}},
]
WEIGHTS = [0.7, 1.3, -0.4]
KW = dict(max_new_tokens=16, eos_token_id=[], pad_token_id=PAD)
LAYERS = 4


def layered_peft(layer_sets, head: bool = False, seed: int = 2):
    """A 4-layer tiny Llama with LoRA experts ``e0, e1, …``, expert ``i`` on the layers ``layer_sets[i]`` (None: all),
    B matrices random; with ``head``, ``e0`` also adapts the output head."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    loras = [LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS + (["lm_head"] if head and i == 0 else []),
                        lora_dropout=0.0, layers_to_transform=layers) for i, layers in enumerate(layer_sets)]
    return lora_experts(LlamaForCausalLM(config), loras, torch.Generator().manual_seed(seed + 1))


def prompts(batch: int = 3, seed: int = 3):
    ids = torch.randint(5, VOCAB - 2, (batch, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0  # left padding
    return ids, mask


def pair(peft_model, k: int, backend: str, composition: str, **options) -> tuple[ComposedLM, ComposedLM]:
    """(plain, automatic) composed models of experts ``e0 … e{k-1}``."""
    names = [f"e{i}" for i in range(k)]
    common = dict(weights=WEIGHTS[:k], tokenizer=build_char_tokenizer(ALPHABET), specs=SPECS[:k],
                  composition=composition)
    if backend == "adapters":
        return (ComposedLM.from_peft(peft_model, names, one_head=False, shared_trunk=False, **common),
                ComposedLM.from_peft(peft_model, names, **common, **options))
    experts = [copy.deepcopy(peft_model).merge_and_unload(adapter_names=[n]).eval() for n in names]
    background = copy.deepcopy(peft_model).unload().eval()
    return (ComposedLM(background, experts, names=names, one_head=False, **common),
            ComposedLM(background, experts, names=names, **common, **options))


def assert_same(plain: ComposedLM, fast: ComposedLM, lazy_modes=()) -> None:
    """Greedy tokens equal, teacher-forced scores within 1e-4 (with the gates' masks when gated), lazy included."""
    ids, mask = prompts()
    out = plain.generate(ids, mask, **KW)
    assert torch.equal(fast.generate(ids, mask, **KW), out)
    for lazy in lazy_modes:
        assert torch.equal(fast.generate(ids, mask, lazy=lazy, **KW), out)
    full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], dim=1)
    masks = plain.interval_masks(out, ids.shape[1]) if plain.composition == "gated" else None
    if masks is not None:  # the gates open and close within the generated tokens
        generated = masks[:, :, ids.shape[1] - 1:]
        assert generated.any() and not generated.all()
    torch.testing.assert_close(fast.score(out, full_mask, masks), plain.score(out, full_mask, masks),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("composition", ["soft", "gated"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("layers", ["top", "all"])
def test_adapters_one_head_and_trunk_equal_the_plain_path(composition, k, layers):
    # different layer sets: the trunk ends at the lowest layer any expert adapts (2, then 2, then 1)
    sets = [[2, 3], [3], [1, 2, 3]] if layers == "top" else [None] * 3
    plain, fast = pair(layered_peft(sets), k, "adapters", composition)
    assert fast.paths.one_head and not plain.paths.one_head and not plain.paths.trunk_start
    assert fast.paths.trunk_start == ({1: 2, 2: 2, 3: 1}[k] if layers == "top" else 0)
    assert fast.paths.num_layers == LAYERS
    assert_same(plain, fast, lazy_modes=(True, "decode") if composition == "gated" else ())
    assert fast.floor_fallbacks == 0


@pytest.mark.parametrize("composition", ["soft", "gated"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_separate_one_head_equals_the_plain_path(composition, k):
    plain, fast = pair(layered_peft([[2, 3], [3], None]), k, "separate", composition)
    assert fast.paths.one_head and fast.paths.trunk_start == 0
    assert "separate backend" in fast.paths.trunk_why
    assert_same(plain, fast, lazy_modes=(True,) if composition == "gated" else ())


def test_trunk_layers_run_the_background_rows_and_lazy_catch_ups_only_the_top_layers():
    """Rows through each layer: trunk layers see B rows, top layers (k+1)·B; a lazy expert's catch-up runs its top
    layers only (the trunk layers run once per background forward)."""
    plain, fast = pair(layered_peft([[2, 3], [3]]), 2, "adapters", "gated")
    assert fast.paths.trunk_start == 2  # checked (one small forward) before the hooks count
    layers = fast.base_model.get_decoder().layers
    rows: dict[int, list[int]] = {i: [] for i in range(LAYERS)}
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: rows[i].append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    ids, mask = prompts()
    fast.generate(ids, mask, **KW)
    assert set(rows[0]) == set(rows[1]) == {3} and set(rows[2]) == set(rows[3]) == {9}
    expected = plain.generate(ids, mask, **KW)
    for r in rows.values():
        r.clear()
    assert torch.equal(fast.generate(ids, mask, lazy=True, **KW), expected)
    assert len(rows[0]) == len(rows[1]) and set(rows[0]) == {3}  # one background forward per step
    assert len(rows[2]) > len(rows[0])  # plus catch-ups of the top layers alone


def test_one_head_score_holds_one_components_block():
    """Teacher-forced scoring with one head: every head call is B rows by at most chunk_size positions."""
    plain, fast = pair(layered_peft([None, None]), 2, "adapters", "soft")
    assert fast.paths.one_head and plain.paths  # checked before the hook counts
    ids, mask = prompts()
    reference = plain.score(ids, mask)
    head = fast.base_model.get_output_embeddings()
    shapes = []
    head.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    for chunk in (1, 4, None):
        shapes.clear()
        torch.testing.assert_close(fast.score(ids, mask, chunk_size=chunk), reference, atol=1e-4, rtol=0)
        assert all(s[0] == 3 and s[1] <= (chunk or 6) for s in shapes) and sum(s[1] for s in shapes) == 6


# ---------------------------------------------------------------------- where the identities do not hold


def test_lora_on_the_output_head_falls_back_and_cannot_be_forced():
    model = layered_peft([None, None], head=True)
    plain, fast = pair(model, 2, "adapters", "soft")
    assert not fast.paths.one_head and "expert 'e0' adapts the output head" in fast.paths.one_head_why
    assert "one head per component" in fast.describe()
    assert_same(plain, fast)
    with pytest.raises(ValueError, match="one_head=True does not apply: expert 'e0' adapts the output head"):
        ComposedLM.from_peft(model, ["e0", "e1"], one_head=True)
    # an expert that leaves the head alone keeps one head
    assert ComposedLM.from_peft(model, ["e1"], one_head=True).paths.one_head


def test_final_logit_softcap_falls_back():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=5.0, pad_token_id=PAD, eos_token_id=2, bos_token_id=1)
    background = Gemma2ForCausalLM(config).eval()
    expert = copy.deepcopy(background)
    with torch.no_grad():
        expert.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    composed = ComposedLM(background, [expert])
    assert not composed.paths.one_head and "final_logit_softcapping" in composed.paths.one_head_why
    ids, mask = prompts()
    out = composed.generate(ids, mask, **KW)
    assert torch.equal(out, ComposedLM(background, [expert], one_head=False).generate(ids, mask, **KW))
    with pytest.raises(ValueError, match="one_head=True does not apply: .*soft-caps"):
        ComposedLM(background, [expert], one_head=True)


def test_separate_experts_with_their_own_head_fall_back():
    background, expert = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    composed = ComposedLM(background, [expert], names=["own"])
    assert not composed.paths.one_head
    assert composed.paths.one_head_why == "the expert 'own' has output head weights of its own"
    with pytest.raises(ValueError, match="has output head weights of its own"):
        ComposedLM(background, [expert], names=["own"], one_head=True)


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_floor_within_reach_runs_a_head_per_component(backend):
    """Where a log-prob could reach ``min_logprob`` the step runs the heads per component: the plain result, and
    counted (never silent)."""
    model = layered_peft([[2, 3], [3]])
    plain, fast = pair(model, 2, backend, "soft", min_logprob=-1.0)
    plain.min_logprob = -1.0
    assert fast.paths.one_head  # the path applies; each step checks the floor
    assert_same(plain, fast)
    assert fast.floor_fallbacks > 0 and "near the floor" in fast.describe()
    _, far = pair(model, 2, backend, "gated")
    ids, mask = prompts()
    far.generate(ids, mask, **KW)
    assert far.floor_fallbacks == 0


def test_shared_trunk_forced_where_it_does_not_apply():
    with pytest.raises(ValueError, match="shared_trunk=True does not apply: an expert adapts layer 0"):
        ComposedLM.from_peft(layered_peft([[2, 3], None]), ["e0", "e1"], shared_trunk=True)
    background = tiny_model("llama")
    with pytest.raises(ValueError, match="shared_trunk=True does not apply: the separate backend"):
        ComposedLM(background, [copy.deepcopy(background)], shared_trunk=True)
    with pytest.raises(ValueError, match="one_head must be None"):
        ComposedLM(background, [], one_head="yes")
    forced = ComposedLM.from_peft(layered_peft([[2, 3], [3]]), ["e0", "e1"], shared_trunk=True, one_head=True)
    assert forced.paths.trunk_start == 2 and "layers 0-1 of 4" in forced.describe()


def test_gemma3_sliding_window_layers_share_the_trunk():
    """Gemma-3's layout (sliding-window and full layers, a rotary embedding per layer type), the window exceeded
    within the generation: both shortcuts and lazy catch-ups over the trunk give the plain tokens."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                              final_logit_softcapping=None, pad_token_id=PAD, eos_token_id=2, bos_token_id=1)
    loras = [LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, layers_to_transform=layers)
             for layers in ([2, 3], [3])]
    plain, fast = pair(lora_experts(Gemma3ForCausalLM(config), loras), 2, "adapters", "soft")
    assert fast.paths.one_head and fast.paths.trunk_start == 2
    assert_same(plain, fast)
    plain.composition = fast.composition = "gated"
    ids, mask = prompts()
    gates = [lambda prefix: (prefix[:, -1] % 3) == 0, lambda prefix: (prefix[:, -1] % 2) == 1]
    out = plain.generate(ids, mask, gates=gates, **KW)
    for lazy in (True, "decode"):
        assert torch.equal(fast.generate(ids, mask, gates=gates, lazy=lazy, **KW), out)


def test_from_manifest_takes_the_path_options(tmp_path):
    from compose.export import export_composition

    model = layered_peft([None, None], head=True)
    export_composition(tmp_path / "export", tokenizer=build_char_tokenizer(ALPHABET), peft_model=model,
                       adapter_names=["e0", "e1"])
    assert not ComposedLM.from_manifest(tmp_path / "export", one_head=False).paths.one_head
    with pytest.raises(ValueError, match="one_head=True does not apply: expert 'e0' adapts the output head"):
        ComposedLM.from_manifest(tmp_path / "export", one_head=True)
    loaded = ComposedLM.from_manifest(tmp_path / "export", lazy=True)
    assert loaded.lazy is True and not loaded.paths.one_head
