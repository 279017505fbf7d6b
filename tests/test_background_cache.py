"""The background cache of the regularizer (losses/background_cache.py): its math against the exact divergence,
the per-row corruption that keys it, and training with it (tiny models, seconds)."""

import lightning.pytorch as pl
import pytest
import torch

from data.collate import Collator
from data.datamodule import TaskDataModule
from data.tasks import Expert
from data.tasks.letters import LettersConfig, LettersTask
from data.tokenizer import build_char_tokenizer
from lightning_modules.expert import ExpertLM, ExpertSettings
from lightning_modules.pipeline.config import ConfigError, ModelConfig, load_config
from lightning_modules.pipeline.models import build_causal_lm
from losses import divergence, off_mask_divergence, region_positions
from losses.background_cache import CACHE_KINDS, BackgroundCache, BackgroundTopK, topk_divergence

ALPHABET = "ABCDEFGH"
EXPERTS = [Expert("A_to_B", {"rules": {"A": "B"}}), Expert("C_to_D", {"rules": {"C": "D"}})]


def peaked_logits(n: int = 300, vocab: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Background and expert logits with a trained model's spread (a few likely tokens, a long tail)."""
    gen = torch.Generator().manual_seed(seed)
    background = torch.randn(n, vocab, generator=gen) * 3
    return background, background + torch.randn(n, vocab, generator=gen) * 0.5


# --- the math ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_topk_divergence_is_exact_when_k_covers_the_vocabulary(kind, temperature):
    background, expert = peaked_logits()
    expert.requires_grad_(True)
    exact = divergence(expert, background, kind, temperature=temperature)
    (grad_exact,) = torch.autograd.grad(exact.sum(), expert)
    for k in (64, 1000):  # k = V, and k > V (clamped to V)
        cached = BackgroundTopK.from_logits(background, k, (temperature,))
        value = topk_divergence(expert, cached, kind, temperature=temperature)
        (grad,) = torch.autograd.grad(value.sum(), expert)
        torch.testing.assert_close(value, exact, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(grad, grad_exact, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_topk_divergence_is_a_lower_bound_that_grows_with_k(kind, temperature):
    """Bucketing is a coarse-graining: by data processing it never exceeds the exact f-divergence, and a larger
    top-k refines the partition."""
    background, expert = peaked_logits()
    exact = divergence(expert, background, kind, temperature=temperature)
    previous = torch.zeros_like(exact)
    for k in (1, 2, 4, 8, 16, 32, 48, 63):
        value = topk_divergence(expert, BackgroundTopK.from_logits(background, k, (temperature,)), kind,
                                temperature=temperature)
        assert (value <= exact + 1e-5).all()
        assert (value >= previous - 1e-5).all()
        previous = value


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_forward_kl_error_is_the_tail_mass_times_the_tail_kl(temperature):
    """The chain rule of KL: exact − bucketed = r_b · KL(p_b(· | tail) ‖ p_i(· | tail)), so the error is bounded by
    the background's tail mass; at T = 1 and k = 16 of 64 it is a few % here."""
    background, expert = peaked_logits()
    k = 16
    cached = BackgroundTopK.from_logits(background, k, (temperature,))
    error = divergence(expert, background, temperature=temperature) - topk_divergence(expert, cached,
                                                                                       temperature=temperature)
    lp_b = (background.double() / temperature).log_softmax(-1)
    lp_i = (expert.double() / temperature).log_softmax(-1)
    tail = torch.ones_like(lp_b, dtype=torch.bool).scatter(-1, cached.ids.long(), False)
    lb_tail = lp_b.masked_fill(~tail, -torch.inf)
    li_tail = lp_i.masked_fill(~tail, -torch.inf)
    r_b = lb_tail.logsumexp(-1)
    cond_b, cond_i = lb_tail - r_b.unsqueeze(-1), li_tail - li_tail.logsumexp(-1, keepdim=True)
    tail_kl = (cond_b.exp() * (cond_b - cond_i)).where(tail, 0.0).sum(-1)
    torch.testing.assert_close(error.double(), r_b.exp() * tail_kl, atol=1e-5, rtol=1e-4)
    if temperature == 1.0:
        assert error.sum() / divergence(expert, background).sum() < 0.08  # measured 0.04


def test_cached_logprobs_at_several_temperatures():
    background, _ = peaked_logits(n=10, vocab=20)
    cached = BackgroundTopK.from_logits(background, 5, (3.0, 1.0))
    for temperature in (3.0, 1.0):
        top, rest = cached.logprobs(temperature)
        exact = (background / temperature).log_softmax(-1)
        torch.testing.assert_close(top, exact.gather(-1, cached.ids.long()))
        torch.testing.assert_close(rest.exp(), 1 - top.exp().sum(-1))
    with pytest.raises(ValueError, match="temperatures"):
        cached.logprobs(2.0)


def test_topk_divergence_refuses_log_ratio_and_mismatched_shapes():
    background, expert = peaked_logits(n=4, vocab=8)
    cached = BackgroundTopK.from_logits(background, 3)
    with pytest.raises(ValueError, match="log_ratio"):
        topk_divergence(expert, cached, "log_ratio")
    with pytest.raises(ValueError, match="do not match"):
        topk_divergence(expert[:3], cached)


def test_off_mask_divergence_from_the_cache_equals_the_exact_one():
    gen = torch.Generator().manual_seed(1)
    background, expert = torch.randn(3, 7, 11, generator=gen), torch.randn(3, 7, 11, generator=gen)
    targets = torch.randint(0, 11, (3, 7), generator=gen)
    targets[:, :2] = -100
    mask = torch.rand(3, 7, generator=gen) < 0.3
    keep = region_positions(targets, mask, "off")
    cached = BackgroundTopK.from_logits(background[keep], 11, (2.0,))
    for row_weight in (None, torch.tensor([1.0, 0.0, 1.0])):
        exact = off_mask_divergence(expert, background, targets, mask, temperature=2.0, row_weight=row_weight)
        value = off_mask_divergence(expert, cached, targets, mask, temperature=2.0, row_weight=row_weight)
        torch.testing.assert_close(value, exact)
    with pytest.raises(ValueError, match="off-mask target positions"):
        off_mask_divergence(expert, cached[:-1], targets, mask, temperature=2.0)


def test_background_cache_stores_and_gathers_by_key():
    background, _ = peaked_logits(n=5, vocab=12)
    cache = BackgroundCache(4, temperatures=(3.0, 1.0, 3.0))
    assert cache.temperatures == (3.0, 1.0)
    cache.add([(0, 0), (7, 1)], background, [2, 3])
    assert cache.missing([(7, 1), (7, 0), (0, 0)]) == [1]
    both = cache.gather([(7, 1), (0, 0)])
    reference = BackgroundTopK.from_logits(background, 4, (3.0, 1.0))
    torch.testing.assert_close(both.logits, torch.cat([reference.logits[2:], reference.logits[:2]]))
    assert cache.nbytes() == 5 * (4 * 4 + 4 * 4 + 2 * 4)
    with pytest.raises(KeyError):
        cache.gather([(1, 0)])
    with pytest.raises(ValueError, match="top_k"):
        BackgroundCache(0)


# --- the key: corruption fixed per (row, epoch mod variants) -------------------------------------------------
@pytest.fixture(scope="module")
def task():
    cfg = LettersConfig(alphabet=ALPHABET, min_len=4, max_len=6, n_train=24, n_val=8, n_test=8)
    return LettersTask(cfg, EXPERTS, reg_data="own")


def epochs_of_rows(task, variants, n_epochs, batch_size=16, corruption=0.5):
    """{epoch: {row_index: (input_ids, variant)}} over `n_epochs` of the training loader."""
    dm = TaskDataModule(task, "experts", batch_size, corruption, seed=3, corruption_variants=variants)
    loader, seen = dm.train_dataloader(), {}
    batches_per_epoch = len(loader)
    for n, batch in enumerate(_take(loader, n_epochs * batches_per_epoch)):
        rows = seen.setdefault(n // batches_per_epoch, {})
        for b, row in enumerate(batch["row_index"].tolist()):
            length = int(batch["attention_mask"][b].sum())
            rows[row] = (tuple(batch["input_ids"][b, :length].tolist()), int(batch["corruption_variant"][b]))
    return seen


def _take(loader, n):
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def test_corruption_is_fixed_per_row_and_variant(task):
    seen = epochs_of_rows(task, variants=2, n_epochs=3)
    clean = {i: tuple(row["input_ids"]) for i, row in enumerate(task.expert_dataset("train"))}
    assert set(seen[0]) == set(seen[1]) == set(clean)
    assert {v for _, v in seen[0].values()} == {0} and {v for _, v in seen[1].values()} == {1}
    # epoch 2 is variant 0 again: the same corrupted rows as epoch 0, though in other batches
    assert seen[2] == seen[0]
    assert sum(seen[0][i][0] != seen[1][i][0] for i in clean) > len(clean) // 2
    assert sum(seen[0][i][0] != clean[i] for i in clean) > len(clean) // 2  # corruption did happen
    # another batch size puts rows in other batches: each row's corruption stays the same
    assert epochs_of_rows(task, variants=2, n_epochs=1, batch_size=5)[0] == seen[0]


def test_without_corruption_every_row_is_variant_zero(task):
    seen = epochs_of_rows(task, variants=3, n_epochs=2, corruption=0.0)
    clean = {i: tuple(row["input_ids"]) for i, row in enumerate(task.expert_dataset("train"))}
    assert all(seen[e][i] == (clean[i], 0) for e in (0, 1) for i in clean)


def test_per_row_generators_corrupt_like_a_row_alone():
    collator = Collator(0, corruption_ids=list(range(3, 9)), corruption_prob=(0.3, 0.9))
    rows = [{"input_ids": [1] + list(range(3, 3 + n)), "targets": [0] * (n + 1), "masks": [], "output_start": 1,
             "output_len": n} for n in (6, 3, 8)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in (5, 6, 7)]  # noqa: E731
    collator.generator = gens()
    together = collator(rows)["input_ids"]
    for b, row in enumerate(rows):
        collator.generator = [gens()[b]]
        alone = collator([row])["input_ids"][0]
        assert together[b, : len(alone)].tolist() == alone.tolist()


# --- ExpertLM with the cache ---------------------------------------------------------------------------------
def tiny_background(tokenizer):
    torch.manual_seed(0)
    return build_causal_lm(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tokenizer)


def test_cached_background_matches_a_fresh_forward(task):
    tokenizer = build_char_tokenizer(ALPHABET)
    vocab = len(tokenizer)
    settings = ExpertSettings(temperature=3.0, background_top_k=vocab)
    module = ExpertLM(tiny_background(tokenizer), [e.name for e in EXPERTS], settings)
    dm = TaskDataModule(task, "experts", 16, 0.5, seed=3, corruption_variants=1)
    loader = dm.train_dataloader()
    first = _take(loader, 2 * len(loader))  # epoch 1 holds the same corrupted rows as epoch 0, in other batches
    for batch in first:
        cached = module.cached_background(batch)
        keep = region_positions(batch["targets"], batch["masks"][:, 0], "off")
        fresh = module.background_logits(batch["input_ids"], batch["attention_mask"])[keep]
        for temperature in (3.0, 1.0):
            top, rest = cached.logprobs(temperature)
            exact = (fresh / temperature).log_softmax(-1).gather(-1, cached.ids.long())
            torch.testing.assert_close(top, exact, atol=1e-5, rtol=1e-5)
            assert torch.isinf(rest).all()
    assert len(module.background_cache) == len(task.expert_dataset("train"))


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_training_with_the_cache_gives_the_same_losses(task, kind):
    """Two epochs (the second reads only the cache) of LoRA training, with and without the cache, k = V."""
    tokenizer = build_char_tokenizer(ALPHABET)
    dm = TaskDataModule(task, "experts", 16, 0.3, seed=3, corruption_variants=1)
    steps = 2 * len(dm.train_dataloader())
    losses = {}
    for top_k in (None, len(tokenizer)):
        settings = ExpertSettings(divergence=kind, temperature=3.0, max_steps=steps, lr=1e-2, log_every_n_steps=2,
                                  background_top_k=top_k)
        module = LossRecorder(tiny_background(tokenizer), [e.name for e in EXPERTS], settings)
        pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(module, dm)
        losses[top_k] = torch.tensor(module.losses)
        if top_k is not None:
            assert module.background_calls == len(dm.train_dataloader())  # the first epoch only
    assert len(losses[None]) == steps
    torch.testing.assert_close(losses[len(tokenizer)], losses[None], atol=1e-5, rtol=1e-4)


class LossRecorder(ExpertLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.background_calls = 0

    def background_logits(self, *args, **kwargs):
        self.background_calls += 1
        return super().background_logits(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def test_cache_needs_keyed_batches_and_a_cacheable_divergence(task):
    tokenizer = build_char_tokenizer(ALPHABET)
    with pytest.raises(ValueError, match="divergence"):
        settings = ExpertSettings(divergence="log_ratio", background_top_k=8)
        ExpertLM(tiny_background(tokenizer), ["A_to_B"], settings)
    settings = ExpertSettings(background_top_k=8)
    module = ExpertLM(tiny_background(tokenizer), [e.name for e in EXPERTS], settings)
    batch = next(iter(TaskDataModule(task, "experts", 16, 0.0).train_dataloader()))
    with pytest.raises(ValueError, match="corruption_variants"):
        module.training_step(batch, 0)


# --- config -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "message"), [
    ("expert.background_cache.top_k=0", "expert.background_cache.top_k=0: must be an integer >= 1"),
    ("expert.background_cache.variants=-1", "expert.background_cache.variants=-1: must be an integer >= 1"),
    ("expert.background_cache.variants=1.5", "expert.background_cache.variants"),
    ("expert.background_cache.topk=8", "unknown config key 'expert.background_cache.topk'"),
    ("expert.divergence=log_ratio", "expert.background_cache needs expert.divergence"),
    ("trainer.strategy=fsdp", "expert.background_cache cannot run with trainer.strategy=fsdp"),
])
def test_bad_background_cache_config_is_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(overrides=["expert.background_cache={top_k: 8}", override])


def test_background_cache_config_defaults():
    assert load_config().expert.background_cache is None
    cfg = load_config(overrides=["expert.background_cache={top_k: 16}"])
    assert (cfg.expert.background_cache.top_k, cfg.expert.background_cache.variants) == (16, 1)
