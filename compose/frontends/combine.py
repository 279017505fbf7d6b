"""Compose exports made by separate runs: check they fit together, evaluate them composed, write one export.

Experts trained one per run, each in its own process (`python train.py experts=[...] background.path=RUN0/background
output_dir=RUN_i`), leave one export each (`RUN_i/export/`). `combine_exports` (CLI: `python -m compose.combine
EXPORT [EXPORT ...] [--out DIR]`) takes several such exports and

1. checks that they fit together: each verifies as `ComposedLM.from_manifest` would (manifest keys, every
   checksum, no pickle or unlisted weight file); all share one background (the sha256 of its safetensors files)
   and one tokenizer (vocabulary and special tokens); expert names are unique across the exports; the task
   settings agree (below); the masks are disjoint: the task is rebuilt with every expert, so its own check
   applies, the one `train.py` makes for the experts of one run (letters: no source letter shared by two
   experts; intervals: no delimiter shared; text: no position of a compositional row in two intervals);
2. evaluates the composition of all their experts (in the order given) on the task's compositional test split
   with `Task.composition_metrics` (exact match, per-skill accuracy, failure types, teacher-forced NLL,
   off-/on-mask KL, ...);
3. with `out`, writes the combined export atomically: one manifest with every expert (its weight and spec as
   its export had them), the adapter folders copied, the tokenizer copied, the background copied (or
   referenced, `background="ref"`; a background the first export references stays referenced), `metrics.json`
   and a model card (`README.md`, outside the checksums) beside them, and under the manifest's `extra`:
   `task_settings`, `seed`, `combined_from`. A combined export is itself an input of `combine_exports` (an expert
   trained later joins it).

Task settings. Each export's `extra.task_settings` (the `task:` node of the run; `ExportForComposition`
records it), or, for exports written before that was recorded, the `task` node of the run's `config.yaml`
beside the export (`RUN/config.yaml` for `RUN/export`). They must agree on every key but
`TRAINING_ONLY_SETTINGS` (those shape training rows only; the first export's value is kept). The test split is
drawn with the runs' seed; when the runs used different seeds, with the first export's (or `seed=`), and a note
says so. The split is rebuilt with no expert in training (`trained=[]`), so it is not drawn disjoint from the
separate runs' training inputs (their draws depend on each run's seed and experts): for letters at lengths
8–16 a collision has probability ~1e-4 per split.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from compose.atomic import atomic_save, atomic_write_text
from compose.composed_lm import COMPOSITIONS, ComposedLM
from compose.export import (
    MANIFEST_NAME,
    WEIGHT_SUFFIX,
    load_manifest,
    resolve_ref,
    verify_export,
    write_manifest,
)
from compose.merges import MERGE_METHODS, merged_adapter
from compose.model_card import write_model_card
from compose.model_io import load_tokenizer
from compose.quiet import ignore_loading_noise
from compose.vocab import tokenizer_signature
from data.tasks import Expert, Task, TaskError, settings_from_node
from lightning_modules.pipeline.build import new_task
from lightning_modules.pipeline.report import add_intervals

# Task settings that only shape training rows (rows per expert, how often a source is planted, how many foreign
# spans a regularizer row holds and what their words are drawn from or rewritten by, whether a trained background also saw spanned
# rows) or the run's own length sweep (`eval_lengths`, `n_per_length`): exports whose runs differ in them still
# share one compositional test set.
TRAINING_ONLY_SETTINGS = ("n_train", "source_prob", "foreign_spans", "foreign_words", "foreign_rewrites",
                          "foreign_pool", "foreign_exclude", "background_spans", "eval_lengths", "n_per_length")
# Text-task settings that shape only the held-out evaluation of a run (its compositional rows, how many held-out
# rows it decodes): an expert trained later brings compositional rows that need its skill. The first export's are
# kept (change them with `test_settings`).
EVALUATION_ONLY_SETTINGS = ("compositional", "eval_limit", "cross_eval")
BACKGROUND_MODES = ("copy", "ref")
METRICS_NAME = "metrics.json"


class CombineError(ValueError):
    """Exports that cannot be combined: one line naming the export(s) and what is wrong."""


@dataclass(frozen=True)
class SourceExport:
    """One export to combine: its folder, checked manifest, and the task settings and seed its run used."""

    root: Path
    manifest: dict
    settings: dict          # the run's `task:` node, defaults filled in ({"name": ..., **settings})
    seed: int | None

    @property
    def names(self) -> list[str]:
        return [e["name"] for e in self.manifest["experts"]]

    @property
    def background_dir(self) -> Path:
        bg = self.manifest["background"]
        return self.root / bg["path"] if "path" in bg else resolve_ref(self.root, bg["ref"])

    @property
    def background_checksums(self) -> dict[str, str]:
        """sha256 of the background's safetensors files, by path inside the background folder."""
        bg = self.manifest["background"]
        if "ref" in bg:
            listed, prefix = bg["checksums"], ""
        else:
            listed, prefix = self.manifest["checksums"], bg["path"].rstrip("/") + "/"
        return {k[len(prefix):]: v for k, v in listed.items() if k.startswith(prefix) and k.endswith(WEIGHT_SUFFIX)}


@dataclass
class Combination:
    """Exports checked to fit together, and the task rebuilt with all their experts (in composition order)."""

    sources: list[SourceExport]
    task: Task
    settings: dict
    seed: int
    notes: list[str] = field(default_factory=list)

    @property
    def entries(self) -> list[tuple[SourceExport, dict]]:
        """Every expert's manifest entry with the export it comes from."""
        return [(s, e) for s in self.sources for e in s.manifest["experts"]]

    @property
    def names(self) -> list[str]:
        return [e["name"] for _, e in self.entries]


# ---------------------------------------------------------------------------------------------- checks


def check_exports(paths: Sequence[str | os.PathLike], seed: int | None = None,
                  allow_overlap: bool = False, test_settings: Mapping[str, Any] | None = None) -> Combination:
    """Check that the exports at `paths` compose, and rebuild their task with every expert.

    Args:
        paths: export folders (each holding `composition.yaml`), in composition order.
        seed: the seed of the compositional test split (default: the runs' seed, the first export's if they
            differ).
        allow_overlap: accept experts whose masks may overlap, where the task can (noted), as
            `composition.allow_overlap` does in `train.py`.
        test_settings: task settings to change for the test split only (noted; the combined export records the
            runs' own), e.g. `{"min_len": 9}` when nine letter experts must fit in every input of runs made with
            `min_len: 8`.

    Raises:
        CombineError: one line naming the export(s): missing or corrupt, another background or tokenizer, an
            expert name used twice, task settings that differ, overlapping masks.
    """
    if not paths:
        raise CombineError("give at least one export folder")
    sources = [_read_source(Path(p)) for p in paths]
    _check_backgrounds(sources)
    tokenizer = _check_tokenizers(sources)
    _check_names(sources)
    settings, notes = _common_settings(sources)
    seed, seed_note = _choose_seed(sources, seed)
    notes += seed_note
    experts = [Expert(e["name"], dict(e["spec"]), float(e["weight"])) for s in sources for e in s.manifest["experts"]]
    unknown = sorted(set(test_settings or {}) - set(settings) - {"name"})
    if unknown or "name" in (test_settings or {}):
        raise CombineError(f"test settings {unknown or ['name']} are not settings of the {settings['name']} task "
                           f"({', '.join(k for k in settings if k != 'name')})")
    for key, value in (test_settings or {}).items():
        notes.append(f"test split with task.{key}={value!r} (the runs': {settings[key]!r})")
    try:
        task = new_task(settings["name"], settings_from_node({**settings, **(test_settings or {})}), experts,
                        trained=[], seed=seed, tokenizer=tokenizer, allow_overlap=allow_overlap)
    except TaskError as e:
        raise CombineError(f"{e}{_provenance(str(e), sources)}") from None
    return Combination(sources, task, settings, seed, notes + list(task.notes))


def _read_source(root: Path) -> SourceExport:
    if root.name == MANIFEST_NAME and root.is_file():
        root = root.parent
    if not root.exists():
        raise CombineError(f"{root}: no such export folder")
    try:
        manifest = load_manifest(root)
        verify_export(root, manifest)
    except (OSError, ValueError) as e:
        raise CombineError(f"{root}: not a valid export: {e}") from None
    if not manifest["experts"]:
        raise CombineError(f"{root}: the export has no experts")
    extra = manifest["extra"]
    if isinstance(extra.get("task_settings"), Mapping):
        node, seed, where = dict(extra["task_settings"]), extra.get("seed"), root / MANIFEST_NAME
    else:  # an export written before `task_settings` was recorded: its run's config.yaml
        config = root.resolve().parent / "config.yaml"
        if not config.is_file():
            raise CombineError(f"{root}: cannot tell the task settings its experts were trained with: its manifest "
                               f"has no extra.task_settings and there is no config.yaml of its run at {config}")
        try:
            run = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise CombineError(f"{config}: cannot read it: {str(e).splitlines()[0]}") from None
        if not isinstance(run, dict) or not isinstance(run.get("task"), dict):
            raise CombineError(f"{config}: no `task:` node (the task settings of {root})")
        node, seed, where = dict(run["task"]), run.get("seed", extra.get("seed")), config
    try:
        settings = _full_settings(node)
    except TaskError as e:
        raise CombineError(f"{where}: {e}") from None
    return SourceExport(root, manifest, settings, seed if isinstance(seed, int) else None)


def _full_settings(node: Mapping[str, Any]) -> dict:
    """A `task:` node with every default filled in (so an older run's node compares with a newer one's)."""
    if "name" not in node:
        raise TaskError("task.name is missing")
    return {"name": node["name"], **dataclasses.asdict(settings_from_node(node))}


def _check_backgrounds(sources: list[SourceExport]) -> None:
    first, ours = sources[0], sources[0].background_checksums
    for other in sources[1:]:
        theirs = other.background_checksums
        if theirs != ours:
            diff = sorted(set(ours) ^ set(theirs)) or sorted(k for k in ours if ours[k] != theirs[k])
            raise CombineError(f"{first.root} and {other.root} have different backgrounds ({diff[0]} differs by "
                               "sha256): experts only compose on the background they were trained on")


def _check_tokenizers(sources: list[SourceExport]):
    tokenizers = []
    for s in sources:
        try:
            tokenizers.append(load_tokenizer(s.root / s.manifest["tokenizer"]))
        except (OSError, ValueError) as e:
            raise CombineError(f"{s.root}: cannot read its tokenizer: {str(e).splitlines()[0]}") from None
    ours = tokenizer_signature(tokenizers[0])
    for s, tok in zip(sources[1:], tokenizers[1:], strict=True):
        if tokenizer_signature(tok) != ours:
            raise CombineError(f"{sources[0].root} and {s.root} have different tokenizers (vocabulary or special "
                               "tokens)")
    return tokenizers[0]


def _check_names(sources: list[SourceExport]) -> None:
    owner: dict[str, Path] = {}
    for s in sources:
        for name in s.names:
            if name in owner:
                raise CombineError(f"expert name {name!r} is in both {owner[name]} and {s.root}: expert names must "
                                   "be unique across the exports")
            owner[name] = s.root


def _common_settings(sources: list[SourceExport]) -> tuple[dict, list[str]]:
    """The first export's task settings, once every other export's agree with them (`TRAINING_ONLY_SETTINGS` and
    `EVALUATION_ONLY_SETTINGS` may differ: noted)."""
    first, notes = sources[0], []
    for other in sources[1:]:
        if other.settings["name"] != first.settings["name"]:
            raise CombineError(f"task settings differ: task.name is {first.settings['name']!r} in {first.root} but "
                               f"{other.settings['name']!r} in {other.root}")
        for key in first.settings:
            ours, theirs = first.settings[key], other.settings.get(key)
            if ours == theirs:
                continue
            if key in TRAINING_ONLY_SETTINGS:
                notes.append(f"task.{key} differs ({ours!r} in {first.root}, {theirs!r} in {other.root}): it shapes "
                             "training rows only")
                continue
            if key in EVALUATION_ONLY_SETTINGS:
                notes.append(f"task.{key} differs ({ours!r} in {first.root}, {theirs!r} in {other.root}): it shapes "
                             f"a run's evaluation only; the first export's is used")
                continue
            raise CombineError(f"task settings differ: task.{key} is {ours!r} in {first.root} but {theirs!r} in "
                               f"{other.root}, so the compositional test set is not the same for both")
    return dict(first.settings), notes


def _choose_seed(sources: list[SourceExport], seed: int | None) -> tuple[int, list[str]]:
    seeds = [s.seed for s in sources]
    if seed is not None:
        return seed, [] if set(seeds) == {seed} else [f"test split drawn with seed={seed} (the runs': {seeds})"]
    known = [s for s in seeds if s is not None]
    if not known:
        return 0, ["no export records its run's seed: test split drawn with seed=0"]
    if len(set(seeds)) > 1:
        return known[0], [f"the runs used seeds {seeds}: test split drawn with the first export's, {known[0]}"]
    return known[0], []


def _provenance(message: str, sources: list[SourceExport]) -> str:
    """` (name: export, ...)` for the expert names quoted in `message`."""
    named = [f"{n}: {s.root}" for s in sources for n in s.names if f"'{n}'" in message]
    return f" ({'; '.join(named)})" if named else ""


# ---------------------------------------------------------------------------------------------- the export


def assemble(combination: Combination, folder: Path, background: str = "copy", extra: Mapping | None = None) -> dict:
    """Write the combined export into the new folder `folder` (not atomically: `combine_exports` is); return its
    manifest. `background`: `copy` the first export's background folder, or `ref` reference it (absolute path);
    a background the first export references stays referenced."""
    if background not in BACKGROUND_MODES:
        raise ValueError(f"background must be one of {BACKGROUND_MODES}, got {background!r}")
    first = combination.sources[0]
    folder.mkdir()
    shutil.copytree(first.root / first.manifest["tokenizer"], folder / "tokenizer")
    if background == "copy" and "path" in first.manifest["background"]:
        shutil.copytree(first.background_dir, folder / "background")
        background_entry: dict[str, Any] = {"path": "background"}
    else:
        background_entry = {"ref": str(first.background_dir.resolve()), "checksums": first.background_checksums}
    experts = []
    for source, entry in combination.entries:
        shutil.copytree(source.root / entry["path"], folder / "experts" / entry["name"])
        experts.append({**entry, "path": f"experts/{entry['name']}"})
    provenance = {
        "task": combination.settings["name"],
        "seed": combination.seed,
        "task_settings": combination.settings,
        "combined_from": [{"export": str(s.root.resolve()), "experts": s.names, "seed": s.seed}
                          for s in combination.sources],
    }
    return write_manifest(folder, background_entry, experts, {**provenance, **(extra or {})})


def load_composed(folder: Path, *, composition: str = "soft", device: str | torch.device | None = None,
                  min_logprob: float = -1e4) -> ComposedLM:
    """`ComposedLM.from_manifest` of a combined export: one PeftModel when every expert is LoRA, else separate;
    `min_logprob`: the floor on every component's log-probs (`compose.operator.compose_logprobs`)."""
    kinds = {e["kind"] for e in load_manifest(folder)["experts"]}
    backend = "adapters" if kinds == {"lora"} else "separate"
    # gated: an expert runs only while its interval is open (ignored when soft)
    return ComposedLM.from_manifest(folder, backend=backend, device=device, composition=composition, lazy=True,
                                    min_logprob=min_logprob)


def _test_rows(combination: Combination, limit: int | None):
    """The first `limit` rows (all: None) of the combination's compositional test split."""
    dataset = combination.task.compositional_dataset("test")
    return dataset if limit is None or limit >= len(dataset) else dataset.select(range(limit))


def evaluate(combination: Combination, composed: ComposedLM, *, limit: int | None = None, batch_size: int = 250,
             active_threshold: float = 0.01, scored: bool = True) -> dict[str, float]:
    """`Task.composition_metrics` of `composed` on the first `limit` rows of the compositional test split;
    `scored=False`: its decoding metrics only (`Task.evaluate_composition` without the teacher-forced passes, which
    on long prompts cost several times the decoding)."""
    if composed.names != combination.names:
        raise ValueError(f"the composed model's experts {composed.names} are not the combination's {combination.names}")
    dataset = _test_rows(combination, limit)
    if not scored:
        return {"n_test": len(dataset), **combination.task.evaluate_composition(_DecodingOnly(composed), dataset,
                                                                                 batch_size)}
    metrics = combination.task.composition_metrics(composed, dataset, batch_size, active_threshold)
    return {"n_test": len(dataset), **metrics}


# Methods `compare` can decode beside the composition (`combine_exports(..., compare=...)`, `--compare`).
COMPARE_METHODS = ("soft", "gated", "alone", "background", *MERGE_METHODS)
SCORED_METHODS = ("soft", "gated", "background")  # teacher-forced metrics too (the others: decoded only)


def compare(combination: Combination, composed: ComposedLM, methods: Sequence[str], *, limit: int | None = None,
            batch_size: int = 250, scored: Sequence[str] = SCORED_METHODS) -> dict[str, dict[str, float]]:
    """Other ways to use the same experts, each on the same compositional test rows (`Task.evaluate_composition`:
    exact match, per-skill accuracy, off-interval KL, general perplexity):

    `soft` / `gated`: the composition, every expert everywhere / each only inside its interval (lazy: an expert
    runs once its interval opens); `alone`: each expert by itself (`alone/<name>`), the denominator of "the
    composition keeps each skill"; `background`: no expert; `task_arithmetic`, `ties`, `dare`: the LoRA adapters
    merged in parameter space (peft's `add_weighted_adapter`, `compose.merges`; the merge is dropped afterwards).
    `composed` must be the combination's, loaded with the adapters backend for the merges. The teacher-forced
    metrics (off-interval KL, general perplexity: a forward of every component over every held-out general row)
    are computed for the methods in `scored` only; the others are decoded only."""
    unknown = [m for m in methods if m not in COMPARE_METHODS]
    if unknown:
        raise CombineError(f"compare: unknown method(s) {', '.join(unknown)}; known: {', '.join(COMPARE_METHODS)}")
    if composed.backend != "adapters" and any(m in MERGE_METHODS for m in methods):
        raise CombineError("compare: merges need every expert to be a LoRA adapter (one PeftModel)")
    task, tok = combination.task, composed.tokenizer
    dataset = _test_rows(combination, limit)

    def of_adapters(names: list[str], **kwargs) -> ComposedLM:
        if composed.backend == "adapters":
            return ComposedLM.from_peft(composed.model, names, tokenizer=tok, **kwargs)
        picked = [composed.experts[composed.names.index(n)] for n in names]
        return ComposedLM(composed.background, picked, names=names, tokenizer=tok, **kwargs)

    def one_model(names: list[str], weights: list[float], method: str) -> ComposedLM:
        """The background with one expert (or a merge) at weight 1 is that expert: decoded alone, as one model
        (one row per input instead of two); scored, as the composition, whose teacher-forced metrics these are."""
        if method in scored or weights != [1.0]:
            return of_adapters(names, weights=weights)
        if composed.backend == "adapters":
            composed.model.set_adapter(names[0])  # the PeftModel with only this adapter active
            return ComposedLM(composed.model, [], tokenizer=tok)
        return ComposedLM(composed.experts[composed.names.index(names[0])], [], tokenizer=tok)

    def evaluate(model: ComposedLM, method: str) -> dict[str, float]:
        return task.evaluate_composition(model if method in scored else _DecodingOnly(model), dataset, batch_size)

    def run(method: str) -> None:
        print(f"[combine] compare: {method} on {len(dataset)} compositional test rows", flush=True)
        if method in ("soft", "gated"):
            results[method] = evaluate(of_adapters(composed.names, weights=composed.weights, specs=composed.specs,
                                                   composition=method, lazy=method == "gated"), method)
        elif method == "alone":
            for name, weight in zip(composed.names, composed.weights, strict=True):
                results[f"alone/{name}"] = evaluate(one_model([name], [weight], method), method)
        elif method == "background":
            results[method] = evaluate(of_adapters([]), method)
        else:
            with merged_adapter(composed.model, composed.names, method, weights=composed.weights,
                                seed=combination.seed) as merged:
                results[method] = evaluate(one_model([merged], [1.0], method), method)

    results: dict[str, dict[str, float]] = {}
    active = composed.model.active_adapter if composed.backend == "adapters" else None
    try:
        for method in methods:
            run(method)
    finally:  # one_model switches the PeftModel's active adapter
        if active is not None:
            composed.model.set_adapter(active)
    return {name: add_intervals({"exact_match_n": len(dataset), **entry}) for name, entry in results.items()}


class _DecodingOnly:
    """A model's greedy decoding without its teacher-forced scores (`Task.evaluate_composition` then skips them)."""

    def __init__(self, model: ComposedLM) -> None:
        self.generate, self.device, self.names = model.generate, model.device, model.names


# ---------------------------------------------------------------------------------------------- the command


def combine_exports(paths: Sequence[str | os.PathLike], out: str | os.PathLike | None = None, *,
                    composition: str = "soft", limit: int | None = None, batch_size: int = 250,
                    seed: int | None = None, background: str = "copy", overwrite: bool = False,
                    device: str | torch.device | None = None, active_threshold: float = 0.01,
                    allow_overlap: bool = False, test_settings: Mapping[str, Any] | None = None,
                    compare_with: Sequence[str] = (), decode_only: bool = False, min_logprob: float = -1e4) -> dict:
    """Check the exports compose (`check_exports`), evaluate their composition on the task's compositional test
    split, and with `out` write the combined export (atomically, evaluated from its own files before it is moved
    into place; `metrics.json` inside). Without `out`, the composition is loaded from a scratch export that
    references the first export's background. `compare_with`: other methods decoded on the same rows (`compare`),
    under `"compare"`. `decode_only`: no teacher-forced metrics at all (exact match and skill accuracy only).
    `min_logprob`: the floor on the components' log-probs of the composition evaluated (`compose_logprobs`).

    Returns:
        `{"exports", "experts", "k", "task", "seed", "composition", "n_test", "metrics", "notes", "out"}` (and
        `"compare"`).

    Raises:
        CombineError: the exports do not fit together (see `check_exports`), or `out` exists (without
            `overwrite`).
    """
    if composition not in COMPOSITIONS:
        raise CombineError(f"composition={composition!r} is not one of {', '.join(COMPOSITIONS)}")
    for key, value in (("limit", limit), ("batch_size", batch_size)):
        if value is not None and value < 1:
            raise CombineError(f"{key}={value}: must be an integer >= 1")
    if not min_logprob < 0:
        raise CombineError(f"min_logprob={min_logprob}: must be a negative log-probability")
    if background not in BACKGROUND_MODES:
        raise CombineError(f"background={background!r} is not one of {', '.join(BACKGROUND_MODES)}")
    if out is not None and Path(out).exists() and not overwrite:
        raise CombineError(f"{out} exists; choose another folder for the combined export (or overwrite it)")
    combination = check_exports(paths, seed, allow_overlap, test_settings)
    result: dict[str, Any] = {
        "exports": [str(s.root) for s in combination.sources], "experts": combination.names,
        "k": len(combination.names), "task": combination.settings["name"], "seed": combination.seed,
        "composition": composition, "min_logprob": min_logprob,
    }

    def run(folder: Path) -> None:
        composed = load_composed(folder, composition=composition, device=device, min_logprob=min_logprob)
        result["decoding_paths"] = dataclasses.asdict(composed.paths)  # the exact shortcuts it takes (ComposedLM.paths)
        print(f"[combine] {', '.join(combination.names)}: {composition} composition on the compositional test rows "
              f"({composed.paths.describe()})", flush=True)
        metrics = evaluate(combination, composed, limit=limit, batch_size=batch_size,
                           active_threshold=active_threshold, scored=not decode_only)
        result.update(n_test=metrics.pop("n_test"), metrics=metrics, notes=combination.notes)
        if compare_with:
            result["compare"] = compare(combination, composed, compare_with, limit=limit, batch_size=batch_size,
                                        scored=() if decode_only else SCORED_METHODS)

    if out is None:
        with tempfile.TemporaryDirectory(prefix="combine-") as scratch:
            folder = Path(scratch) / "export"
            assemble(combination, folder, background="ref")  # adapters copied, the background referenced
            run(folder)
        result["out"] = None
        return result

    def write(tmp: Path) -> None:
        manifest = assemble(combination, tmp, background)
        run(tmp)
        (tmp / METRICS_NAME).write_text(json.dumps({**result, "out": str(out)}, indent=2) + "\n")
        extra = {**manifest["extra"], "decoding_paths": result["decoding_paths"]}
        write_manifest(tmp, manifest["background"], manifest["experts"], extra)  # lists metrics.json
        write_model_card(tmp, metrics={"composition": result["metrics"]}, title=Path(out).name)

    atomic_save(write, Path(out), overwrite)
    result["out"] = str(out)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compose.combine",
                                description="Compose exports made by separate runs on one background: check they fit "
                                            "together, evaluate the composition on the task's compositional test "
                                            "set, optionally write the combined export.")
    p.add_argument("exports", nargs="+", help="export folders (composition.yaml), in composition order")
    p.add_argument("--out", default=None, help="write the combined export to this new folder")
    p.add_argument("--composition", choices=COMPOSITIONS, default="soft")
    p.add_argument("--limit", type=int, default=None, help="the first N compositional test rows only")
    p.add_argument("--batch_size", type=int, default=250, help="rows per decoding batch")
    p.add_argument("--seed", type=int, default=None, help="seed of the test split (default: the runs')")
    p.add_argument("--background", choices=BACKGROUND_MODES, default="copy",
                   help="with --out: copy the background into it, or reference the first export's")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (once the new one is complete)")
    p.add_argument("--metrics", default=None, help="also write the metrics JSON here")
    p.add_argument("--allow_overlap", action="store_true",
                   help="accept experts whose masks may overlap (noted), as composition.allow_overlap in train.py")
    p.add_argument("--test_setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a task setting changed for the test split only (YAML value; repeatable), e.g. min_len=9")
    p.add_argument("--compare", nargs="+", default=[], choices=COMPARE_METHODS, metavar="METHOD",
                   help=f"also decode the same rows with: {', '.join(COMPARE_METHODS)} (alone: each expert by itself; "
                        "the merges need LoRA experts)")
    p.add_argument("--decode_only", action="store_true",
                   help="decoding metrics only (exact match, skill accuracy): no teacher-forced pass, which on long "
                        "prompts costs several times the decoding")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--min_logprob", type=float, default=-1e4,
                   help="floor on every component's log-probs before the rule (default -1e4: none in practice); "
                        "the composition under test only, not --compare's methods")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 2 with one line on exports that cannot be combined."""
    args = _parser().parse_args(argv)
    ignore_loading_noise()  # a "Loading weights" bar for every small load, peft's FutureWarning (compose.quiet)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        test_settings = {}
        for item in args.test_setting:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise CombineError(f"--test_setting {item!r}: expected KEY=VALUE")
            test_settings[key] = yaml.safe_load(value)
        result = combine_exports(args.exports, args.out, composition=args.composition, limit=args.limit,
                                 batch_size=args.batch_size, seed=args.seed, background=args.background,
                                 overwrite=args.overwrite, device=device, allow_overlap=args.allow_overlap,
                                 test_settings=test_settings, compare_with=args.compare,
                                 decode_only=args.decode_only, min_logprob=args.min_logprob)
    except (CombineError, FileExistsError) as err:
        print(f"compose.combine: error: {' '.join(str(err).split())}", file=sys.stderr)  # one line
        return 2
    if args.metrics:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.metrics, json.dumps(result, indent=2) + "\n")
    m = result["metrics"]
    print(f"composed {result['k']} experts ({', '.join(result['experts'])}) from {len(result['exports'])} exports: "
          f"exact_match={m['exact_match']:.4f} on {result['n_test']} compositional test rows ({result['composition']})")
    for name, entry in result.get("compare", {}).items():
        ci = entry.get("exact_match_ci95")
        print(f"  {name}: exact_match={entry['exact_match']:.4f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
    for note in result["notes"]:
        print(f"note: {note}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
