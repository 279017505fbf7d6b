"""Lightning modules and callbacks on tiny models (seconds, CPU)."""

import copy

import lightning.pytorch as pl
import pytest
import torch

from data.datamodule import TaskDataModule
from data.tasks import Expert
from data.tasks.letters import LettersConfig, LettersTask, RuleSet
from data.tokenizer import build_char_tokenizer
from lightning_modules.background import BackgroundLM
from lightning_modules.expert import ExpertLM, ExpertSettings, task_targets
from lightning_modules.pipeline.config import ModelConfig
from lightning_modules.pipeline.models import build_causal_lm
from losses import off_mask_divergence, task_nll

ALPHABET = "ABCDEFGH"
RULES = [RuleSet("A_to_B", {"A": "B"}), RuleSet("C_to_D", {"C": "D"})]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def tiny_model(tokenizer, arch="llama"):
    torch.manual_seed(0)
    return build_causal_lm(ModelConfig(arch=arch, hidden_size=32, num_layers=1, num_heads=2,
                                       intermediate_size=64), tokenizer)


def expert_batch(tokenizer, reg_data="own", n=64):
    """One training batch of both experts' rows (and the datamodule it came from)."""
    cfg = LettersConfig(alphabet=ALPHABET, min_len=4, max_len=6, n_train=n, n_val=16, n_test=16)
    task = LettersTask(cfg, [Expert(r.name, {"rules": dict(r.rules)}) for r in RULES], reg_data=reg_data)
    assert task.tokenizer.get_vocab() == tokenizer.get_vocab()
    dm = TaskDataModule(task, "experts", batch_size=n, corruption_prob=0.0)
    return next(iter(dm.train_dataloader())), dm


def train_steps(module, batch, n: int) -> None:
    """n optimizer steps of `module.training_step` on one batch, outside a Trainer."""
    opt = module.configure_optimizers()["optimizer"]
    for _ in range(n):
        opt.zero_grad()
        module.training_step(batch, 0).backward()
        opt.step()


def trainer(steps):
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)


def test_background_lm_learns(tokenizer):
    batch, _ = expert_batch(tokenizer)
    module = BackgroundLM(tiny_model(tokenizer), lr=1e-2, max_steps=30, warmup_ratio=0.0)
    first = module.training_step(batch, 0).item()
    train_steps(module, batch, 30)
    assert module.training_step(batch, 0).item() < 0.5 * first


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_background_logits_are_the_frozen_background(tokenizer, mode):
    background = tiny_model(tokenizer)
    reference = copy.deepcopy(background)
    settings = ExpertSettings(mode=mode, lr=1e-2, max_steps=5, warmup_ratio=0.0)
    module = ExpertLM(background, [r.name for r in RULES], settings)
    batch, _ = expert_batch(tokenizer)
    train_steps(module, batch, 5)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(module.background_logits(ids, attn), ref)
    # the experts moved away from the background (they trained), each on its own rows
    assert (module.expert_logits(ids, attn, batch["expert_index"]) - ref).abs().max() > 1e-3


def test_mixed_adapter_forward_equals_each_adapter_alone(tokenizer):
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], ExpertSettings(lr=1e-2, max_steps=5))
    for p in module.model.parameters():  # make every adapter non-trivial
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)
    batch, _ = expert_batch(tokenizer)
    ids, attn, idx = batch["input_ids"], batch["attention_mask"], batch["expert_index"]
    mixed = module.expert_logits(ids, attn, idx)
    for i, name in enumerate(module.names):
        rows = idx == i
        module.model.set_adapter(name)
        with torch.no_grad():
            alone = module.model(input_ids=ids[rows], attention_mask=attn[rows]).logits
        torch.testing.assert_close(mixed[rows].detach(), alone, atol=1e-5, rtol=1e-5)


def test_mixed_adapter_gradients_reach_only_each_rows_adapter(tokenizer):
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], ExpertSettings(lr=1e-2, max_steps=5))
    batch, _ = expert_batch(tokenizer)
    only_first = {k: (v[batch["expert_index"] == 0] if v.dim() else v) for k, v in batch.items()}
    module.training_step(only_first, 0).backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "A_to_B" in n)
    assert all(g is None or g.abs().sum() == 0 for n, g in grads.items() if "C_to_D" in n)


def test_every_adapter_keeps_training_across_steps(tokenizer):
    """Leaving peft's disable_adapter() must not freeze every adapter but the active one."""
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], ExpertSettings(lr=1e-2, max_steps=5))
    batch, _ = expert_batch(tokenizer)
    for _ in range(2):
        module.zero_grad()
        module.training_step(batch, 0).backward()
        for name in module.names:
            grads = [p.grad for n, p in module.model.named_parameters() if f"lora_B.{name}." in n]
            assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), name
    # composing (as validation does) leaves every adapter trainable
    composed = module.composed_model()
    composed.score(batch["input_ids"], batch["attention_mask"])
    composed.generate(batch["input_ids"][:2, :4], max_new_tokens=2)
    assert all(p.requires_grad for n, p in module.model.named_parameters() if "lora_" in n)


def test_regularizer_keeps_experts_on_background_off_mask(tokenizer):
    """Same data and steps: λ>0 gives a much smaller off-mask KL than plain fine-tuning (λ=0)."""
    batch, _ = expert_batch(tokenizer, reg_data="background")
    kls = {}
    for lam in (0.0, 10.0):
        torch.manual_seed(0)
        settings = ExpertSettings(reg_weight=lam, temperature=1.0, lr=2e-2, max_steps=40, warmup_ratio=0.0)
        module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], settings)
        train_steps(module, batch, 40)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            logits = module.expert_logits(ids, attn, batch["expert_index"])
        kls[lam] = off_mask_divergence(logits, module.background_logits(ids, attn), batch["targets"],
                                       batch["masks"][:, 0]).item()
    assert kls[10.0] < 0.5 * kls[0.0], kls


@pytest.mark.parametrize("reg_data", ["composition", "background"])
def test_task_targets_by_row_kind(tokenizer, reg_data):
    """Task rows: every target. Compositional regularizer rows: the expert's own mask only (its rule's
    outputs there). Copy rows: none (their masks hold copies of the sources)."""
    batch, _ = expert_batch(tokenizer, reg_data=reg_data)
    targets, own_mask, task = batch["targets"], batch["masks"][:, 0], batch["is_task"].bool()
    scored = task_targets(batch) != -100
    assert torch.equal(scored[task], (targets != -100)[task])
    reg_scored = scored[~task]
    assert torch.equal(reg_scored, own_mask[~task] if reg_data == "composition" else torch.zeros_like(reg_scored))
    assert (reg_scored.any(1)).any() == (reg_data == "composition")
    assert torch.equal(task_targets(batch)[scored], targets[scored])
    on_mask = task_targets(batch, on_mask_only=True) != -100
    assert torch.equal(on_mask, scored & own_mask)
    # the training loss (λ = 0) is the NLL of exactly those targets
    settings = ExpertSettings(reg_weight=0.0, max_steps=1)
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], settings)
    with torch.no_grad():
        logits = module.expert_logits(batch["input_ids"], batch["attention_mask"], batch["expert_index"])
        expected = task_nll(logits, task_targets(batch))
        assert module.training_step(batch, 0).item() == pytest.approx(expected.item(), rel=1e-6)


def test_expert_lm_fits_with_lightning_trainer(tokenizer):
    _, dm = expert_batch(tokenizer)
    settings = ExpertSettings(max_steps=3, log_every_n_steps=1)
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], settings)
    t = trainer(3)
    t.fit(module, datamodule=dm)
    assert t.global_step == 3 and "train/loss" in t.logged_metrics


def test_head_mode_trains_only_the_output_layer_and_merges_exactly(tokenizer):
    """The linear setting: experts that fine-tune only the output layer; task arithmetic == composition."""
    from compose.merges import max_logprob_gap, task_arithmetic

    settings = ExpertSettings(mode="head", lr=1e-2, max_steps=5, warmup_ratio=0.0)
    module = ExpertLM(tiny_model(tokenizer), [r.name for r in RULES], settings)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lm_head" in n for n in trainable)
    batch, _ = expert_batch(tokenizer)
    train_steps(module, batch, 5)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    composed = module.composed_model().score(ids, attn)
    merged = task_arithmetic(module.background, [module.experts[n] for n in module.names])
    with torch.no_grad():
        merged_lp = merged(input_ids=ids, attention_mask=attn).logits.log_softmax(-1)
    assert max_logprob_gap(merged_lp, composed, attn.bool()) < 1e-4
    assert max_logprob_gap(module.background_logits(ids, attn), composed, attn.bool()) > 1e-3  # experts moved


def test_composition_evaluation_logs_the_tasks_metrics_on_limited_val_rows(tokenizer):
    """The validation callback composes every expert in play, in the task's order, and logs under
    `val/composed/` what `Task.composition_metrics` returns on at most `limit` compositional val rows."""
    from lightning_modules.callbacks import CompositionEvaluation

    calls = []

    class SpyTask(LettersTask):
        def composition_metrics(self, model, dataset, batch_size, active_threshold=0.01):
            calls.append((len(dataset), list(model.names), batch_size, active_threshold))
            return super().composition_metrics(model, dataset, batch_size, active_threshold)

    cfg = LettersConfig(alphabet=ALPHABET, min_len=4, max_len=6, n_train=16, n_val=16, n_test=16)
    task = SpyTask(cfg, [Expert(r.name, {"rules": dict(r.rules)}) for r in RULES])
    module = ExpertLM(tiny_model(tokenizer), task.trained, ExpertSettings(max_steps=1))
    callback = CompositionEvaluation(task, batch_size=4, limit=6, active_threshold=0.05)
    t = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[callback])
    t.validate(module, datamodule=TaskDataModule(task, "experts", batch_size=16), verbose=False)
    assert calls == [(6, ["A_to_B", "C_to_D"], 4, 0.05)]
    for key in ("exact_match", "nll", "projectivity_error", "A_to_B/skill_accuracy", "C_to_D/on_mask_kl",
                "A_to_B/active_precision", "C_to_D/active_recall", "failures/correct", "overlap/A_to_B__C_to_D"):
        assert key in callback.last, key
        assert t.callback_metrics[f"val/composed/{key}"].item() == pytest.approx(callback.last[key])
