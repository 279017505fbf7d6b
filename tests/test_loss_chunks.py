"""`expert.loss_chunk_size`: the training losses block by block of positions (losses/chunked.py) equal the plain
ones, in value, gradients and logged metrics; what they do not support is refused."""

import dataclasses
from pathlib import Path

import pytest
import torch

from lightning_modules.expert import ExpertLM, ExpertSettings
from lightning_modules.pipeline.config import ConfigError, load_config
from losses import IGNORE_INDEX
from losses.chunked import RowSum, chunked_row_sums, row_sums
from tests.tiny_models import VOCAB, tiny_model

DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
B, T = 5, 11


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of two experts, right-padded, with prompts (no target), own masks, task and regularizer rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=gen)
    lengths = torch.tensor([T, T - 3, T - 1, 6, T])
    attn = (torch.arange(T) < lengths.unsqueeze(1)).long()
    output_start = torch.tensor([4, 3, 5, 2, 6])
    targets = torch.randint(3, VOCAB, (B, T), generator=gen)
    targets[(torch.arange(T) < output_start.unsqueeze(1) - 1) | (attn == 0)] = IGNORE_INDEX
    targets[3] = IGNORE_INDEX  # a row with no target at all
    masks = (torch.rand(B, 1, T, generator=gen) < 0.4) & (targets != IGNORE_INDEX).unsqueeze(1)
    return {"input_ids": ids.where(attn.bool(), 0), "attention_mask": attn, "targets": targets, "masks": masks,
            "expert_index": torch.tensor([0, 1, 1, 0, 1]), "is_task": torch.tensor([1, 0, 1, 0, 0]),
            "task_on_mask": torch.tensor([0, 1, 0, 1, 1]), "output_start": output_start}


def module(mode: str = "lora", **kwargs) -> ExpertLM:
    m = ExpertLM(tiny_model(), ["a", "b"], ExpertSettings(mode=mode, lora_r=4, log_every_n_steps=1, **kwargs))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking experts: each differs from the background, and from the other
        for name, p in m.named_parameters():
            if p.requires_grad and ("lora_B" in name or mode != "lora"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return m


def step(m: ExpertLM, chunk: int | None, data: dict) -> tuple[torch.Tensor, dict, dict]:
    """Loss, gradients and logged values of one training step with `loss_chunk_size=chunk`."""
    m.settings = dataclasses.replace(m.settings, loss_chunk_size=chunk)
    logged = {}
    m.log = lambda key, value, **_: logged.__setitem__(key, value.detach().clone())
    m.zero_grad()
    torch.manual_seed(7)  # the same random position jump, if any
    loss = m.training_step(data, 0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return loss.detach(), grads, logged


def assert_same_step(m: ExpertLM, chunks=(1, 3, 4, T, 64), data=None) -> None:
    data = data or batch()
    loss, grads, logged = step(m, None, data)
    assert grads and ("train/reg" not in logged or logged["train/reg"] > 0)
    for chunk in chunks:
        c_loss, c_grads, c_logged = step(m, chunk, data)
        torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
        assert c_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(c_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=f"{name}, chunk {chunk}")
        assert c_logged.keys() == logged.keys()
        for key in logged:
            torch.testing.assert_close(c_logged[key], logged[key], rtol=1e-5, atol=1e-6, msg=f"{key}, chunk {chunk}")


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", "log_ratio", "plausible_log_ratio",
                                        "written_log_ratio", "tail_log_ratio", "tail_amplified_kl",
                                        "tail_flip_kl", "tail_sure_amplified_kl"])
def test_chunked_lora_losses_and_gradients_equal_the_plain_ones(divergence):
    assert_same_step(module(divergence=divergence, temperature=2.0, jsd_beta=0.3))


@pytest.mark.parametrize("mode", ["full", "head"])
def test_chunked_full_and_head_losses_and_gradients_equal_the_plain_ones(mode):
    assert_same_step(module(mode), chunks=(1, 4, 64))


def test_chunked_losses_apply_a_lora_wrapped_output_layer_per_row():
    """lm_head among the LoRA targets: each block's head call (and its recomputation) uses each row's adapter,
    and the background's head none."""
    m = module(target_modules=["q_proj", "v_proj", "lm_head"])
    assert any("lm_head.lora_B.b" in n for n, p in m.named_parameters() if p.requires_grad)
    assert_same_step(m, chunks=(1, 4))


def test_chunked_losses_with_the_task_loss_on_the_mask_only_no_regularizer_and_a_position_jump():
    assert_same_step(module(task_loss_on_mask_only=True), chunks=(2,))
    assert_same_step(module(reg_weight=0.0), chunks=(2,))
    assert_same_step(module(position_jump=5), chunks=(3,))


def test_after_close_weight_scales_those_positions_in_the_plain_and_chunked_regularizer():
    data = batch()
    data["after_close"] = (torch.rand(B, T, generator=torch.Generator().manual_seed(3)) < 0.3).long()
    m = module(reg_after_close=4.0)
    assert_same_step(m, chunks=(1, 4), data=data)
    # the weighted regularizer is the plain one plus 3 × the marked positions' share of it
    reg = lambda mm, d: step(mm, None, d)[2]["train/reg"]  # noqa: E731
    plain, weighted = reg(module(), data), reg(m, data)
    only_marked = dict(data, masks=data["masks"] | ~data["after_close"].bool().unsqueeze(1))
    torch.testing.assert_close(weighted, plain + 3.0 * reg(module(), only_marked) * _off(only_marked) / _off(data))
    with pytest.raises(ValueError, match="after_close"):
        step(m, None, batch())


def _off(data: dict) -> float:
    """The number of off-mask target positions (what the regularizer divides by)."""
    return float(((data["targets"] != IGNORE_INDEX) & ~data["masks"][:, 0]).sum())


def test_chunked_losses_stay_attached_when_no_position_counts():
    data = batch()
    data["targets"][:] = IGNORE_INDEX
    m = module()
    loss, grads, _ = step(m, 4, data)
    assert loss == 0 and grads and all((g == 0).all() for g in grads.values())


def test_chunked_heads_see_only_the_counted_positions():
    """Prompt and padding positions never reach an output head: the heads run on the positions some term counts,
    and the sums equal those of the full logits."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, 8, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, 8, generator=gen)
    seen = []

    def head(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[:-1].numel())
        return h @ weight.T

    counted = torch.rand(B, T, generator=gen) < 0.3
    targets = torch.randint(VOCAB, (B, T), generator=gen)
    terms = [RowSum(counted, targets), RowSum(counted & (targets % 2 == 0), divergence="forward_kl")]
    sums = chunked_row_sums(head, hidden, head, hidden.detach() + 0.5, terms, chunk=2)
    sums.sum().backward()
    # forward: the expert's head and the background's; backward recomputes both (the block's checkpoint)
    assert sum(seen) == 4 * int(counted.sum()) < 4 * B * T
    full = row_sums(hidden @ weight.T, (hidden.detach() + 0.5) @ weight.T, terms)
    torch.testing.assert_close(sums, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_chunk_size": 0}, "loss_chunk_size must be a positive number of positions or None, got 0"),
    ({"loss_chunk_size": True}, "loss_chunk_size must be a positive number"),
    ({"loss_chunk_size": 2.0}, "loss_chunk_size must be a positive number"),
    ({"loss_chunk_size": 8, "background_top_k": 4}, "loss_chunk_size cannot be used with background_top_k"),
    ({"loss_chunk_size": 8, "regularizer": "features"}, "loss_chunk_size cannot be used with regularizer='features'"),
])
def test_expert_lm_refuses_what_the_chunked_losses_do_not_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertLM(tiny_model(), ["a"], ExpertSettings(**kwargs))


@pytest.mark.parametrize(("overrides", "message"), [
    (["expert.loss_chunk_size=0"], r"expert.loss_chunk_size=0: must be null \(all positions at once\) or an integer"),
    (["expert.loss_chunk_size=-4"], "expert.loss_chunk_size=-4: must be null"),
    (["expert.loss_chunk_size=many"], "bad value for 'expert.loss_chunk_size'"),
    (["expert.loss_chunk_size=8", "expert.background_cache={top_k: 8}"],
     "expert.loss_chunk_size cannot be used with expert.background_cache"),
    (["expert.loss_chunk_size=8", "expert.regularizer=features"],
     "expert.loss_chunk_size cannot be used with expert.regularizer=features"),
    (["expert.loss_chunk_size=8", "trainer.strategy=fsdp"],
     "expert.loss_chunk_size cannot run with trainer.strategy=fsdp"),
])
def test_config_refuses_a_bad_loss_chunk_size(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, base=DEFAULT)


def test_config_takes_a_loss_chunk_size_and_defaults_to_none():
    assert load_config(base=DEFAULT).expert.loss_chunk_size is None
    assert load_config(overrides=["expert.loss_chunk_size=64"], base=DEFAULT).expert.loss_chunk_size == 64
