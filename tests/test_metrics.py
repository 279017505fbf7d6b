import pytest
import torch

from compose import compose_logprobs
from compose.metrics import (
    FAILURE_TYPES,
    ActiveSetOverlap,
    ActiveSetPrecisionRecall,
    ExactMatch,
    FailureTypes,
    MaskedDivergence,
    ProjectivityError,
    SequenceNLL,
    SkillAccuracy,
    TargetMargin,
    classify_failure,
    margin_decomposition,
)
from losses import divergence

V = 6
# Row 0: prompt 0, targets 1-4 (eos target at 4), mask at 2. Row 1: targets 0-2, padding 3-4, mask at 0 and 1.
TARGETS = torch.tensor([[-100, 1, 2, 3, 5], [0, 4, 2, -100, -100]])
MASK = torch.tensor([[False, False, True, False, False], [True, True, False, False, False]])
OFF = [(0, 1), (0, 3), (0, 4), (1, 2)]
ON = [(0, 2), (1, 0), (1, 1)]


def _logits(seed=0, shape=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, V, generator=g) * 2, torch.randn(*shape, V, generator=g) * 2


def _f(x) -> float:
    return float(x)


# ---- MaskedDivergence -------------------------------------------------------------------------


@pytest.mark.parametrize(("region", "positions"), [("off", OFF), ("on", ON)])
def test_masked_divergence_is_mean_over_hand_listed_positions(region, positions):
    e, b = _logits(1)
    d = divergence(e, b, "jsd")
    metric = MaskedDivergence(region=region, kind="jsd")
    metric.update(e, b, TARGETS, MASK)
    expected = sum(_f(d[i, t]) for i, t in positions) / len(positions)
    assert _f(metric.compute()) == pytest.approx(expected, rel=1e-6)


def test_masked_divergence_accumulates_like_concatenation_and_resets():
    e1, b1 = _logits(2)
    e2, b2 = _logits(3)
    t2 = TARGETS.flip(0)
    m2 = MASK.flip(0)
    two = MaskedDivergence("off")
    two.update(e1, b1, TARGETS, MASK)
    two.update(e2, b2, t2, m2)
    one = MaskedDivergence("off")
    one.update(torch.cat([e1, e2]), torch.cat([b1, b2]), torch.cat([TARGETS, t2]), torch.cat([MASK, m2]))
    assert _f(two.compute()) == pytest.approx(_f(one.compute()), rel=1e-6)
    # Merging states the way DDP's sum-reduction does gives the same.
    a, c = MaskedDivergence("off"), MaskedDivergence("off")
    a.update(e1, b1, TARGETS, MASK)
    c.update(e2, b2, t2, m2)
    a.merge_state(c)
    assert _f(a.compute()) == pytest.approx(_f(one.compute()), rel=1e-6)
    two.reset()
    assert _f(two.compute()) == 0.0
    two.update(e1, b1, TARGETS, MASK)
    first = MaskedDivergence("off")
    first.update(e1, b1, TARGETS, MASK)
    assert _f(two.compute()) == pytest.approx(_f(first.compute()))


def test_metric_arguments_are_checked_early():
    with pytest.raises(ValueError, match="region"):
        MaskedDivergence(region="both")
    with pytest.raises(ValueError, match="allowed kinds"):
        ActiveSetPrecisionRecall(kind="kl")
    with pytest.raises(ValueError, match="num_experts"):
        ActiveSetOverlap(num_experts=0)


# ---- Active sets ------------------------------------------------------------------------------


def _expert_differing_at(background, positions, amount=3.0):
    expert = background.clone()
    for i, t in positions:
        expert[i, t] += torch.arange(V, dtype=torch.float32) * amount
    return expert


def test_precision_recall_of_an_expert_exactly_on_its_mask():
    _, b = _logits(4)
    exact = ActiveSetPrecisionRecall(threshold=0.01)
    exact.update(_expert_differing_at(b, ON), b, TARGETS, MASK)
    assert {k: _f(v) for k, v in exact.compute().items()} == {"precision": 1.0, "recall": 1.0}

    # Also differing at one off-mask target (the eos) and at a prompt position (not a target):
    # 3 of 4 active targets lie in the mask.
    leaky = ActiveSetPrecisionRecall(threshold=0.01)
    leaky.update(_expert_differing_at(b, [*ON, (0, 4), (0, 0)]), b, TARGETS, MASK)
    out = leaky.compute()
    assert _f(out["precision"]) == pytest.approx(3 / 4) and _f(out["recall"]) == 1.0

    # Missing one mask position: recall 2/3.
    lazy = ActiveSetPrecisionRecall(threshold=0.01)
    lazy.update(_expert_differing_at(b, ON[:2]), b, TARGETS, MASK)
    out = lazy.compute()
    assert _f(out["precision"]) == 1.0 and _f(out["recall"]) == pytest.approx(2 / 3)

    # Accumulating the three updates in one metric pools the counts: 8 of 9 active in the mask, 8 of 9 mask hits.
    pooled = ActiveSetPrecisionRecall(threshold=0.01)
    for positions in (ON, [*ON, (0, 4), (0, 0)], ON[:2]):
        pooled.update(_expert_differing_at(b, positions), b, TARGETS, MASK)
    out = pooled.compute()
    assert _f(out["precision"]) == pytest.approx(8 / 9) and _f(out["recall"]) == pytest.approx(8 / 9)
    pooled.reset()
    # Empty denominators are defined as 1.0.
    pooled.update(b.clone(), b, TARGETS, torch.zeros_like(MASK))
    assert {k: _f(v) for k, v in pooled.compute().items()} == {"precision": 1.0, "recall": 1.0}


def test_active_set_overlap_iou_by_hand():
    _, b = _logits(5)
    # Target positions: (0,1..4) and (1,0..2). Expert 0 active at {A, B}, expert 1 at {B, C, D}, expert 2 nowhere,
    # expert 3 only at a padding position (not a target, so empty too).
    A, B, C, D = (0, 1), (0, 2), (1, 0), (1, 2)
    experts = torch.stack(
        [
            _expert_differing_at(b, [A, B]),
            _expert_differing_at(b, [B, C, D]),
            b.clone(),
            _expert_differing_at(b, [(1, 4)]),
        ]
    )
    metric = ActiveSetOverlap(num_experts=4)
    metric.update(experts[:, :1], b[:1], TARGETS[:1])  # row 0 first, then row 1: accumulation
    metric.update(experts[:, 1:], b[1:], TARGETS[1:])
    iou = metric.compute()
    expected = torch.eye(4)
    expected[0, 1] = expected[1, 0] = 1 / 4  # |{B}| / |{A, B, C, D}|
    torch.testing.assert_close(iou, expected)
    one = ActiveSetOverlap(num_experts=4)
    one.update(experts, b, TARGETS)
    torch.testing.assert_close(one.compute(), iou)
    with pytest.raises(ValueError, match="k=4"):
        one.update(experts[:3], b, TARGETS)
    one.reset()
    torch.testing.assert_close(one.compute(), torch.eye(4))


# ---- Accuracy metrics -------------------------------------------------------------------------


def test_exact_match_with_eos_flags_accumulation_and_reset():
    metric = ExactMatch()
    metric.update(["ABBA", "CD"], ["ABBA", "CC"])
    metric.update(["XY", "XY", "Q"], ["XY", "XY", "Q"], ended_with_eos=[True, False, True])
    assert _f(metric.compute()) == pytest.approx(3 / 5)
    one = ExactMatch()
    one.update(
        ["ABBA", "CD", "XY", "XY", "Q"], ["ABBA", "CC", "XY", "XY", "Q"], [True, True, True, False, True]
    )
    assert _f(one.compute()) == _f(metric.compute())
    metric.reset()
    assert _f(metric.compute()) == 0.0
    with pytest.raises(ValueError, match="refs"):
        metric.update(["A"], [])
    with pytest.raises(ValueError, match="ended_with_eos"):
        metric.update(["A"], ["A"], ended_with_eos=[])


def test_skill_accuracy_counts_only_mask_target_positions():
    preds = torch.tensor([[9, 1, 2, 0, 0], [0, 3, 9, 9, 9]])  # mask hits: (0,2) yes, (1,0) yes, (1,1) no
    metric = SkillAccuracy()
    metric.update(preds, TARGETS, MASK)
    assert _f(metric.compute()) == pytest.approx(2 / 3)
    metric.update(TARGETS.clamp_min(0), TARGETS, MASK)  # all 3 right
    assert _f(metric.compute()) == pytest.approx(5 / 6)
    metric.reset()
    assert _f(metric.compute()) == 0.0


def test_sequence_nll_sums_over_positions_and_averages_over_sequences():
    logits, _ = _logits(6)
    lp = logits.log_softmax(-1)
    row0 = -sum(_f(lp[0, t, TARGETS[0, t]]) for t in (1, 2, 3, 4))
    row1 = -sum(_f(lp[1, t, TARGETS[1, t]]) for t in (0, 1, 2))
    metric = SequenceNLL()
    metric.update(lp, TARGETS)
    assert _f(metric.compute()) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    # Raw logits are renormalized; a row without targets is not a sequence.
    metric.update(logits * 1.0 + 5.0, torch.cat([TARGETS[:1], torch.full((1, 5), -100)]))
    assert _f(metric.compute()) == pytest.approx((2 * row0 + row1) / 3, rel=1e-6)
    metric.reset()
    assert _f(metric.compute()) == 0.0


# ---- TargetMargin ------------------------------------------------------------------------------


def test_target_margin_by_hand_per_region_accumulates_and_resets():
    logits, _ = _logits(7)
    lp = logits.log_softmax(-1)

    def margin(b, t):
        target = int(TARGETS[b, t])
        rival = max(_f(lp[b, t, v]) for v in range(V) if v != target)
        return _f(lp[b, t, target]) - rival

    for positions, region in ((MASK, ON), (~MASK, OFF), (None, ON + OFF)):
        metric = TargetMargin(thresholds=(0.0, 1.5))
        metric.update(lp, TARGETS, positions)
        out = metric.compute()
        by_hand = [margin(b, t) for b, t in region]
        assert _f(out["min"]) == pytest.approx(min(by_hand), abs=1e-5)
        assert _f(out["below_0"]) == pytest.approx(sum(m < 0 for m in by_hand) / len(by_hand))
        assert _f(out["below_1.5"]) == pytest.approx(sum(m < 1.5 for m in by_hand) / len(by_hand))
    # a position whose target is the argmax by 3 nats
    sure = torch.full((1, 2, V), -10.0)
    sure[0, 0, 1], sure[0, 0, 2] = 0.0, -3.0
    metric = TargetMargin(thresholds=(0.0, 1.5))
    metric.update(sure, torch.tensor([[1, -100]]))
    assert _f(metric.compute()["min"]) == pytest.approx(3.0) and _f(metric.compute()["below_1.5"]) == 0.0
    metric.update(lp, TARGETS)  # accumulates: the minimum and the fractions over both updates
    assert _f(metric.compute()["min"]) == pytest.approx(min(margin(b, t) for b, t in ON + OFF), abs=1e-5)
    metric.reset()
    assert _f(metric.compute()["min"]) == 0.0 and _f(metric.compute()["below_0"]) == 0.0


def test_margin_decomposition_adds_up_to_the_composed_log_odds_and_matches_by_hand():
    g = torch.Generator().manual_seed(8)
    bg, experts = torch.randn(2, 5, V, generator=g).log_softmax(-1), torch.randn(3, 2, 5, V, generator=g).log_softmax(-1)
    rivals = (TARGETS.clamp_min(0) + 1) % V
    masks = torch.zeros(2, 3, 5, dtype=torch.bool)
    masks[0, 1, 2] = masks[1, 0, 0] = True
    masks[1, 0, 1] = masks[1, 2, 1] = True  # two holders: left out
    masks[1, 2, 3] = True  # padding (no target): left out
    out = margin_decomposition(bg, experts, TARGETS, rivals, masks)
    composed = compose_logprobs(bg, experts)
    d = lambda lp, b, t: _f(lp[b, t, TARGETS[b, t]] - lp[b, t, rivals[b, t]])  # noqa: E731
    for n, (b, t, i) in enumerate([(0, 2, 1), (1, 0, 0)]):  # row-major order
        assert _f(out["owner"][n]) == pytest.approx(d(experts[i], b, t), abs=1e-5)
        others = sum(d(experts[j], b, t) - d(bg, b, t) for j in range(3) if j != i)
        assert _f(out["others"][n]) == pytest.approx(others, abs=1e-5)
        assert _f(out["background"][n]) == pytest.approx(d(bg, b, t), abs=1e-5)
        assert _f(out["owner"][n] + out["others"][n]) == pytest.approx(d(composed, b, t), abs=1e-4)
    assert out["owner"].shape == (2,)


# ---- Projectivity -----------------------------------------------------------------------------


def test_projectivity_zero_for_factorized_experts_and_by_hand_otherwise():
    _, b = _logits(7)
    # Two experts that differ from the background only on their own (disjoint) masks.
    m0 = [(0, 2), (1, 0)]
    m1 = [(1, 1)]
    experts = torch.stack([_expert_differing_at(b, m0), _expert_differing_at(b, m1)])
    masks = torch.zeros(2, 2, 5, dtype=torch.bool)  # [B, k, T]
    for i, t in m0:
        masks[i, 0, t] = True
    for i, t in m1:
        masks[i, 1, t] = True
    lp_b, lp_e = b.log_softmax(-1), experts.log_softmax(-1)
    composed = compose_logprobs(lp_b, lp_e)
    metric = ProjectivityError()
    metric.update(composed, lp_b, lp_e, TARGETS, masks)
    assert _f(metric.compute()) == pytest.approx(0.0, abs=1e-5)

    # A composed model that is just the background: the error is the experts' KL on their masks.
    metric.reset()
    metric.update(lp_b, lp_b, lp_e, TARGETS, masks)
    kl = [
        _f(divergence(lp_b[i, t], lp_e[k, i, t])) for k, positions in ((0, m0), (1, m1)) for i, t in positions
    ]
    kl_ref = [
        _f((lp_e[k, i, t].exp() * (lp_e[k, i, t] - lp_b[i, t])).sum())
        for k, p in ((0, m0), (1, m1))
        for i, t in p
    ]
    assert kl == pytest.approx(kl_ref, rel=1e-5)  # KL(p_i || p̂) written out
    n_targets = 7
    assert _f(metric.compute()) == pytest.approx(sum(kl_ref) / n_targets, rel=1e-5)

    # Overlapping masks: a position held by both experts scores the mean of the two KLs.
    both = masks.clone()
    both[1, 0, 1] = True  # (1, 1) now in both masks
    metric.reset()
    metric.update(lp_b, lp_b, lp_e, TARGETS, both)
    kl_e0_11 = _f(divergence(lp_b[1, 1], lp_e[0, 1, 1]))
    expected = (kl_ref[0] + kl_ref[1] + (kl_ref[2] + kl_e0_11) / 2) / n_targets
    assert _f(metric.compute()) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match=r"\[B, k, T\]"):
        metric.update(lp_b, lp_b, lp_e, TARGETS, masks[:, :1])


def test_projectivity_accumulates_like_concatenation():
    composed, b = _logits(8)
    experts = torch.randn(3, 2, 5, V, generator=torch.Generator().manual_seed(9))
    masks = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(10)) > 0.6
    one = ProjectivityError()
    one.update(composed, b, experts, TARGETS, masks)
    two = ProjectivityError()
    two.update(composed[:1], b[:1], experts[:, :1], TARGETS[:1], masks[:1])
    two.update(composed[1:], b[1:], experts[:, 1:], TARGETS[1:], masks[1:])
    assert _f(two.compute()) == pytest.approx(_f(one.compute()), rel=1e-6)
    assert _f(one.compute()) > 0


# ---- Failure types ----------------------------------------------------------------------------


def test_classify_failure_rules():
    # x = "AXCA" with rules A->B and C->D: ref "BXDB", mask {0, 2, 3}.
    mask = {0, 2, 3}
    assert classify_failure("BXDB", "BXDB", True, mask) == "correct"
    assert classify_failure("BXDB", "BXDB", False, mask) == "length_or_eos"
    assert classify_failure("BXD", "BXDB", True, mask) == "length_or_eos"
    assert classify_failure("AXDB", "BXDB", True, mask) == "rule_not_applied"  # kept the source letter
    assert (
        classify_failure("BXDE", "BXDB", True, mask) == "rule_not_applied"
    )  # another letter at a mask position
    assert classify_failure("BYDB", "BXDB", True, mask) == "wrong_letter_elsewhere"
    assert classify_failure("AYDB", "BXDB", True, mask) == "rule_not_applied"  # both kinds: the rule counts


def test_failure_types_fractions_accumulate_and_derive_masks_from_sources():
    xs = ["AXCA", "AXCA", "AXCA", "AXCA"]
    refs = ["BXDB"] * 4
    preds = ["BXDB", "AXDB", "BYDB", "BXDB"]
    ended = [True, True, True, False]
    metric = FailureTypes()
    metric.update(preds[:2], refs[:2], xs[:2], ended[:2], mask_positions=[{0, 2, 3}] * 2)
    metric.update(preds[2:], refs[2:], xs[2:], ended[2:])  # masks derived: positions where x != ref
    out = {k: _f(v) for k, v in metric.compute().items()}
    assert out == {k: 0.25 for k in FAILURE_TYPES}
    assert sum(out.values()) == pytest.approx(1.0)
    metric.reset()
    metric.update(["BXDB"], ["BXDB"], ["AXCA"])
    assert {k: _f(v) for k, v in metric.compute().items()} == {
        "correct": 1.0,
        "rule_not_applied": 0.0,
        "wrong_letter_elsewhere": 0.0,
        "length_or_eos": 0.0,
    }
    with pytest.raises(ValueError, match="mask_positions or xs"):
        metric.update(["A"], ["A"])
    with pytest.raises(ValueError, match="ended"):
        metric.update(["A"], ["A"], ["A"], ended=[True, True])
