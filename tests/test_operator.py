import pytest
import torch

from compose import compose_logprobs


def reference_float64(bg, experts, weights, masks, floor=-1e4):
    lp_b = bg.double().log_softmax(-1).clamp_min(floor)
    total = lp_b.clone()
    for i, e in enumerate(experts):
        ratio = e.double().log_softmax(-1).clamp_min(floor) - lp_b
        gate = masks[i].double().unsqueeze(-1) if masks is not None else 1.0
        total = total + weights[i] * gate * ratio
    return total.log_softmax(-1)


def test_matches_float64_reference_with_weights_and_masks():
    g = torch.Generator().manual_seed(0)
    bg = torch.randn(3, 5, 11, generator=g) * 3
    experts = torch.randn(4, 3, 5, 11, generator=g) * 3
    weights = [1.0, 0.5, -0.7, 2.0]
    masks = torch.rand(4, 3, 5, generator=g) > 0.5
    out = compose_logprobs(bg, experts, weights=weights, masks=masks)
    assert out.dtype == torch.float32 and out.shape == bg.shape
    ref = reference_float64(bg, experts, weights, masks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # A list of experts gives the same as the stacked tensor.
    torch.testing.assert_close(compose_logprobs(bg, list(experts), weights=weights, masks=masks), out)
    # Outputs are normalized.
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(3, 5))


def test_identical_experts_give_background_and_one_expert_gives_expert():
    bg = torch.randn(2, 7, 13)
    expected_bg = bg.log_softmax(-1)
    torch.testing.assert_close(compose_logprobs(bg, [bg.clone(), bg.clone(), bg.clone()]), expected_bg)
    e = torch.randn(2, 7, 13)
    torch.testing.assert_close(compose_logprobs(bg, [e]), e.log_softmax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compose_logprobs(bg, []), expected_bg)


def test_per_position_constants_change_nothing():
    g = torch.Generator().manual_seed(1)
    bg, e1, e2 = (torch.randn(4, 9, 17, generator=g) for _ in range(3))
    base = compose_logprobs(bg, [e1, e2], weights=[1.0, 0.3])
    shift = lambda t: t + torch.randn(*t.shape[:-1], 1, generator=g) * 10  # noqa: E731
    moved = compose_logprobs(shift(bg), [shift(e1), shift(e2)], weights=[1.0, 0.3])
    torch.testing.assert_close(moved, base, atol=1e-4, rtol=1e-4)


def test_background_minus_inf_gives_finite_output():
    bg = torch.randn(2, 3, 8)
    bg[..., 0] = float("-inf")
    bg[0, 0, :] = torch.tensor([float("-inf")] * 7 + [0.0])
    e = torch.randn(2, 3, 8)
    e[..., 1] = float("-inf")
    out = compose_logprobs(bg, [e, torch.randn(2, 3, 8)], weights=[1.0, -0.5])
    assert not torch.isnan(out).any()
    assert torch.isfinite(out.exp().sum(-1)).all()
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 3))


def test_all_false_mask_gives_background():
    bg, e = torch.randn(2, 5, 9), torch.randn(3, 2, 5, 9)
    out = compose_logprobs(bg, e, masks=torch.zeros(3, 2, 5, dtype=torch.bool))
    torch.testing.assert_close(out, bg.log_softmax(-1))


def test_projectivity_on_disjoint_masks():
    g = torch.Generator().manual_seed(2)
    T, V = 12, 10
    bg = torch.randn(T, V, generator=g)
    masks = torch.zeros(3, T, dtype=torch.bool)
    masks[0, [0, 3, 4]] = True
    masks[1, [1, 7]] = True
    masks[2, [9, 10, 11]] = True
    experts = bg.expand(3, T, V).clone()
    for i in range(3):  # each expert differs from the background only on its own mask
        experts[i, masks[i]] = torch.randn(int(masks[i].sum()), V, generator=g) * 4
    out = compose_logprobs(bg, experts)
    for i in range(3):
        torch.testing.assert_close(out[masks[i]], experts[i, masks[i]].log_softmax(-1), atol=1e-5, rtol=1e-5)
    neutral = ~masks.any(0)
    torch.testing.assert_close(out[neutral], bg[neutral].log_softmax(-1), atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise_value_error_naming_sizes():
    bg = torch.randn(2, 5, 9)
    with pytest.raises(ValueError, match="vocabulary size 8.*9"):
        compose_logprobs(bg, [torch.randn(2, 5, 8)])
    with pytest.raises(ValueError, match="vocabulary size 8.*9"):
        compose_logprobs(bg, torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="weights has 3 entries but there are 2 experts"):
        compose_logprobs(bg, torch.randn(2, 2, 5, 9), weights=[1, 1, 1])
    with pytest.raises(ValueError, match=r"masks has shape \(2, 5\), expected \(2, 2, 5\)"):
        compose_logprobs(bg, torch.randn(2, 2, 5, 9), masks=torch.ones(2, 5, dtype=torch.bool))
