"""Feature-space composition (docs/method.md, when the rule is exact): the token bijection, the factored head, the per-feature regularizer,
the features task and its pipeline."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from compose import compose_logprobs
from compose.features import factorization_gap
from data.tasks import Expert, TaskError
from data.tasks.features import FeaturesConfig, FeaturesTask, build_feature_tokenizer, feature_map
from lightning_modules.pipeline.config import ConfigError, load_config
from lightning_modules.pipeline.feature_head import (
    factor_output_layer,
    factorization_residual,
    merge_factored_head,
)
from losses import divergence, off_mask_divergence
from losses.features import FeatureMap, FeatureMapError, feature_divergence, feature_logprobs, feature_masks

ROOT = Path(__file__).resolve().parents[1]
DEFAULT, FEATURES = ROOT / "configs" / "default.yaml", ROOT / "configs" / "experiment" / "features.yaml"
LETTER = Expert("letter", {"rules": {"a": "b", "A": "B"}})
CASE = Expert("case", {"rules": {v: v.upper() for v in "aeiou"}})
SMALL = dict(n_train=64, n_val=16, n_test=16)


def shuffled_map(sizes=(3, 2), seed=0) -> FeatureMap:
    cells = [(i, j) for i in range(sizes[0]) for j in range(sizes[1])]
    random.Random(seed).shuffle(cells)
    return FeatureMap.from_tokens(["letter", "case"], [[f"l{i}" for i in range(sizes[0])], [f"c{j}" for j in range(sizes[1])]],
                                  cells)


def factored_llama(fmap: FeatureMap, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=fmap.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    return factor_output_layer(AutoModelForCausalLM.from_config(config), fmap)


# ---------------------------------------------------------------- the bijection


def test_feature_map_refuses_what_is_not_a_bijection_in_one_line():
    names, values = ["letter", "case"], [["a", "b"], ["lower", "upper"]]
    fmap = FeatureMap.from_tokens(names, values, [(0, 0), (1, 1), (0, 1), (1, 0)], tokens=list("wxyz"))
    assert fmap.grid.tolist() == [[0, 2], [3, 1]] and fmap.token_features().tolist() == [[0, 0], [1, 1], [0, 1], [1, 0]]
    bad = {
        "token 0 \\('w'\\) and token 2 \\('y'\\) both map to \\(letter=a, case=lower\\): not a bijection":
            [(0, 0), (1, 1), (0, 0), (1, 0)],
        "\\(letter=b, case=lower\\) has no token: not a bijection \\(3 tokens, 4 feature tuples 2 × 2\\)":
            [(0, 0), (1, 1), (0, 1)],
        "token 1 \\('x'\\) has features \\(1, 2\\)": [(0, 0), (1, 2), (0, 1), (1, 0)],
    }
    for message, features in bad.items():
        with pytest.raises(FeatureMapError, match=message) as err:
            FeatureMap.from_tokens(names, values, features, tokens=list("wxyz"))
        assert "\n" not in str(err.value)


def test_feature_tokenizer_is_letter_times_case_and_bad_alphabets_are_named():
    tok = build_feature_tokenizer("abAB")
    fmap = feature_map(tok)
    assert fmap.sizes == (7, 2) and fmap.vocab_size == len(tok) == 14  # (a, b, 5 specials) × (lower, upper)
    ids = tok.convert_tokens_to_ids
    assert fmap.grid[0].tolist() == ids(["a", "A"]) and fmap.grid[2].tolist() == ids(["<pad>", "<PAD>"])
    assert tok("aB")["input_ids"] == ids(["a", "B"])
    for alphabet, named in (("abcAB", "letter=c, case=upper"), ("ab1AB", "letter=1, case=upper")):
        with pytest.raises(TaskError, match=f"task.alphabet='{alphabet}': .*\\({named}\\) has no token"):
            FeaturesConfig(alphabet=alphabet, **SMALL)


# ---------------------------------------------------------------- the factored head


def test_factored_head_joint_is_the_product_of_its_marginals():
    fmap = shuffled_map((5, 3))
    model = factored_llama(fmap).eval()
    ids = torch.randint(0, fmap.vocab_size, (3, 7))
    logits = model(ids).logits
    joint = logits.log_softmax(-1)[..., fmap.grid]  # [B, T, 5, 3]
    letter, case = feature_logprobs(logits, fmap)
    assert torch.allclose(joint, letter[..., :, None] + case[..., None, :], atol=1e-5)
    assert factorization_gap(logits.log_softmax(-1), fmap).abs().max() < 1e-5
    # merged into a plain weight (what the run saves), the model computes the same, still factored
    merge_factored_head(model)
    assert [n for n, _ in model.named_parameters()][-1] == "lm_head.weight"
    assert torch.allclose(model(ids).logits, logits, atol=1e-6)
    assert factorization_residual(model.lm_head.weight, fmap) < 1e-6
    # an ordinary head is not factored
    plain = AutoModelForCausalLM.from_config(model.config).eval()
    assert factorization_residual(plain.lm_head.weight, fmap) > 1e-3
    assert factorization_gap(plain(ids).logits.log_softmax(-1), fmap).mean() > 1e-4


def test_factored_head_trains_only_its_feature_tables():
    fmap = shuffled_map()
    model = factored_llama(fmap)
    names = [n for n, _ in model.named_parameters() if n.startswith("lm_head")]
    assert names == ["lm_head.parametrizations.weight.original0", "lm_head.parametrizations.weight.original1"]
    loss = model(torch.randint(0, fmap.vocab_size, (2, 5))).logits.logsumexp(-1).sum()
    loss.backward()
    assert model.lm_head.parametrizations.weight.original0.grad.shape == (3, 16)
    with pytest.raises(ValueError, match="the output layer has 6 tokens but the task's feature map covers 12"):
        factor_output_layer(AutoModelForCausalLM.from_config(model.config), shuffled_map((6, 2)))


# ---------------------------------------------------------------- composition and the regularizer in feature space


def test_token_composition_of_factored_models_is_composition_per_feature():
    fmap = shuffled_map((4, 3), seed=1)
    gen = torch.Generator().manual_seed(0)
    index = fmap.token_features()

    def factored():  # logits a[letter(v)] + b[case(v)]
        return torch.randn(2, 5, 4, generator=gen)[..., index[:, 0]] + torch.randn(2, 5, 3, generator=gen)[..., index[:, 1]]

    lp_b, lp_1, lp_2 = (factored().log_softmax(-1) for _ in range(3))
    composed = compose_logprobs(lp_b, [lp_1, lp_2])
    per_feature = [compose_logprobs(b, [e1, e2])
                   for b, e1, e2 in zip(*(feature_logprobs(lp, fmap) for lp in (lp_b, lp_1, lp_2)), strict=True)]
    joint = composed[..., fmap.grid]
    assert torch.allclose(joint, per_feature[0][..., :, None] + per_feature[1][..., None, :], atol=1e-5)


def test_feature_divergence_against_a_float64_reference():
    fmap = shuffled_map((3, 2), seed=2)
    gen = torch.Generator().manual_seed(1)
    expert, background = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 4, 6, generator=gen)
    targets = torch.tensor([[-100, 1, 2, 3], [0, 4, 5, -100]])
    own = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    owned = torch.tensor([[True, False], [True, False]])  # both rows' expert owns feature 0 only
    masks = feature_masks(own, owned)
    assert masks.shape == (2, 2, 4) and torch.equal(masks[0], own) and not masks[1].any()
    got = feature_divergence(expert, background, targets, masks, fmap, temperature=2.0)

    def marginals(logits):
        p = (logits.double() / 2.0).softmax(-1)
        return [torch.stack([p[..., fmap.grid[i, :]].sum(-1) for i in range(3)], -1),
                torch.stack([p[..., fmap.grid[:, j]].sum(-1) for j in range(2)], -1)]

    ref = 0.0
    for j, (pi, pb) in enumerate(zip(marginals(expert), marginals(background), strict=True)):
        kl = (pb * (pb.log() - pi.log())).sum(-1)
        keep = (targets != -100) & ~masks[j]
        ref += kl[keep].mean()
    assert torch.allclose(got.double(), ref, atol=1e-6)
    # factored logits, no mask: the per-feature sum is the token-space KL
    index = fmap.token_features()
    fe, fb = (torch.randn(2, 4, 3, generator=gen)[..., index[:, 0]] + torch.randn(2, 4, 2, generator=gen)[..., index[:, 1]]
              for _ in range(2))
    none = torch.zeros(2, 4, dtype=torch.bool)
    assert torch.allclose(feature_divergence(fe, fb, targets, torch.zeros(2, 2, 4, dtype=torch.bool), fmap),
                          off_mask_divergence(fe, fb, targets, none), atol=1e-5)
    assert torch.allclose(divergence(fe, fb).double(), divergence(fe.double(), fb.double()).double(), atol=1e-5)


# ---------------------------------------------------------------- the task


def test_features_task_rows_reference_and_ownership():
    task = FeaturesTask(FeaturesConfig(**SMALL), [LETTER, CASE], reg_data="composition")
    assert (task.owned_features("letter"), task.owned_features("case")) == (("letter",), ("case",))
    assert task.reference("aAeEbz") == "BBEEbz"
    comp = task.compositional_dataset("test")
    assert all("a" in x for x in comp["x"])  # every input needs both experts at one position at least
    for row in comp:
        assert row["y"] == task.reference(row["x"])
        n, tok = len(row["x"]), task.tokenizer
        for i, sources in enumerate(("aA", "aeiou")):
            assert row["masks"][i][n + 1:2 * n + 1] == [int(ch in sources) for ch in row["x"]]
        assert tok.decode(row["input_ids"][n + 2:2 * n + 2]) == row["y"]
    train = task.expert_dataset("train")
    composed_rows = train.filter(lambda r: r["is_task"] == 0)
    assert len(composed_rows) == 2 * SMALL["n_train"] and set(composed_rows["task_on_mask"]) == {0}
    assert task.feature_map.vocab_size == len(task.tokenizer) == 62


def test_features_task_refuses_two_owners_of_one_feature_at_one_letter():
    other = Expert("upper_a", {"rules": {"a": "A"}})
    with pytest.raises(TaskError, match="experts 'case' and 'upper_a' both own feature 'case' and share source "
                                        "letter 'a'"):
        FeaturesTask(FeaturesConfig(**SMALL), [LETTER, CASE, other])
    task = FeaturesTask(FeaturesConfig(**SMALL), [LETTER, CASE, other], allow_overlap=True)
    assert any("share source letter 'a'" in note for note in task.notes)
    both = FeaturesTask(FeaturesConfig(**SMALL), [Expert("both", {"rules": {"a": "B"}})])
    assert both.owned_features("both") == ("letter", "case")


def test_feature_options_are_checked_before_anything_is_trained(tmp_path):
    from lightning_modules.pipeline.stages import plan_run

    with pytest.raises(ConfigError, match="model.head='square' is not one of token, factored"):
        load_config([str(FEATURES)], base=DEFAULT, overrides=["model.head=square"])
    with pytest.raises(ConfigError, match="model.head=factored needs a model built from scratch and LoRA experts"):
        load_config([str(FEATURES)], base=DEFAULT, overrides=["expert.mode=full"])
    with pytest.raises(ConfigError, match="model.head=factored needs a model built from scratch and LoRA experts"):
        load_config([str(FEATURES)], base=DEFAULT, overrides=["expert.lora.target_modules=[q_proj,lm_head]"])
    for override in ("model.head=factored", "expert.regularizer=features"):
        cfg = load_config(base=DEFAULT, overrides=[override, f"output_dir={tmp_path / 'x'}"])
        with pytest.raises(ConfigError, match=f"{override} needs a task with a feature map \\(task.name=features\\); "
                                              "task 'letters' has none"):
            plan_run(cfg)
    assert not (tmp_path / "x").exists()
    # a background given by path must have a factored head when model.head=factored
    fmap = feature_map(build_feature_tokenizer(FeaturesConfig().alphabet))
    plain = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=fmap.vocab_size, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         tie_word_embeddings=False))
    plain.save_pretrained(tmp_path / "plain")
    cfg = load_config([str(FEATURES)], base=DEFAULT, overrides=[f"background.path={tmp_path / 'plain'}",
                                                                f"output_dir={tmp_path / 'y'}"])
    with pytest.raises(ConfigError, match="background.path: model.head=factored, but its output layer is not a sum of "
                                          "per-feature rows"):
        plan_run(cfg)
    merge_factored_head(factor_output_layer(plain, fmap)).save_pretrained(tmp_path / "factored")
    cfg = load_config([str(FEATURES)], base=DEFAULT, overrides=[f"background.path={tmp_path / 'factored'}",
                                                                f"output_dir={tmp_path / 'z'}"])
    assert plan_run(cfg).task.feature_map.sizes == (31, 2)


# ---------------------------------------------------------------- pipeline


def test_fast_features_pipeline_in_process(tmp_path):
    from lightning_modules.pipeline.stages import run

    cfg = load_config([str(FEATURES), str(ROOT / "configs" / "debug" / "fast.yaml")], base=DEFAULT, overrides=[
        f"output_dir={tmp_path / 'run'}", "task.min_len=4", "task.max_len=6", "ablations=[]", "baselines=[]",
        "ablation_ks=[]"])
    summary = run(cfg)
    comp = summary["composition"]
    assert 0.0 <= comp["exact_match"] <= 1.0 and comp["k"] == 2
    features = comp["features"]
    for key in ("letter/exact_match", "case/exact_match", "letter/projectivity_error", "letter/case_kl",
                "case/letter_kl", "factorization_gap/composed"):
        assert features[key] >= 0.0, key
    for component in ("background", "letter", "case", "composed"):  # a factored head: every joint is a product
        assert features[f"factorization_gap/{component}"] < 1e-4
    from lightning_modules.pipeline.models import load_pretrained

    background = load_pretrained(tmp_path / "run" / "background")  # a plain HF model whose head is factored
    fmap = feature_map(build_feature_tokenizer(cfg.task.alphabet))
    assert factorization_residual(background.lm_head.weight, fmap) < 1e-5
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Feature space" in report and "KL(p ‖ Π_j p^j)" in report
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["composition"]["features"] == features
