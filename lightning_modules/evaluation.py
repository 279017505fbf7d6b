"""Task-level evaluation of a (composed) model on the letter task: greedy decoding and teacher forcing.

Shared by the validation-time `CompositionEvaluation` callback and the final test stage, so the numbers
logged during training and those in `summary.json` are computed by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from compose import ComposedLM, compose_logprobs
from compose.metrics import (
    ActiveSetOverlap,
    ExactMatch,
    FailureTypes,
    MaskedDivergence,
    ProjectivityError,
    SequenceNLL,
)
from data.letters import RuleSet, apply_rules, decode_outputs, prompt_batch


@torch.no_grad()
def greedy_outputs(model: ComposedLM, tokenizer, xs: Sequence[str], batch_size: int = 250,
                   max_new_tokens: int | None = None) -> tuple[list[str], list[bool]]:
    """Greedy outputs (letters up to <eos>) and whether each ended with <eos>."""
    texts, ended = [], []
    device = next(model.parameters()).device
    for start in range(0, len(xs), batch_size):
        chunk = list(xs[start:start + batch_size])
        ids, attn = prompt_batch(tokenizer, chunk)
        n = max_new_tokens or max(len(x) for x in chunk) + 2
        out = model.generate(ids.to(device), attn.to(device), max_new_tokens=n, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for text, eos in decode_outputs(tokenizer, out.cpu(), ids.shape[1]):
            texts.append(text)
            ended.append(eos)
    return texts, ended


def exact_match(model: ComposedLM, tokenizer, xs: Sequence[str], rule_sets: Sequence[RuleSet],
                batch_size: int = 250) -> float:
    """Fraction of inputs whose greedy output is exactly `apply_rules(x, rule_sets)` followed by <eos>."""
    preds, ended = greedy_outputs(model, tokenizer, xs, batch_size)
    metric = ExactMatch()
    metric.update(preds, [apply_rules(x, rule_sets) for x in xs], ended)
    return float(metric.compute())


@torch.no_grad()
def evaluate_composition(model: ComposedLM, tokenizer, dataset, rule_sets: Sequence[RuleSet],
                         collate, batch_size: int = 250, active_threshold: float = 0.01) -> dict[str, float]:
    """Everything the composition is judged by, on a compositional dataset (rows with x, y, masks [k, T]).

    Generation: exact match, per-skill accuracy, failure types. Teacher-forced on the ideal composed
    targets (the prefixes the composition should produce): NLL of the joint target, projectivity error,
    each expert's off/on-mask KL and largest off-mask centered log-ratio, pairwise active-set IoU.
    """
    names = list(model.names)
    k = len(names)
    xs, ys = list(dataset["x"]), list(dataset["y"])
    preds, ended = greedy_outputs(model, tokenizer, xs, batch_size)
    results: dict[str, float] = {}

    em, failures = ExactMatch(), FailureTypes()
    em.update(preds, ys, ended)
    results["exact_match"] = float(em.compute())
    for i, rs in enumerate(rule_sets):
        hits = total = 0
        for x, y, p in zip(xs, ys, preds, strict=True):
            for j, c in enumerate(x):
                if c in rs.sources:
                    total += 1
                    hits += int(j < len(p) and p[j] == y[j])
        results[f"{names[i]}/skill_accuracy"] = hits / total if total else float("nan")
    sources = set().union(*(rs.sources for rs in rule_sets)) if rule_sets else set()
    failures.update(preds, ys, xs, ended, [{j for j, c in enumerate(x) if c in sources} for x in xs])
    for kind, frac in failures.compute().items():
        results[f"failures/{kind}"] = float(frac)

    device = next(model.parameters()).device
    nll, proj = SequenceNLL().to(device), ProjectivityError().to(device)
    off = [MaskedDivergence(region="off").to(device) for _ in range(k)]
    on = [MaskedDivergence(region="on").to(device) for _ in range(k)]
    overlap = ActiveSetOverlap(num_experts=k, threshold=active_threshold).to(device) if k > 1 else None
    max_ratio = torch.zeros(k)
    rows = [dataset[i] for i in range(len(dataset))]
    for start in range(0, len(rows), batch_size):
        batch = {key: v.to(device) if isinstance(v, Tensor) else v
                 for key, v in collate(rows[start:start + batch_size]).items()}
        targets, masks = batch["targets"], batch["masks"]  # masks [B, k, T]
        lp_b, lp_e = model.component_logprobs(batch["input_ids"], batch["attention_mask"])
        composed = compose_logprobs(lp_b, lp_e, weights=model.weights)
        nll.update(composed, targets)
        proj.update(composed, lp_b, lp_e, targets, masks)
        if overlap is not None:
            overlap.update(lp_e, lp_b, targets)
        for i in range(k):
            off[i].update(lp_e[i], lp_b, targets, masks[:, i])
            on[i].update(lp_e[i], lp_b, targets, masks[:, i])
            ratio = lp_e[i] - lp_b
            ratio = ratio - ratio.mean(-1, keepdim=True)
            off_pos = (targets != -100) & ~masks[:, i]
            if off_pos.any():
                max_ratio[i] = max(max_ratio[i], ratio[off_pos].abs().max().item())
    results["nll"] = float(nll.compute())
    results["projectivity_error"] = float(proj.compute())
    for i, name in enumerate(names):
        results[f"{name}/off_mask_kl"] = float(off[i].compute())
        results[f"{name}/on_mask_kl"] = float(on[i].compute())
        results[f"{name}/max_off_mask_log_ratio"] = float(max_ratio[i])
    if overlap is not None:
        iou = overlap.compute()
        for a in range(k):
            for b in range(a + 1, k):
                results[f"overlap/{names[a]}__{names[b]}"] = float(iou[a, b])
    return results
