import math

import pytest
import torch
import torch.nn.functional as F

from losses import DIVERGENCES, divergence, off_mask_divergence, task_nll

V = 7
KINDS = ("forward_kl", "reverse_kl", "jsd", "log_ratio")  # the built-in divergences, each with a reference below


def test_the_builtin_divergences_are_registered_in_order():
    assert tuple(DIVERGENCES)[: len(KINDS)] == KINDS
    assert [DIVERGENCES[k].cacheable for k in KINDS] == [True, True, True, False]


def _pair(seed: int = 0, shape=(3, 4), scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, V, generator=g) * scale, torch.randn(*shape, V, generator=g) * scale


# ---- float64 references written from the formulas ----------------------------------------------


def ref_kl(p, q):  # probabilities, float64
    return (p * (p.log() - q.log())).sum(-1)


def reference(expert, background, kind, beta=0.5, temperature=1.0):
    p_i = (expert.double() / temperature).softmax(-1)
    p_b = (background.double() / temperature).softmax(-1)
    if kind == "forward_kl":
        return ref_kl(p_b, p_i)
    if kind == "reverse_kl":
        return ref_kl(p_i, p_b)
    if kind == "jsd":
        m = beta * p_b + (1 - beta) * p_i
        return beta * ref_kl(p_b, m) + (1 - beta) * ref_kl(p_i, m)
    assert kind == "log_ratio", kind
    r = p_i.log() - p_b.log()
    return ((r - r.mean(-1, keepdim=True)) ** 2).mean(-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_each_kind_matches_float64_formula(kind, temperature):
    e, b = _pair(1)
    out = divergence(e, b, kind, beta=0.3, temperature=temperature)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(e, b, kind, 0.3, temperature), atol=1e-5, rtol=1e-4)


def test_forward_and_reverse_kl_match_torch_kl_div():
    e, b = _pair(2)
    lp_e, lp_b = e.log_softmax(-1), b.log_softmax(-1)
    fwd = F.kl_div(lp_e, lp_b, log_target=True, reduction="none").sum(-1)  # KL(p_b || p_e)
    rev = F.kl_div(lp_b, lp_e, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(divergence(e, b, "forward_kl"), fwd, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(divergence(e, b, "reverse_kl"), rev, atol=1e-6, rtol=1e-5)
    # Log-probs in, same answer as logits in.
    torch.testing.assert_close(divergence(lp_e, lp_b, "forward_kl"), fwd, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_nonnegative_and_zero_for_identical_inputs(kind):
    e, b = _pair(3, shape=(50,), scale=4.0)
    assert (divergence(e, b, kind) >= 0).all()
    assert divergence(e, b, kind).min() > 0  # random pairs do differ
    torch.testing.assert_close(divergence(b.clone(), b, kind), torch.zeros(50), atol=1e-6, rtol=0)


def test_log_ratio_is_invariant_to_per_position_constants():
    e, b = _pair(4)
    c_e, c_b = torch.randn(3, 4, 1) * 10, torch.randn(3, 4, 1) * 10
    base = divergence(e, b, "log_ratio")
    torch.testing.assert_close(divergence(e + c_e, b + c_b, "log_ratio"), base, atol=1e-4, rtol=1e-5)
    # An expert that is the background plus a per-position constant has zero penalty.
    torch.testing.assert_close(divergence(b + c_e, b, "log_ratio"), torch.zeros(3, 4), atol=1e-6, rtol=0)
    # The penalty sees a tail token that KL barely sees: move only an improbable token by 3 nats.
    bg = torch.tensor([[10.0, 0.0, 0.0, -10.0, 0.0, 0.0, 0.0]])
    ex = bg.clone()
    ex[0, 3] += 3.0
    assert divergence(ex, bg, "forward_kl").item() < 1e-7
    assert divergence(ex, bg, "log_ratio").item() == pytest.approx(9.0 * (1 / V) * (1 - 1 / V), rel=1e-4)


def test_jsd_bounds_symmetry_and_extremes():
    e, b = _pair(5, shape=(40,), scale=5.0)
    for beta in (0.1, 0.3, 0.5, 0.9):
        bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        out = divergence(e, b, "jsd", beta=beta)
        assert (out >= 0).all() and (out <= bound + 1e-6).all()
    torch.testing.assert_close(divergence(e, b, "jsd", beta=0.5), divergence(b, e, "jsd", beta=0.5))
    # beta and 1 - beta swap roles.
    torch.testing.assert_close(divergence(e, b, "jsd", beta=0.2), divergence(b, e, "jsd", beta=0.8))
    # Disjoint supports reach the bound log 2.
    far_e = torch.tensor([[60.0, 0.0, 0.0]])
    far_b = torch.tensor([[0.0, 60.0, 0.0]])
    assert divergence(far_e, far_b, "jsd").item() == pytest.approx(math.log(2), rel=1e-5)
    # beta in {0, 1}: the mixture is one side, the divergence 0.
    for beta in (0.0, 1.0):
        torch.testing.assert_close(divergence(e, b, "jsd", beta=beta), torch.zeros(40))


def test_temperature_divides_logits():
    e, b = _pair(6)
    torch.testing.assert_close(divergence(e, b, "jsd", temperature=2.5), divergence(e / 2.5, b / 2.5, "jsd"))
    # A high temperature flattens both sides towards uniform.
    assert (divergence(e, b, temperature=100.0) < divergence(e, b)).all()


def test_bad_arguments_raise_clear_errors():
    e, b = _pair(7)
    with pytest.raises(ValueError, match="unknown divergence kind .kl.; allowed kinds: forward_kl, reverse_kl, jsd, log_ratio"):
        divergence(e, b, "kl")
    with pytest.raises(ValueError, match="beta"):
        divergence(e, b, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        divergence(e, b, temperature=0.0)
    with pytest.raises(ValueError, match="background_logits"):
        divergence(e, b[..., :5])


def test_zero_probability_tokens_give_finite_values_and_grads():
    b = torch.tensor([[2.0, 0.0, -float("inf"), 1.0]])
    e = torch.tensor([[1.0, 0.5, 0.0, -1.0]], requires_grad=True)
    for kind in ("forward_kl", "jsd", "log_ratio"):
        out = divergence(e, b, kind)
        assert torch.isfinite(out).all(), kind
        (grad,) = torch.autograd.grad(out.sum(), e)
        assert torch.isfinite(grad).all(), kind
    # forward KL sums over the tokens the background allows only.
    p_b = b.softmax(-1).double()
    lp_e = e.detach().double().log_softmax(-1)
    expected = sum(p_b[0, v] * (p_b[0, v].log() - lp_e[0, v]) for v in (0, 1, 3))
    assert divergence(e, b, "forward_kl").item() == pytest.approx(expected.item(), rel=1e-5)


def test_bf16_inputs_give_float32():
    e, b = _pair(8)
    out = divergence(e.bfloat16(), b.bfloat16(), "jsd")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, divergence(e.bfloat16().float(), b.bfloat16().float(), "jsd"))


# ---- off_mask_divergence ----------------------------------------------------------------------

# Two rows, T = 6. Row 0: prompt at 0-1, targets at 2-5, mask at 3, <eos> target at 5.
# Row 1: prompt at 0, targets at 1-3 (eos at 3), padding at 4-5; the mask also covers padding 4
# and the prompt 0 (a mask never turns a non-target into a target).
TARGETS = torch.tensor([[-100, -100, 1, 2, 3, 6], [-100, 4, 5, 6, -100, -100]])
MASK = torch.tensor([[False, False, False, True, False, False], [True, False, True, False, True, False]])
OFF_MASK = [(0, 2), (0, 4), (0, 5), (1, 1), (1, 3)]  # by hand; (0, 5) and (1, 3) are the <eos> targets


def _logits(seed=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, V, generator=g) * 2, torch.randn(2, 6, V, generator=g) * 2


@pytest.mark.parametrize("kind", KINDS)
def test_off_mask_mean_over_exactly_the_hand_listed_positions(kind):
    e, b = _logits()
    per_position = reference(e, b, kind, beta=0.4, temperature=1.5)
    expected = torch.stack([per_position[i, t] for i, t in OFF_MASK]).mean()
    out = off_mask_divergence(e, b, TARGETS, MASK, kind=kind, beta=0.4, temperature=1.5)
    assert out.dim() == 0 and out.dtype == torch.float32
    assert out.item() == pytest.approx(expected.item(), rel=1e-5)


def test_off_mask_ignores_everything_but_off_mask_targets():
    e, b = _logits(10)
    # Expert equals the background exactly at the off-mask targets, differs everywhere else.
    for i, t in OFF_MASK:
        e[i, t] = b[i, t]
    assert off_mask_divergence(e, b, TARGETS, MASK).item() == 0.0
    assert off_mask_divergence(e, b, TARGETS, MASK, kind="log_ratio").item() == pytest.approx(0.0, abs=1e-7)
    # Changing the <eos> target position alone makes it nonzero.
    e[0, 5] += torch.arange(V, dtype=torch.float32)
    expected = reference(e, b, "forward_kl")[0, 5] / len(OFF_MASK)
    assert off_mask_divergence(e, b, TARGETS, MASK).item() == pytest.approx(expected.item(), rel=1e-5)


def test_off_mask_row_weight_and_empty_selection():
    e, b = _logits(11)
    per_position = reference(e, b, "forward_kl")
    row0 = torch.stack([per_position[0, t] for t in (2, 4, 5)]).mean()
    out = off_mask_divergence(e, b, TARGETS, MASK, row_weight=torch.tensor([1, 0]))
    assert out.item() == pytest.approx(row0.item(), rel=1e-5)
    with pytest.raises(ValueError, match="row_weight"):
        off_mask_divergence(e, b, TARGETS, MASK, row_weight=torch.tensor([1, 0, 1]))
    # No off-mask target at all: 0.0, and backward still works.
    e.requires_grad_(True)
    out = off_mask_divergence(e, b, TARGETS, torch.ones_like(MASK))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(e.grad, torch.zeros_like(e))


def test_gradient_reaches_only_expert_logits_at_off_mask_targets():
    e, b = _logits(12)
    e.requires_grad_(True)
    b.requires_grad_(True)
    for kind in KINDS:
        e.grad = None
        off_mask_divergence(e, b, TARGETS, MASK, kind=kind).backward()
        assert b.grad is None, kind
        touched = e.grad.abs().sum(-1) > 0
        expected = torch.zeros(2, 6, dtype=torch.bool)
        for i, t in OFF_MASK:
            expected[i, t] = True
        assert torch.equal(touched, expected), kind


def test_shape_errors_name_the_argument():
    e, b = _logits()
    with pytest.raises(ValueError, match="mask"):
        off_mask_divergence(e, b, TARGETS, MASK[:, :5])
    with pytest.raises(ValueError, match="targets"):
        off_mask_divergence(e, b, TARGETS[:, :5], MASK[:, :5])


# ---- task_nll ---------------------------------------------------------------------------------


def test_task_nll_equals_cross_entropy_with_ignore_index():
    e, _ = _logits(13)
    expected = F.cross_entropy(e.reshape(-1, V), TARGETS.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(task_nll(e, TARGETS), expected)
    on_mask_targets = TARGETS.masked_fill(~MASK, -100)  # only (0, 3) and (1, 2)
    expected_on = F.cross_entropy(e.reshape(-1, V), on_mask_targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(task_nll(e, TARGETS, MASK, on_mask_only=True), expected_on)
    lp = e.log_softmax(-1)
    assert expected_on.item() == pytest.approx(-(lp[0, 3, 2] + lp[1, 2, 5]).item() / 2, rel=1e-6)


def test_task_nll_without_positions_is_zero_with_grad_and_needs_a_mask_for_on_mask():
    e, _ = _logits(14)
    e.requires_grad_(True)
    out = task_nll(e, torch.full((2, 6), -100))
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(e.grad, torch.zeros_like(e))
    with pytest.raises(ValueError, match="mask"):
        task_nll(e, TARGETS, on_mask_only=True)


def test_plausible_log_ratio_is_the_log_ratio_variance_over_the_plausible_tokens(monkeypatch):
    from losses import divergences

    # every token plausible (V <= K, no margin): the whole-vocabulary variance
    monkeypatch.setattr(divergences, "PLAUSIBLE_MARGIN", float("inf"))
    expert, background = _pair(3)
    assert torch.allclose(divergence(expert, background, "plausible_log_ratio"),
                          divergence(expert, background, "log_ratio"), atol=1e-5)
    monkeypatch.setattr(divergences, "PLAUSIBLE_MARGIN", 10.0)
    monkeypatch.setattr(divergences, "PLAUSIBLE_K", 2)
    # the background's top two (0, 1), the expert's top two (0, 3): token 3 is a word the expert raises from deep in
    # the background's tail (-40) to second place; tokens 2, 4..6 are implausible for both and do not count
    background = torch.tensor([0.0, -1.0, -30.0, -40.0, -50.0, -60.0, -70.0])
    expert = torch.tensor([0.0, -20.0, -30.0, -2.0, -5.0, -60.0, -75.0])
    lp_i, lp_b = expert.log_softmax(-1), background.log_softmax(-1)
    r = (lp_i - lp_b)[[0, 1, 3]]
    expected = (r - r.mean()).pow(2).mean()
    assert divergence(expert, background, "plausible_log_ratio").item() == pytest.approx(expected.item(), rel=1e-5)
    # beyond the margin the expert's second token is not plausible (its top minus 10 nats)
    expert[3], expert[4] = -12.0, -13.0
    lp_i = expert.log_softmax(-1)
    r = (lp_i - lp_b)[[0, 1]]
    assert divergence(expert, background, "plausible_log_ratio").item() == pytest.approx(
        (r - r.mean()).pow(2).mean().item(), rel=1e-5)
    # the gradient reaches the expert; equal distributions give 0
    logits = expert.clone().requires_grad_()
    divergence(logits, background, "plausible_log_ratio").backward()
    assert logits.grad.abs().sum() > 0
    assert divergence(background, background, "plausible_log_ratio").item() == pytest.approx(0.0, abs=1e-6)


def test_written_log_ratio_adds_the_written_token_to_the_plausible_ones(monkeypatch):
    from losses import divergences

    monkeypatch.setattr(divergences, "PLAUSIBLE_K", 2)
    # token 4 is implausible to both sides (50 and 55 nats below their tops), like a reversed word another expert
    # writes: written there, its log-ratio counts; a written token that is already plausible (0) adds nothing
    background = torch.tensor([[0.0, -1.0, -30.0, -40.0, -50.0, -60.0, -70.0]] * 2)
    expert = torch.tensor([[0.0, -20.0, -30.0, -2.0, -55.0, -60.0, -75.0]] * 2)
    written = torch.tensor([4, 0])
    lp_i, lp_b = expert.log_softmax(-1), background.log_softmax(-1)
    r = (lp_i - lp_b)[0, [0, 1, 3, 4]]
    got = divergence(expert, background, "written_log_ratio", written=written)
    assert got[0].item() == pytest.approx((r - r.mean()).pow(2).mean().item(), rel=1e-5)
    assert got[1].item() == pytest.approx(divergence(expert, background, "plausible_log_ratio")[1].item(), rel=1e-6)
    logits = expert.clone().requires_grad_()
    divergence(logits, background, "written_log_ratio", written=written).sum().backward()
    assert logits.grad[0, 4] != 0  # the gradient reaches the written token
    with pytest.raises(ValueError, match="written_log_ratio.*written token"):
        divergence(expert, background, "written_log_ratio")


def test_tail_log_ratio_sees_an_expert_that_raises_the_whole_tail(monkeypatch):
    from losses import divergences

    monkeypatch.setattr(divergences, "TAIL_TOKENS", 4)
    # the background is sure of token 0; the expert keeps token 0 and raises every other token by 4 nats: no token
    # but 0 is plausible to either side, so plausible_log_ratio sees nothing, while in a composition of k such
    # experts every tail token gains 4k nats
    background = torch.full((2, 40), -30.0)
    background[:, 0] = 0.0
    background[1, 0], background[1, 10] = -30.0, 0.0  # a second position, sure of token 10
    expert = background + 4.0
    expert[0, 0], expert[1, 10] = 0.0, 0.0
    assert divergence(expert, background, "plausible_log_ratio").abs().max().item() < 1e-6
    got = divergence(expert, background, "tail_log_ratio")
    lp_i, lp_b = expert.log_softmax(-1), background.log_softmax(-1)
    for row, top in enumerate((0, 10)):
        # the compared set: the sure token and 4 ids spread by 10 from an offset set by the background's top token
        offset = top * 40503 % 10
        tokens = sorted({top} | {offset + 10 * j for j in range(4)})
        r = (lp_i - lp_b)[row, tokens]
        assert got[row].item() == pytest.approx((r - r.mean()).pow(2).mean().item(), rel=1e-5)
        assert got[row].item() > 1.0
    logits = expert.clone().requires_grad_()
    divergence(logits, background, "tail_log_ratio").sum().backward()
    assert logits.grad.abs().sum() > 0
    assert divergence(background, background, "tail_log_ratio").abs().max().item() < 1e-6


def test_amplified_kl_sees_alike_experts_flip_a_sure_position():
    from losses.divergences import AMPLIFIED_COPIES, amplified_kl

    # the background is sure of token 0 (12 nats over token 1); the expert keeps token 0 and raises token 1 by 3
    # nats: KL hardly moves, but AMPLIFIED_COPIES = 5 such experts give token 1 15 nats and the composition flips
    background = torch.full((1, 50), -40.0)
    background[0, 0], background[0, 1] = 0.0, -12.0
    expert = background.clone()
    expert[0, 1] += 3.0
    assert AMPLIFIED_COPIES == 5
    lp_i, lp_b = expert.log_softmax(-1), background.log_softmax(-1)
    kl = divergence(expert, background, "forward_kl").item()
    got = divergence(expert, background, "amplified_kl").item()
    composed = (lp_b + 5 * (lp_i - lp_b)).log_softmax(-1)  # the rule with five copies of the expert
    assert composed[0].argmax().item() == 1
    assert got == pytest.approx((lp_b.exp() * (lp_b - composed)).sum().item() / 5, rel=1e-5)
    assert kl < 1e-3 < 0.3 < got
    # one copy is the forward KL; no drift, or a drift by a constant per position, costs nothing
    assert amplified_kl(lp_i, lp_b, copies=1).item() == pytest.approx(kl, rel=1e-5)
    assert divergence(background + 7.0, background, "amplified_kl").abs().item() < 1e-6
    both = divergence(expert, background, "tail_amplified_kl").item()
    assert both == pytest.approx(got + divergence(expert, background, "tail_log_ratio").item(), rel=1e-5)
    logits = expert.clone().requires_grad_()
    divergence(logits, background, "tail_amplified_kl").sum().backward()
    assert logits.grad[0, 1] > 0  # descending lowers the raised token


def test_flip_kl_is_the_forward_kl_for_small_drifts_and_sees_a_flip():
    torch.manual_seed(0)
    background = torch.randn(4, 30)
    small = background + 0.01 * torch.randn(4, 30)
    kl = divergence(small, background, "forward_kl")
    assert torch.allclose(divergence(small, background, "flip_kl"), kl, rtol=0.1)
    assert not torch.allclose(divergence(small, background, "amplified_kl"), kl, rtol=0.1)  # about 5× the KL
    # the sure position of the amplified test: the forward KL misses the flip, flip_kl sees it
    sure = torch.full((1, 50), -40.0)
    sure[0, 0], sure[0, 1] = 0.0, -12.0
    raised = sure.clone()
    raised[0, 1] += 3.0
    flip = divergence(raised, sure, "flip_kl").item()
    assert flip == pytest.approx(divergence(raised, sure, "amplified_kl").item() / 5, rel=1e-5)
    assert divergence(raised, sure, "forward_kl").item() < 1e-3 < 0.05 < flip
    both = divergence(raised, sure, "tail_flip_kl").item()
    assert both == pytest.approx(flip + divergence(raised, sure, "tail_log_ratio").item(), rel=1e-5)


def test_sure_amplified_kl_counts_only_where_the_background_is_sure():
    sure = torch.full((50,), -40.0)
    sure[0], sure[1] = 0.0, -12.0
    unsure = torch.zeros(50)
    background = torch.stack([sure, unsure])
    expert = background.clone()
    expert[:, 1] += 3.0
    amplified = divergence(expert, background, "amplified_kl")
    got = divergence(expert, background, "sure_amplified_kl")
    assert got[0].item() == pytest.approx(amplified[0].item(), rel=1e-5) and got[0].item() > 0.3
    assert got[1].item() == 0.0 < amplified[1].item()
    both = divergence(expert, background, "tail_sure_amplified_kl")
    assert torch.allclose(both, got + divergence(expert, background, "tail_log_ratio"), rtol=1e-5)


def test_off_mask_divergence_passes_each_positions_written_token():
    expert, background = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 0] = -100
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 2] = True
    keep = (targets != -100) & ~mask
    expected = divergence(expert[keep], background[keep], "written_log_ratio", written=targets[keep]).mean()
    got = off_mask_divergence(expert, background, targets, mask, kind="written_log_ratio")
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
