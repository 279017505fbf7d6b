"""Task-level evaluation of a (composed) model on the letter task: greedy decoding and teacher forcing.

Shared by the validation-time `CompositionEvaluation` callback and the final test stage, so the numbers
logged during training and those in `summary.json` are computed by the same code.

Both data formats are supported (`format=`, one of `data.letters.DATA_FORMATS`): `generative` decodes
`<bos> x <sep>` greedily with `ComposedLM.generate`; `aligned` generates nothing: the prediction is the
argmax of `ComposedLM.score(<bos> x)` at the positions holding `x`, and counts as ended with <eos>.
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
    SkillAccuracy,
    TargetMargin,
)
from data.letters import RuleSet, aligned_batch, apply_rules, check_format, decode_outputs, prompt_batch


@torch.no_grad()
def aligned_outputs(model: ComposedLM, tokenizer, xs: Sequence[str],
                    batch_size: int = 250) -> tuple[list[str], list[bool]]:
    """Position-aligned predictions: for each `x`, the argmax of the composed log-probs at the positions
    holding `x[0] .. x[n-1]` of `<bos> x` (right-padded), decoded (special tokens kept, e.g. `"<eos>"`, so a
    malformed prediction never matches a letter string). Every output counts as ended (`True`)."""
    texts: list[str] = []
    for start in range(0, len(xs), batch_size):
        chunk = list(xs[start:start + batch_size])
        ids, attn = aligned_batch(tokenizer, chunk)
        device = next(model.parameters()).device
        best = model.score(ids.to(device), attn.to(device)).argmax(-1).cpu()  # [B, 1 + max n]
        for b, x in enumerate(chunk):
            texts.append(tokenizer.decode(best[b, 1:1 + len(x)].tolist(), skip_special_tokens=False))
    return texts, [True] * len(texts)


@torch.no_grad()
def greedy_outputs(model: ComposedLM, tokenizer, xs: Sequence[str], batch_size: int = 250,
                   max_new_tokens: int | None = None,
                   format: str = "generative") -> tuple[list[str], list[bool]]:
    """Greedy outputs (letters up to <eos>) and whether each ended with <eos>.

    With `format="aligned"` nothing is generated: see `aligned_outputs` (`max_new_tokens` is unused).
    """
    if check_format(format) == "aligned":
        return aligned_outputs(model, tokenizer, xs, batch_size)
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
                batch_size: int = 250, format: str = "generative") -> float:
    """Fraction of inputs whose greedy output is exactly `apply_rules(x, rule_sets)` followed by <eos>
    (`format="aligned"`: whose argmax at every position of `x` is right)."""
    preds, ended = greedy_outputs(model, tokenizer, xs, batch_size, format=format)
    metric = ExactMatch()
    metric.update(preds, [apply_rules(x, rule_sets) for x in xs], ended)
    return float(metric.compute())


def _check_dataset_format(dataset, format: str) -> None:
    """Aligned rows have `output_start == 1`; generative ones `len(x) + 2 >= 3`."""
    if check_format(format) and len(dataset) and "output_start" in dataset.column_names:
        aligned = dataset[0]["output_start"] == 1
        if aligned != (format == "aligned"):
            raise ValueError(f"evaluate_composition: format={format!r} but the dataset's rows are in the "
                             f"{'aligned' if aligned else 'generative'} format (output_start="
                             f"{dataset[0]['output_start']})")


@torch.no_grad()
def evaluate_composition(model: ComposedLM, tokenizer, dataset, rule_sets: Sequence[RuleSet],
                         collate, batch_size: int = 250, active_threshold: float = 0.01,
                         format: str = "generative") -> dict[str, float]:
    """Everything the composition is judged by, on a compositional dataset (rows with x, y, masks [k, T]).

    Generation (`format="aligned"`: argmax at the positions of `x`, see `aligned_outputs`): exact match,
    per-skill accuracy, failure types. Teacher-forced on the ideal composed targets (the prefixes the
    composition should produce): NLL of the joint target, projectivity error, the composed margin of the
    targets on and off the masks (`TargetMargin`: smallest, fraction below 0 and 2 nats), each expert's off/on-mask KL
    and largest off-mask centered log-ratio, pairwise active-set IoU. `dataset` must be built in `format`.
    """
    _check_dataset_format(dataset, format)
    names = list(model.names)
    k = len(names)
    xs, ys = list(dataset["x"]), list(dataset["y"])
    preds, ended = greedy_outputs(model, tokenizer, xs, batch_size, format=format)
    results: dict[str, float] = {}

    em, failures = ExactMatch(), FailureTypes()
    em.update(preds, ys, ended)
    results["exact_match"] = float(em.compute())
    # Position-aligned letters as code points ([N, L], -100 past each reference's end).
    width = max((len(y) for y in ys), default=0)
    as_codes = lambda text: [ord(c) for c in text[:width]] + [-100] * (width - len(text[:width]))  # noqa: E731
    pred_codes, ref_codes = torch.tensor([as_codes(p) for p in preds]), torch.tensor([as_codes(y) for y in ys])
    for i, rs in enumerate(rule_sets):
        skill = SkillAccuracy()
        skill.update(pred_codes, ref_codes, torch.tensor([[c in rs.sources for c in x.ljust(width)] for x in xs]))
        results[f"{names[i]}/skill_accuracy"] = float(skill.compute())
    sources = set().union(*(rs.sources for rs in rule_sets)) if rule_sets else set()
    failures.update(preds, ys, xs, ended, [{j for j, c in enumerate(x) if c in sources} for x in xs])
    for kind, frac in failures.compute().items():
        results[f"failures/{kind}"] = float(frac)

    device = next(model.parameters()).device
    nll, proj = SequenceNLL().to(device), ProjectivityError().to(device)
    margins = {region: TargetMargin().to(device) for region in ("on_mask", "off_mask")}
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
        in_a_mask = masks.any(1)
        margins["on_mask"].update(composed, targets, in_a_mask)
        margins["off_mask"].update(composed, targets, ~in_a_mask)
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
    for region, metric in margins.items():
        for key, value in metric.compute().items():
            results[f"margin_{region}_{key}"] = float(value)
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
