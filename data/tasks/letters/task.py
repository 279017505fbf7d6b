"""The letter-replacement task (docs/method.md) behind the task seam.

Background: copy `x`. Expert: a `RuleSet` such as `{"A": "B"}` applied position-wise; its mask is the
output positions aligned with its source letters. Generative rows `<bos> x <sep> y <eos>` are decoded
greedily; position-aligned rows `<bos> x` (the paper's appendix) are judged by the argmax at each position.

Every split is drawn from its own seed derived from the run's seed (and the expert's *name*, so adding an
expert leaves the others' data unchanged); validation inputs avoid the training inputs and test inputs
avoid both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import datasets
import torch

from compose.metrics import ExactMatch, FailureTypes, SkillAccuracy
from data.collate import Collator, CorruptionRate
from data.generation import greedy_decode
from data.splits import derive_seed, draw_excluding
from data.tasks import register_task
from data.tasks.base import EVAL_SPLITS, SPLITS, Expert, Task, TaskError, check_split, check_split_sizes
from data.tasks.letters.rules import (
    RuleSet,
    aligned_batch,
    apply_rules,
    compositional_inputs,
    dataset_builder,
    expert_inputs,
    prompt_ids,
    random_rule_outputs,
    sample_strings,
    validate_rule_sets,
)
from data.tokenizer import build_char_tokenizer, letter_ids, validate_alphabet


@dataclass
class LettersConfig:
    """Settings of the letter task (the `task:` config node with `name: letters`).

    Attributes:
        alphabet: the letters (the character tokenizer is built from them).
        min_len, max_len: input lengths are uniform in `[min_len, max_len]`.
        format: `generative` (`<bos> x <sep> y <eos>`, decoded greedily) or `aligned` (`<bos> x`, the logits
            at `x[j]` predict `y[j]`; prefix corruption does not apply).
        n_train, n_val, n_test: rows per split *per expert* (the same count again for each expert's
            regularizer rows when `reg_data` adds any; the background's copy rows count once).
        source_prob: fraction of an expert's inputs planted with one of its source letters.
        compositional_min_experts: None: compositional inputs contain a source of every expert in play;
            otherwise of a random subset of at least this many (>= 2).
        eval_lengths: `[shortest, longest]`: after training, evaluate the background, each expert alone and the
            composition at every input length in this range (`LettersTask.evaluate_lengths`); None: no sweep.
        n_per_length: inputs per length and model in that sweep.
    """

    alphabet: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    min_len: int = 8
    max_len: int = 16
    format: str = "generative"
    n_train: int = 8000
    n_val: int = 500
    n_test: int = 1000
    source_prob: float = 0.5
    compositional_min_experts: int | None = None
    eval_lengths: list[int] | None = None
    n_per_length: int = 200

    def __post_init__(self) -> None:
        try:
            validate_alphabet(self.alphabet)
        except ValueError as e:
            raise TaskError(f"task.alphabet: {e}") from None
        if self.min_len < 1 or self.max_len < self.min_len:
            raise TaskError(f"task: need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if self.format not in ("generative", "aligned"):
            raise TaskError(f"task.format={self.format!r} is not one of generative, aligned")
        check_split_sizes(self, self._row_length(self.max_len))
        if not 0.0 <= self.source_prob <= 1.0:
            raise TaskError(f"task.source_prob must be in [0, 1], got {self.source_prob}")
        m = self.compositional_min_experts
        if m is not None and m < 2:
            raise TaskError(f"task.compositional_min_experts must be None or >= 2, got {m}")
        lengths = self.eval_lengths
        if lengths is not None and (len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]):
            raise TaskError(f"task.eval_lengths={list(lengths)}: give [shortest, longest] with 1 <= shortest <= longest")
        if lengths is not None and self.format != "generative":
            raise TaskError("task.eval_lengths sweeps decoded lengths: it needs task.format=generative")
        check_split_sizes(self, self._row_length(max(lengths or [0])), ("n_per_length",))

    @property
    def outputs_align_with_inputs(self) -> bool:
        """Whether output `y_t` is computed from input `x_t` at every position (the generative format), so that
        `model.position_encoding=auto` couples their positions (`lightning_modules.pipeline.config`)."""
        return self.format == "generative"

    @property
    def max_row_length(self) -> int:
        """Tokens in the longest row, training or evaluation: `<bos> x <sep> y <eos>` (generative) or `<bos> x`
        (aligned)."""
        return self._row_length(max([self.max_len, *(self.eval_lengths or [])]))

    @property
    def max_row_length_key(self) -> str:
        """The setting that makes `max_row_length`: `task.eval_lengths` or `task.max_len`."""
        return "task.eval_lengths" if max(self.eval_lengths or [0]) > self.max_len else "task.max_len"

    def _row_length(self, length: int) -> int:
        return 2 * length + 3 if self.format == "generative" else length + 1


@register_task("letters")
class LettersTask(Task):
    """Letter replacement: experts own letter rules (`experts[i].rules`)."""

    config_class = LettersConfig

    def __init__(self, cfg: LettersConfig, experts: Sequence[Expert], **kwargs) -> None:
        super().__init__(cfg, experts, **kwargs)
        if self.reg_data == "random_rules" and cfg.format == "aligned":
            raise TaskError("expert.reg_data=random_rules edits teacher-forced prefixes; the aligned format has none")
        rule_sets = []
        for e in self.experts:
            if "rules" not in e.spec or set(e.spec) != {"rules"}:
                raise TaskError(f"expert {e.name!r}: the letters task needs `rules` (and no other mask spec), "
                                f"got {sorted(e.spec) or 'none'}")
            rule_sets.append(RuleSet(e.name, dict(e.spec["rules"])))
        try:
            self._overlaps = validate_rule_sets(rule_sets, cfg.alphabet, allow_overlap=self.allow_overlap)
        except ValueError as e:
            raise TaskError(f"experts: {e}") from None
        m = cfg.compositional_min_experts
        if m is not None and m > len(rule_sets):
            raise TaskError(f"task.compositional_min_experts={m} exceeds the {len(rule_sets)} experts in play")
        planted = len(rule_sets) if m is None else m
        if rule_sets and cfg.min_len < planted:
            raise TaskError(f"task.min_len={cfg.min_len}: compositional inputs plant a source letter of {planted} "
                            f"experts, so inputs must be at least {planted} letters long (raise task.min_len or set "
                            f"task.compositional_min_experts)")
        if cfg.eval_lengths and rule_sets and cfg.eval_lengths[0] < planted:
            raise TaskError(f"task.eval_lengths={list(cfg.eval_lengths)}: compositional inputs plant a source letter "
                            f"of {planted} experts, so the shortest length must be >= {planted}")
        self.rule_sets = rule_sets
        self._trained_rules = [rule_sets[self.expert_names.index(n)] for n in self.trained]
        self._tokenizer = build_char_tokenizer(cfg.alphabet)
        given = kwargs.get("tokenizer")
        if given is not None and given.get_vocab() != self._tokenizer.get_vocab():
            raise TaskError("the letters task uses its own character tokenizer (task.alphabet); the pretrained "
                            "model's tokenizer differs from it")
        self._build = dataset_builder(cfg.format)
        self._background: dict[str, datasets.Dataset] = {}
        self._experts: dict[str, datasets.Dataset] = {}
        self._expert_inputs: dict[str, list[list[str]]] = {}
        self._compositional: dict[str, list[str]] = {}
        self._compositional_rows: dict[str, datasets.Dataset] = {}

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def notes(self) -> list[str]:
        return list(self._overlaps)

    def standard_experts(self, k: int) -> list[dict]:
        """Disjoint single-letter experts A→B, C→D, E→F, ..."""
        alphabet = self.cfg.alphabet
        if 2 * k > len(alphabet):
            raise TaskError(f"k={k} experts with disjoint single-letter rules need {2 * k} letters; "
                            f"the alphabet has {len(alphabet)}")
        return [{"name": f"{alphabet[2 * i]}_to_{alphabet[2 * i + 1]}", "rules": {alphabet[2 * i]: alphabet[2 * i + 1]}}
                for i in range(k)]

    def collator(self, corruption_prob: CorruptionRate = 0.0) -> Collator:
        # Aligned rows have no teacher-forced outputs: their output span is the input x itself.
        prob = 0.0 if self.cfg.format == "aligned" else corruption_prob
        return Collator(self._tokenizer.pad_token_id, letter_ids(self._tokenizer, self.cfg.alphabet), prob)

    # --- rows -------------------------------------------------------------------------------------
    def _strings(self, n: int, seed: int) -> Callable[[int], list[str]]:
        c = self.cfg
        return lambda attempt: sample_strings(n, c.alphabet, c.min_len, c.max_len, derive_seed(seed, attempt))

    def _compositional_maker(self, n: int, seed: int) -> Callable[[int], list[str]]:
        c = self.cfg
        return lambda attempt: compositional_inputs(n, c.alphabet, c.min_len, c.max_len, derive_seed(seed, attempt),
                                                    self.rule_sets, c.compositional_min_experts)

    def background_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, SPLITS)
        if not self._background:
            c, seen = self.cfg, set()
            for name, n in (("train", c.n_train), ("val", c.n_val), ("test", c.n_test)):
                xs = draw_excluding(self._strings(n, derive_seed(self.seed, "background", name)), n, seen,
                                    f"background {name}")
                seen.update(xs)
                self._background[name] = self._build(xs, [], [], self._tokenizer)
        return self._background[split]

    def expert_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, SPLITS)
        self._build_expert_splits()
        return self._experts[split]

    def _build_expert_splits(self) -> None:
        """Every expert split and the compositional val/test inputs, in one pass so they are disjoint."""
        if self._experts:
            return
        c, tok, seen = self.cfg, self._tokenizer, set()
        for split, n in (("train", c.n_train), ("val", c.n_val), ("test", c.n_test)):
            parts, self._expert_inputs[split] = [], []
            for i, rs in enumerate(self._trained_rules):
                seed = derive_seed(self.seed, "expert", rs.name, split)

                def make(attempt: int, n: int = n, seed: int = seed, rs: RuleSet = rs) -> list[str]:
                    return expert_inputs(n, c.alphabet, c.min_len, c.max_len, derive_seed(seed, attempt), rs,
                                         c.source_prob)

                xs = draw_excluding(make, n, seen, f"expert {rs.name!r} {split}")
                self._expert_inputs[split].append(xs)
                parts.append(self._build(xs, [rs], [rs], tok, {"expert_index": i, "is_task": 1, "task_on_mask": 1}))
                if split == "train":
                    parts.extend(self._regularizer_rows(i, rs, n))
            for xs in self._expert_inputs[split]:
                seen.update(xs)
            if split == "train":
                for part in parts:
                    seen.update(part["x"])
            else:
                make = self._compositional_maker(n, derive_seed(self.seed, "compositional", split))
                self._compositional[split] = draw_excluding(make, n, seen, f"compositional {split}")
                seen.update(self._compositional[split])
            self._experts[split] = datasets.concatenate_datasets(parts) if parts else None

    def _regularizer_rows(self, i: int, rs: RuleSet, n: int) -> list[datasets.Dataset]:
        extra = {"expert_index": i, "is_task": 0}
        if self.reg_data in ("background", "own+background"):
            xs = self._strings(n, derive_seed(self.seed, "regularizer-copy", rs.name))(0)
            return [self._build(xs, [], [rs], self._tokenizer, {**extra, "task_on_mask": 0})]
        if self.reg_data == "composition":
            xs = self._compositional_maker(n, derive_seed(self.seed, "regularizer-composition", rs.name))(0)
            return [self._build(xs, self.rule_sets, [rs], self._tokenizer, {**extra, "task_on_mask": 1})]
        if self.reg_data == "random_rules":  # the composition's kind of prefix, knowing no other expert
            c, seed = self.cfg, derive_seed(self.seed, "regularizer-random-rules", rs.name)
            xs = expert_inputs(n, c.alphabet, c.min_len, c.max_len, seed, rs, source_prob=1.0)
            ys = random_rule_outputs(xs, rs, c.alphabet, derive_seed(seed, "rules"))
            return [self._build(xs, [], [rs], self._tokenizer, {**extra, "task_on_mask": 1}, ys=ys)]
        return []

    def compositional_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, EVAL_SPLITS)
        self._build_expert_splits()
        if split not in self._compositional_rows:
            self._compositional_rows[split] = self._build(self._compositional[split], self.rule_sets,
                                                          self.rule_sets, self._tokenizer)
        return self._compositional_rows[split]

    # --- evaluation -------------------------------------------------------------------------------
    def outputs(self, model, xs: Sequence[str], batch_size: int) -> tuple[list[str], list[bool]]:
        """Greedy outputs (letters up to <eos>) and whether each ended with <eos>; for the aligned format
        the argmax at the positions holding `x` (every output counts as ended)."""
        return (aligned_outputs if self.cfg.format == "aligned" else greedy_outputs)(model, self._tokenizer, xs,
                                                                                     batch_size)

    def _exact_match(self, model, xs: Sequence[str], rule_sets: Sequence[RuleSet], batch_size: int) -> float:
        preds, ended = self.outputs(model, xs, batch_size)
        metric = ExactMatch()
        metric.update(preds, [apply_rules(x, rule_sets) for x in xs], ended)
        return float(metric.compute())

    def evaluate_background(self, model, split: str, batch_size: int) -> dict[str, float]:
        check_split(split, EVAL_SPLITS)
        xs = list(self.background_dataset(split)["x"])
        return {"exact_match": self._exact_match(model, xs, [], batch_size)}

    def evaluate_expert(self, model, name: str, split: str, batch_size: int) -> dict[str, float]:
        check_split(split, EVAL_SPLITS)
        self._build_expert_splits()
        i = self.trained.index(name)
        return {"exact_match": self._exact_match(model, self._expert_inputs[split][i], [self._trained_rules[i]],
                                                 batch_size)}

    def evaluate_composition(self, model, dataset: datasets.Dataset, batch_size: int) -> dict[str, float]:
        """Exact match, per-skill accuracy (the letters at each expert's source positions) and failure types."""
        xs, ys = list(dataset["x"]), list(dataset["y"])
        preds, ended = self.outputs(model, xs, batch_size)
        em, failures = ExactMatch(), FailureTypes()
        em.update(preds, ys, ended)
        results = {"exact_match": float(em.compute())}
        # Position-aligned letters as code points ([N, L], -100 past each reference's end).
        width = max((len(y) for y in ys), default=0)
        codes = lambda text: [ord(c) for c in text[:width]] + [-100] * (width - len(text[:width]))  # noqa: E731
        pred_codes, ref_codes = torch.tensor([codes(p) for p in preds]), torch.tensor([codes(y) for y in ys])
        for rs in self.rule_sets:
            skill = SkillAccuracy()
            skill.update(pred_codes, ref_codes, torch.tensor([[c in rs.sources for c in x.ljust(width)] for x in xs]))
            results[f"{rs.name}/skill_accuracy"] = float(skill.compute())
        sources = set().union(*(rs.sources for rs in self.rule_sets))
        failures.update(preds, ys, xs, ended, [{j for j, c in enumerate(x) if c in sources} for x in xs])
        for kind, frac in failures.compute().items():
            results[f"failures/{kind}"] = float(frac)
        return results


    # --- length generalization (docs/method.md, when the rule is exact) ------------------------------------------------------
    def length_inputs(self, length: int, exclude: set[str] | None = None) -> dict:
        """`n_per_length` inputs of exactly `length` letters, none in `exclude` (default: every training input):
        `{"background": plain strings, "experts": {name: that trained expert's own rows, planted with one of its
        source letters at rate source_prob as its test split}, "composition": rows with a source of the experts in
        play, as the compositional split}`. Drawn from seeds of the run's seed, the length and the row kind."""
        c, n = self.cfg, self.cfg.n_per_length
        seen = self._training_inputs() if exclude is None else exclude

        def draw(kind: str, make: Callable[[int], list[str]]) -> list[str]:
            seed = derive_seed(self.seed, "length", length, kind)
            return draw_excluding(lambda attempt: make(derive_seed(seed, attempt)), n, seen, f"length {length} {kind}")

        out: dict = {"background": draw("background", lambda s: sample_strings(n, c.alphabet, length, length, s)),
                     "experts": {}}
        for rs in self._trained_rules:
            out["experts"][rs.name] = draw(f"expert/{rs.name}", lambda s, rs=rs: expert_inputs(
                n, c.alphabet, length, length, s, rs, c.source_prob))
        if self.rule_sets:
            out["composition"] = draw("composition", lambda s: compositional_inputs(
                n, c.alphabet, length, length, s, self.rule_sets, c.compositional_min_experts))
        return out

    def _training_inputs(self) -> set[str]:
        seen = set(self.background_dataset("train")["x"])
        if self.trained:
            seen.update(self.expert_dataset("train")["x"])
        return seen

    def evaluate_lengths(self, background, experts: Mapping[str, object], composed, batch_size: int,
                         progress: Callable[[int], None] | None = None) -> dict[str, dict]:
        """Exact match at every input length of `task.eval_lengths` (greedy decoding, `length_inputs` rows).

        Args:
            background: the background alone (a `ComposedLM` without experts).
            experts: trained expert name -> the background composed with that expert alone, judged on its rows.
            composed: the background composed with every expert in play (or None), judged on compositional rows.
            progress: called with each length before it is decoded.

        Returns:
            `{"<L>": {"trained_length", "n", "background", "experts": {name: ...}, "composition",
            "components_min", "components_product"}}`: the last two are the minimum and the product of the experts'
            accuracies at that length, what the composition inherits if it keeps each component's behaviour
            (docs/method.md, when the rule is exact). `{}` when `task.eval_lengths` is unset.
        """
        if not self.cfg.eval_lengths:
            return {}
        shortest, longest = self.cfg.eval_lengths
        seen, out = self._training_inputs(), {}
        for length in range(shortest, longest + 1):
            if progress is not None:
                progress(length)
            xs = self.length_inputs(length, seen)
            entry: dict = {"trained_length": self.cfg.min_len <= length <= self.cfg.max_len, "n": self.cfg.n_per_length,
                           "background": self._exact_match(background, xs["background"], [], batch_size)}
            if experts:
                entry["experts"] = {name: self._exact_match(model, xs["experts"][name],
                                                            [self._trained_rules[self.trained.index(name)]], batch_size)
                                    for name, model in experts.items()}
            if composed is not None:
                entry["composition"] = self._exact_match(composed, xs["composition"], self.rule_sets, batch_size)
                alone = list(entry.get("experts", {}).values())
                if alone:
                    entry["components_min"], entry["components_product"] = min(alone), math.prod(alone)
            out[str(length)] = entry
        return out


def greedy_outputs(model, tokenizer, xs: Sequence[str], batch_size: int = 250) -> tuple[list[str], list[bool]]:
    """Greedy outputs of `<bos> x <sep>` (letters up to <eos>, at most `len(x) + 2` new tokens per batch's
    longest `x`) and whether each ended with <eos>."""
    return greedy_decode(model, tokenizer, prompt_ids(tokenizer, xs), batch_size,
                         lambda chunk: max(map(len, chunk)))  # prompt = <bos> x <sep>: len(x) + 2


@torch.no_grad()
def aligned_outputs(model, tokenizer, xs: Sequence[str], batch_size: int = 250) -> tuple[list[str], list[bool]]:
    """Position-aligned predictions: the argmax of the composed log-probs at the positions holding
    `x[0] .. x[n-1]` of `<bos> x` (right-padded), decoded with special tokens kept (so a malformed prediction
    never matches a letter string). Every output counts as ended."""
    texts: list[str] = []
    for start in range(0, len(xs), batch_size):
        chunk = list(xs[start:start + batch_size])
        ids, attn = aligned_batch(tokenizer, chunk)
        best = model.score(ids.to(model.device), attn.to(model.device)).argmax(-1).cpu()
        texts += [tokenizer.decode(best[b, 1:1 + len(x)].tolist(), skip_special_tokens=False)
                  for b, x in enumerate(chunk)]
    return texts, [True] * len(texts)
