"""Feature-space composition (docs/method.md, when the rule is exact, feature space): letters with a case, token = (letter, case).

The letter task over a cased alphabet (default a–z and A–Z): the background copies `x`; an expert owns letter
rules as in the letter task, but each rule changes *one feature* of the token: `letter` (`{a: b, A: B}`: a→b in
any case, case kept) or `case` (`{a: A, e: E, ...}`: vowels upper-cased, letter kept). Experts that own
different features may rewrite the same positions: the composed reference applies each feature's owner to its
own coordinate (`a` with both experts above gives `B`).

The token bijection ``D: V → letter × case`` (`feature_map`): each letter token is (its lower-case letter, its
case); each special token (`<pad> <bos> <eos> <sep> <unk>`) is a value of `letter` of its own with case
`lower`, and its `upper` twin is an extra special token (`<PAD> <BOS> <EOS> <SEP> <UNK>`) that no row uses, so
that ``V`` is exactly ``letter × case`` (62 = 31 × 2 for a–z). A factored head (`model.head: factored`) then
makes every model's next-token distribution the product of its letter and case marginals.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import datasets

from data.splits import derive_seed
from data.tasks import register_task
from data.tasks.base import EVAL_SPLITS, Expert, TaskError, check_split
from data.tasks.letters import LettersConfig, LettersTask
from data.tasks.letters.rules import RuleSet, sample_strings
from data.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from losses.features import FeatureMap, FeatureMapError

FEATURES = ("letter", "case")
CASES = ("lower", "upper")


@dataclass
class FeaturesConfig(LettersConfig):
    """Settings of the feature task (`task:` with `name: features`): those of the letter task, over a cased
    alphabet (every letter with its other-case twin, so that (letter, case) is a bijection), generative format."""

    alphabet: str = string.ascii_lowercase + string.ascii_uppercase

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format != "generative":
            raise TaskError(f"task.format={self.format!r}: the features task is generative only")
        try:
            feature_map(build_feature_tokenizer(self.alphabet))
        except FeatureMapError as e:
            raise TaskError(f"task.alphabet={self.alphabet!r}: {e}") from None


def twin(special: str) -> str:
    """The `upper` twin of a special token: `<bos>` -> `<BOS>`."""
    return special.upper()


def build_feature_tokenizer(alphabet: str):
    """The character tokenizer of `alphabet` plus the unused `upper` twins of its special tokens (ids after
    the letters), so that the vocabulary is exactly letter × case."""
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": [twin(s) for s in SPECIAL_TOKENS]})
    return tokenizer


def token_features(token: str) -> tuple[str, str]:
    """(letter, case) of one token: a special token is its own letter (its twin the upper case of it)."""
    if token in SPECIAL_TOKENS:
        return token, "lower"
    if token in {twin(s) for s in SPECIAL_TOKENS}:
        return token.lower(), "upper"
    return token.lower(), "upper" if token != token.lower() else "lower"


def feature_map(tokenizer) -> FeatureMap:
    """The bijection ``D: V → letter × case`` of a feature tokenizer (`FeatureMapError` if it is not one)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    if [i for _, i in vocab] != list(range(len(vocab))):
        raise FeatureMapError("feature map: the tokenizer's ids are not 0 .. V-1")
    features = [token_features(tok) for tok, _ in vocab]
    letters = list(dict.fromkeys(letter for letter, _ in features if letter not in SPECIAL_TOKENS))
    letters += list(SPECIAL_TOKENS)
    return FeatureMap.from_tokens(FEATURES, (letters, CASES),
                                  [(letters.index(letter), CASES.index(case)) for letter, case in features],
                                  tokens=[tok for tok, _ in vocab])


def rule_features(src: str, tgt: str) -> set[str]:
    """The features a rule `src -> tgt` changes."""
    (l_src, c_src), (l_tgt, c_tgt) = token_features(src), token_features(tgt)
    return {f for f, changed in zip(FEATURES, (l_src != l_tgt, c_src != c_tgt), strict=True) if changed}


@register_task("features")
class FeaturesTask(LettersTask):
    """Letters with a case: experts own features (`letter`, `case`) through their `rules`; see the module doc."""

    config_class = FeaturesConfig

    def __init__(self, cfg: FeaturesConfig, experts: Sequence[Expert], **kwargs) -> None:
        allow_overlap, given = kwargs.pop("allow_overlap", False), kwargs.pop("tokenizer", None)
        super().__init__(cfg, experts, allow_overlap=True, **kwargs)  # sources may be shared across features
        self.allow_overlap, self._overlaps = allow_overlap, []
        self._tokenizer = build_feature_tokenizer(cfg.alphabet)
        if given is not None and given.get_vocab() != self._tokenizer.get_vocab():
            raise TaskError("the features task uses its own character tokenizer (task.alphabet, with the special "
                            "tokens' upper twins); the pretrained model's tokenizer differs from it")
        self._feature_map = feature_map(self._tokenizer)
        self._owned = {rs.name: tuple(f for f in FEATURES if f in set().union(*(rule_features(s, t) for s, t in
                                                                                  rs.rules.items())))
                       for rs in self.rule_sets}
        self._check_feature_overlaps()
        self._last_outputs: tuple[list[str], list[str]] | None = None

    def _check_feature_overlaps(self) -> None:
        """Two experts that own the same feature may not share a source letter (unless `allow_overlap`)."""
        for i, a in enumerate(self.rule_sets):
            for b in self.rule_sets[i + 1:]:
                both = set(self._owned[a.name]) & set(self._owned[b.name])
                shared = sorted(a.sources & b.sources)
                if both and shared:
                    msg = (f"experts {a.name!r} and {b.name!r} both own feature {sorted(both)[0]!r} and share "
                           f"source letter {shared[0]!r}")
                    if not self.allow_overlap:
                        raise TaskError(f"experts: {msg} (composition.allow_overlap=true permits it)")
                    self._overlaps.append(msg)

    # --- feature space --------------------------------------------------------------------------
    @property
    def feature_map(self) -> FeatureMap:
        return self._feature_map

    def owned_features(self, name: str) -> tuple[str, ...]:
        return self._owned[name]

    @property
    def notes(self) -> list[str]:
        owners = "; ".join(f"expert {n!r} owns {' and '.join(f)}" for n, f in self._owned.items())
        return [f"features: {owners}", *self._overlaps]

    def standard_experts(self, k: int) -> list[dict]:
        raise TaskError(f"task 'features' has no standard set of {k} experts (ablation_ks): list them in experts")

    def reference(self, x: str) -> str:
        """The composed output: each position's feature taken from the rule of the expert owning that feature."""
        out = []
        for ch in x:
            letter, case = token_features(ch)
            for rs in self.rule_sets:
                if ch in rs.sources:
                    l_tgt, c_tgt = token_features(rs.rules[ch])
                    letter = l_tgt if "letter" in self._owned[rs.name] else letter
                    case = c_tgt if "case" in self._owned[rs.name] else case
            out.append(letter.upper() if case == "upper" else letter)
        return "".join(out)

    # --- rows -------------------------------------------------------------------------------------
    def _compositional_maker(self, n: int, seed: int) -> Callable[[int], list[str]]:
        """Inputs that need every expert at one position (a letter all of them rewrite), when there is one."""
        shared = set.intersection(*(set(rs.sources) for rs in self.rule_sets)) if self.rule_sets else set()
        if not shared or self.cfg.compositional_min_experts is not None:
            return super()._compositional_maker(n, seed)
        c = self.cfg
        return lambda attempt: sample_strings(n, c.alphabet, c.min_len, c.max_len, derive_seed(seed, attempt),
                                              must_contain=[sorted(shared)])

    def compositional_dataset(self, split: str) -> datasets.Dataset:
        check_split(split, EVAL_SPLITS)
        self._build_expert_splits()
        if split not in self._compositional_rows:
            xs = self._compositional[split]
            self._compositional_rows[split] = self._build(xs, [], self.rule_sets, self._tokenizer,
                                                          ys=[self.reference(x) for x in xs])
        return self._compositional_rows[split]

    def _regularizer_rows(self, i: int, rs: RuleSet, n: int) -> list[datasets.Dataset]:
        """As the letter task's, except composed prefixes: their targets on the expert's mask hold the other
        features' edits too, so they are regularizer rows only (`task_on_mask=0`)."""
        if self.reg_data != "composition":
            return super()._regularizer_rows(i, rs, n)
        xs = self._compositional_maker(n, derive_seed(self.seed, "regularizer-composition", rs.name))(0)
        return [self._build(xs, [], [rs], self._tokenizer, {"expert_index": i, "is_task": 0, "task_on_mask": 0},
                            ys=[self.reference(x) for x in xs])]

    # --- evaluation -------------------------------------------------------------------------------
    def outputs(self, model, xs: Sequence[str], batch_size: int) -> tuple[list[str], list[bool]]:
        preds, ended = super().outputs(model, xs, batch_size)
        self._last_outputs = (list(xs), preds)
        return preds, ended

    def evaluate_composition(self, model, dataset: datasets.Dataset, batch_size: int) -> dict[str, float]:
        """The letter task's metrics, plus per feature the fraction of outputs right on that feature alone
        (`features/<feature>/exact_match`: the output's letters, or its cases, all equal the reference's)."""
        results = super().evaluate_composition(model, dataset, batch_size)
        _, preds = self._last_outputs
        for j, feature in enumerate(FEATURES):
            right = [[token_features(ch)[j] for ch in p] == [token_features(ch)[j] for ch in y]
                     for p, y in zip(preds, dataset["y"], strict=True)]
            results[f"features/{feature}/exact_match"] = sum(right) / max(len(right), 1)
        return results

    def composition_metrics(self, model, dataset: datasets.Dataset, batch_size: int,
                            active_threshold: float = 0.01) -> dict[str, float]:
        from compose.features import feature_metrics

        results = super().composition_metrics(model, dataset, batch_size, active_threshold)
        owned = {n: self._owned[n] for n in model.names}
        return results | feature_metrics(model, dataset, self.collator(), self._feature_map, owned, batch_size)
