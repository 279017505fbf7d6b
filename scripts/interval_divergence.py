"""How far each expert of a composition moves off the background, by region of the compositional test rows.

    python scripts/interval_divergence.py EXPORT [EXPORT ...] [--limit 48] [--test_setting eval_limit=48] \
        [--perplexity] [--top1] [--first_miss] [--foreign N] [--out FILE.json]

For each expert i, the mean KL(p_b ‖ p_i) (teacher-forced on the reference) at the target positions of the
compositional test rows that lie in its own interval (`own`), in another expert's interval (`other`), and in no
interval (`none`), with the position counts. An expert trained alone that is composable keeps `other` as small
as `none`: inside another expert's interval its factor p_i / p_b should be 1. The exports are combined as
`python -m compose.combine` combines them (`compose.frontends.combine.check_exports`).

Beside each KL, `ratio_<region>`: the mean log-ratio log p_i(y) − log p_b(y) at the reference token y. KL weighs
each token by p_b, but inside another expert's interval the reference is often a token the background finds
unlikely (a reversed word, a French one), so an expert can pull it down while its KL stays small; the product
rule adds that pull of every other expert to the active one's log-prob.

`--top1`: how often the background's and the soft composition's most likely next token is not the reference's,
inside an interval, at the first position after one closes (`after`: the text right after `>>` or `]`), and
elsewhere in no interval (`none`). Where the experts drift the same way just after their intervals close, the
composition errs at `after` where the background does not.

`--first_miss`: where greedy soft decoding first leaves each row's reference (the first teacher-forced position
whose top token is not the reference's; greedy decoding copies the reference up to there): at the token that opens
an interval, inside one, right after one closes, at the final EOS, or elsewhere; whether the background alone (or,
inside an interval, its owner alone) ranks the reference first there; and which expert's shift of the two tokens'
odds was largest. With `--out`, the first 40 misses are written as examples, each token also decoded after the
ones before it (a byte-level token may be a piece of one character).

`--foreign N`: the same KL on the first N held-out general test rows given one or two random foreign spans
(`data.foreign_spans`, from the delimiter pairs that touch no expert's delimiters; seeded), the kind of span the
`own+foreign` regularizer rows train on: inside those spans against elsewhere. Beside `other` above, it tells
whether an expert's drift inside another expert's interval is drift the regularizer never sees (small here, large
there) or drift it does not remove (large in both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REGIONS = ("own", "other", "none")


TOP1_REGIONS = ("inside", "after", "none")
# where greedy soft decoding first leaves the reference: at the token just before an interval's content (`open`: its
# start delimiter or the token holding it), inside one, right after one closes, the final EOS, elsewhere
FIRST_MISS_REGIONS = ("open", "inside", "after", "eos", "none")


def _means(sums: torch.Tensor, counts: torch.Tensor, regions: tuple[str, ...]) -> dict[str, float]:
    """`{region: sum / count, region_n: count}` (NaN where a region has no position)."""
    return {**{region: float(sums[r] / counts[r]) if counts[r] else float("nan") for r, region in enumerate(regions)},
            **{f"{region}_n": int(counts[r]) for r, region in enumerate(regions)}}


@torch.no_grad()
def region_divergence(composed, dataset, collate, batch_size: int = 8, *, top1: bool = False,
                      misses: int = 0, first_miss: bool = False) -> dict[str, dict]:
    """`{expert: {own, other, none, own_n, other_n, none_n, ratio_own, ratio_other, ratio_none}}`: mean
    KL(p_b ‖ p_i) per region, its positions, and the mean log-ratio log p_i − log p_b at the reference token.

    `top1`: in the same teacher-forced pass, also `"top1_errors": {background, composition}` × `{inside, after,
    none}`: the fraction of target positions where the model's most likely token is not the reference's (`after`:
    the first position after an interval closes), and the positions (`<region>_n`). `misses`: also
    `"after_misses"`, the first `misses` positions right after a close where the composition's top token is not
    the reference's: the row, the text before, both tokens, and each component's log-probs of both."""
    from compose import compose_logprobs
    from losses import IGNORE_INDEX, divergence

    k = len(composed.names)
    sums = torch.zeros(k, len(REGIONS), dtype=torch.float64)
    counts = torch.zeros(k, len(REGIONS), dtype=torch.long)
    ratio_sums = torch.zeros(k, len(REGIONS), dtype=torch.float64)
    errors = torch.zeros(2, len(TOP1_REGIONS), dtype=torch.long)
    missed: list[dict] = []
    top1_counts = torch.zeros(len(TOP1_REGIONS), dtype=torch.long)
    first = first_miss_counts(composed.names)
    rows = [dataset[i] for i in range(len(dataset))]
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start:start + batch_size])
        lp_b, lp_e = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
        kl = divergence(lp_e, lp_b.expand_as(lp_e), "forward_kl").double()  # [k, B, T]
        targets = batch["targets"]
        valid = targets != IGNORE_INDEX
        masks = batch["masks"].bool().transpose(0, 1) & valid  # [k, B, T]
        index = targets.clamp_min(0).unsqueeze(-1)  # [B, T, 1]
        ref_ratio = (lp_e.gather(-1, index.expand(k, *index.shape)) - lp_b.gather(-1, index)).squeeze(-1).double()
        anywhere = masks.any(0)
        for i in range(k):
            other = anywhere & ~masks[i]
            for r, region in enumerate((masks[i], other, valid & ~anywhere)):
                sums[i, r] += kl[i][region].sum()
                ratio_sums[i, r] += ref_ratio[i][region].sum()
                counts[i, r] += int(region.sum())
        if top1 or first_miss:
            soft = compose_logprobs(lp_b, lp_e, weights=composed.weights, min_logprob=composed.min_logprob)
        if top1:
            closed = torch.zeros_like(anywhere)
            closed[:, 1:] = anywhere[:, :-1]  # the position before was the last of an interval
            after = valid & ~anywhere & closed
            regions = (anywhere, after, valid & ~anywhere & ~after)
            for m, lp in enumerate((lp_b, soft)):
                wrong = lp.argmax(-1) != targets
                for r, region in enumerate(regions):
                    errors[m, r] += int((wrong & region).sum())
            for row, pos in ((soft.argmax(-1) != targets) & after).nonzero().tolist()[:misses - len(missed)]:
                missed.append(_miss(composed, batch["input_ids"][row], targets[row], pos, soft[row, pos],
                                    lp_b[row, pos], lp_e[:, row, pos], start + row))
            for r, region in enumerate(regions):
                top1_counts[r] += int(region.sum())
        if first_miss:
            _first_misses(first, composed, batch["input_ids"], targets, valid, masks, soft, lp_b, lp_e, start)
    ratio_regions = tuple(f"ratio_{region}" for region in REGIONS)
    out: dict[str, dict] = {
        name: {**_means(sums[i], counts[i], REGIONS),
               **{key: value for key, value in _means(ratio_sums[i], counts[i], ratio_regions).items()
                  if not key.endswith("_n")}}
        for i, name in enumerate(composed.names)}
    if top1:
        out["top1_errors"] = {model: _means(errors[m].double(), top1_counts, TOP1_REGIONS)
                              for m, model in enumerate(("background", "composition"))}
        if misses:
            out["after_misses"] = missed
    if first_miss:
        out["first_miss"] = first
    return out


@torch.no_grad()
def foreign_span_divergence(composed, task, n: int, seed: int = 0, batch_size: int = 8) -> dict[str, dict]:
    """`{expert: {inside, outside, inside_n, outside_n}}`: mean KL(p_b ‖ p_i) at the target positions of `n` held-out
    general test rows with random foreign spans, inside the spans and outside them (`--foreign`)."""
    from data.foreign_spans import DELIMITER_POOL, delimiter_pool
    from data.tasks.text import inside_foreign_positions, make_row
    from losses import IGNORE_INDEX, divergence

    free = [pair for pair in DELIMITER_POOL if all(pair in delimiter_pool(spec) for spec in task.specs)]
    rows = [make_row(enc, [], task.eos, inside_foreign=inside_foreign_positions(enc))
            for enc in task.spanned(list(task.general["test"])[:n], None, seed, pool=free)]
    collate = task.collator()
    k = len(composed.names)
    sums, counts = torch.zeros(k, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start:start + batch_size])
        valid = batch["targets"] != IGNORE_INDEX
        inside = batch["inside_foreign"].bool() & valid
        lp_b, lp_e = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
        kl = divergence(lp_e, lp_b.expand_as(lp_e), "forward_kl").double()  # [k, B, T]
        for r, region in enumerate((inside, valid & ~inside)):
            sums[:, r] += kl[:, region].sum(-1)
            counts[r] += int(region.sum())
    return {name: _means(sums[i], counts, ("inside", "outside")) for i, name in enumerate(composed.names)}


def first_miss_counts(names: list[str]) -> dict:
    """The empty tally `_first_misses` adds to: rows, rows with no miss, each region's misses and how many the
    background alone gets right, inside misses the owner alone gets right, misses per expert pushing most, and
    the first 40 misses as examples."""
    return {"rows": 0, "no_miss": 0, "inside_owner_right": 0, **{r: 0 for r in FIRST_MISS_REGIONS},
            **{f"{r}_background_right": 0 for r in FIRST_MISS_REGIONS},
            "pushed_most": {name: 0 for name in names}, "examples": []}


def _first_misses(acc: dict, composed, ids, targets, valid, masks, soft, lp_b, lp_e, start: int) -> None:
    """Adds each row's first position where the soft composition's top token misses the reference to `acc`
    (`masks`: `[k, B, T]`, each expert's interval positions). Inside an interval, also whether its owner alone
    ranks the reference first there (`inside_owner_right`: the miss is the other experts' doing)."""
    inside = masks.any(0)
    wrong = (soft.argmax(-1) != targets) & valid
    weights = torch.tensor(composed.weights, dtype=lp_e.dtype)
    for row in range(targets.shape[0]):
        acc["rows"] += 1
        hits = wrong[row].nonzero().flatten()
        if not len(hits):
            acc["no_miss"] += 1
            continue
        t, last = int(hits[0]), int(valid[row].nonzero().max())
        opens = t + 1 < inside.shape[1] and bool(inside[row, t + 1])
        region = ("inside" if inside[row, t] else "open" if opens else "eos" if t == last
                  else "after" if t > 0 and inside[row, t - 1] else "none")
        acc[region] += 1
        ref, top = int(targets[row, t]), int(soft[row, t].argmax())
        acc[f"{region}_background_right"] += int(int(lp_b[row, t].argmax()) == ref)
        if region == "inside":
            owner = int(masks[:, row, t].nonzero()[0])
            acc["inside_owner_right"] += int(int(lp_e[owner, row, t].argmax()) == ref)
        shift = weights * ((lp_e[:, row, t, ref] - lp_b[row, t, ref]) - (lp_e[:, row, t, top] - lp_b[row, t, top]))
        acc["pushed_most"][composed.names[int(shift.argmin())]] += 1
        if len(acc["examples"]) < 40:
            decode = composed.tokenizer.decode
            before = ids[row, max(0, t - 8):t + 1].tolist()
            # A byte-level token alone may be part of one character (`⟦` is three tokens in SmolLM2): the
            # `*_in_context` strings decode it after the three tokens before it, so the character shows.
            context = before[-3:]
            acc["examples"].append({
                "row": start + row, "region": region, "before": decode(before),
                "reference": decode([ref]), "composition_top": decode([top]),
                "reference_in_context": decode(context + [ref]), "top_in_context": decode(context + [top]),
                "shift": {n: round(float(x), 2) for n, x in zip(composed.names, shift.tolist(), strict=True)},
                "log_ratio": _log_ratios(composed.names, lp_e[:, row, t], lp_b[row, t], ref, top)})


def _log_ratios(names: list[str], lp_e: torch.Tensor, lp_b: torch.Tensor, ref: int, top: int) -> dict:
    """Each expert's log-ratio log p_i − log p_b at one position (`lp_e`: `[k, V]`): at the reference token, at the
    composition's top token, and its median over the vocabulary (where the bulk of the tail sits: a median above 0
    is an expert flatter than the background, raising the whole tail rather than one token; below 0, sharper)."""
    r = lp_e - lp_b
    return {n: {"reference": round(float(r[i, ref]), 2), "top": round(float(r[i, top]), 2),
                "median": round(float(r[i].median()), 2)} for i, n in enumerate(names)}


def _miss(composed, ids, targets, pos: int, soft, lp_b, lp_e, row: int) -> dict:
    """One position where the composition's top token misses the reference: the tokens and the log-probs."""
    decode = composed.tokenizer.decode
    ref, top = int(targets[pos]), int(soft.argmax())
    both = lambda lp: [round(float(lp[ref]), 2), round(float(lp[top]), 2)]  # noqa: E731
    return {"row": row, "before": decode(ids[max(0, pos - 8):pos + 1]), "reference": decode([ref]),
            "composition_top": decode([top]), "logprobs [reference, top]": {
                "background": both(lp_b), **{n: both(lp_e[i]) for i, n in enumerate(composed.names)},
                "composition": both(soft)}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exports", nargs="+", help="export folders, in composition order")
    parser.add_argument("--limit", type=int, default=None, help="the first N compositional test rows only")
    parser.add_argument("--test_setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a task setting changed for the test split (YAML value; repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    parser.add_argument("--perplexity", action="store_true",
                        help="also the general perplexity of the soft composition and of the background on the "
                             "held-out general test rows (a whole teacher-forced pass over them)")
    parser.add_argument("--misses", type=int, default=0, metavar="N",
                        help="with --top1: also list the first N positions right after a close where the soft "
                             "composition's top token misses the reference, with every component's log-probs")
    parser.add_argument("--top1", action="store_true",
                        help="also how often the background's and the soft composition's top token misses the "
                             "reference, inside intervals, right after one closes, and elsewhere")
    parser.add_argument("--first_miss", action="store_true",
                        help="also where each row's greedy soft decoding first leaves the reference, by region, "
                             "and which expert pushed most there")
    parser.add_argument("--foreign", type=int, default=0, metavar="N",
                        help="also the KL inside and outside random foreign spans put into the first N held-out "
                             "general test rows (the spans the own+foreign regularizer trains on)")
    args = parser.parse_args(argv)

    from compose.frontends.combine import CombineError, assemble, check_exports, load_composed

    settings = {}
    for item in args.test_setting:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--test_setting {item!r}: expected KEY=VALUE")
        settings[key] = yaml.safe_load(value)
    try:
        combination = check_exports(args.exports, test_settings=settings)
    except CombineError as err:
        raise SystemExit(f"interval_divergence: {err}") from None
    dataset = combination.task.compositional_dataset("test")
    if args.limit is not None and args.limit < len(dataset):
        dataset = dataset.select(range(args.limit))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="interval-divergence-") as scratch:
        folder = Path(scratch) / "export"
        assemble(combination, folder, background="ref")
        composed = load_composed(folder)
        experts = region_divergence(composed, dataset, combination.task.collator(), top1=args.top1,
                                    misses=args.misses if args.top1 else 0, first_miss=args.first_miss)
        result = {"exports": [str(p) for p in args.exports], "n_test": len(dataset)}
        if args.top1:
            result["top1_errors"] = experts.pop("top1_errors")
        if "first_miss" in experts:
            result["first_miss"] = experts.pop("first_miss")
        if "after_misses" in experts:
            result["after_misses"] = experts.pop("after_misses")
        result["experts"] = experts
        if args.foreign:
            result["foreign_spans"] = foreign_span_divergence(composed, combination.task, args.foreign)
        if args.perplexity:
            from compose import ComposedLM

            background = ComposedLM.from_peft(composed.model, [], tokenizer=composed.tokenizer)
            result["general_perplexity"] = {
                "composition": combination.task.general_perplexity(composed, "test", 8),
                "background": combination.task.general_perplexity(background, "test", 8)}
    for name, r in result["experts"].items():
        print(f"{name}: KL(p_b||p_i) own {r['own']:.4f} (n={r['own_n']}), inside another expert's interval "
              f"{r['other']:.4f} (n={r['other_n']}), in no interval {r['none']:.4f} (n={r['none_n']}); "
              f"log p_i/p_b of the reference token: own {r['ratio_own']:+.3f}, another's {r['ratio_other']:+.3f}, "
              f"none {r['ratio_none']:+.3f}")
    for name, r in result.get("foreign_spans", {}).items():
        print(f"{name}: KL(p_b||p_i) inside random foreign spans {r['inside']:.4f} (n={r['inside_n']}), outside them "
              f"{r['outside']:.4f} (n={r['outside_n']})")
    for model, r in result.get("top1_errors", {}).items():
        print(f"{model}: top token misses the reference " + ", ".join(
            f"{region} {r[region]:.4f} (n={r[f'{region}_n']})" for region in TOP1_REGIONS))
    for miss in result.get("after_misses", []):
        print(f"row {miss['row']}: ...{miss['before']!r} then {miss['reference']!r}, composition "
              f"{miss['composition_top']!r}; log-probs of both: {miss['logprobs [reference, top]']}")
    if "first_miss" in result:
        fm = result["first_miss"]
        print(f"soft greedy decoding leaves the reference in {fm['rows'] - fm['no_miss']} of {fm['rows']} rows, first "
              + ", ".join(f"{r} {fm[r]} (background right there: {fm[f'{r}_background_right']})"
                          for r in FIRST_MISS_REGIONS) + f"; inside, the interval's owner alone right there: "
              f"{fm['inside_owner_right']}; pushed most by " + ", ".join(
                  f"{n} {c}" for n, c in fm["pushed_most"].items()))
    if "general_perplexity" in result:
        ppl = result["general_perplexity"]
        print(f"general perplexity: composition {ppl['composition']:.4f}, background {ppl['background']:.4f} "
              f"({ppl['composition'] / ppl['background']:.4f} x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
