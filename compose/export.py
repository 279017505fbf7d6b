"""Export a composition to a folder with a ``composition.yaml`` manifest, and load it back.

Layout of an export folder::

    composition.yaml          the manifest (below)
    background/               HF ``save_pretrained`` (safetensors), unless the manifest references one
    tokenizer/                the shared tokenizer (``save_pretrained``)
    experts/<name>/           a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
                              or a full HF model folder

Manifest (YAML)::

    format_version: 1
    background: {path: background}        # or {ref: /some/hf/model/folder, checksums: {file: sha256}}
    tokenizer: tokenizer
    experts:
      - {name: a2b, kind: lora, path: experts/a2b, weight: 1.0, spec: {rules: {A: B}}}
    checksums: {background/model.safetensors: <sha256>, ...}   # every file of the export but the manifest
    extra: {}

A relative ``ref`` is resolved against the export folder. Exports are written atomically (built in a
hidden sibling folder, then renamed into place); loading verifies every checksum before reading any
weights, reads only safetensors, and never runs remote code.

Every path of the manifest must stay inside the export folder (no absolute path, no ``..``), except
``background.ref``: pointing at a background stored elsewhere (a shared pretrained model, the training run's
own folder) is what a reference is for, so it may be absolute or leave the folder. It is not trusted for
that: every safetensors file in the referenced folder must match the manifest's ``checksums`` and no
unlisted one may be there (`verify_export`), and only safetensors are read from it.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from compose.atomic import atomic_save
from compose.model_io import load_tokenizer, pretrained_causal_lm, sha256_file
from compose.quiet import quiet_loading
from compose.vocab import check_vocab

FORMAT_VERSION = 1
MANIFEST_NAME = "composition.yaml"
EXPERT_KINDS = ("lora", "model")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
WEIGHT_SUFFIX = ".safetensors"
EXPERT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # expert names become folder and adapter names
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TOP_KEYS = ("format_version", "background", "tokenizer", "experts", "checksums", "extra")
_EXPERT_KEYS = ("name", "kind", "path", "weight", "spec")


# ---------------------------------------------------------------------- export


@quiet_loading()
def export_composition(
    path: str | os.PathLike,
    *,
    tokenizer,
    background=None,
    background_ref: str | None = None,
    peft_model=None,
    adapter_names: Sequence[str] = (),
    expert_models: Mapping[str, Any] | None = None,
    weights: Mapping[str, float] | None = None,
    specs: Mapping[str, dict] | None = None,
    extra: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a composition (background, experts, tokenizer, manifest) to the folder ``path``.

    Args:
        path: the export folder to create. An existing one is refused unless ``overwrite=True``, in
            which case it is replaced only once the new export is complete.
        tokenizer: the shared tokenizer (saved to ``tokenizer/``).
        background: the background model, saved to ``background/``. If neither it nor
            ``background_ref`` is given, the base model of ``peft_model`` (adapters removed) is saved.
        background_ref: instead of saving the background, reference an existing HF model folder (stored
            as given; a relative path is relative to the export folder). Its safetensors are checksummed.
        peft_model: a PeftModel whose adapters ``adapter_names`` are exported as LoRA experts.
        adapter_names: the adapters to export (default: every adapter of ``peft_model``).
        expert_models: full HF models exported as ``kind: model`` experts, by name.
        weights: composition weight by expert name (default 1.0).
        specs: free-form dict by expert name (mask rules, interval specs, ...), e.g. ``{rules: {A: B}}``.
        extra: free-form dict stored under ``extra``.
        overwrite: replace an existing ``path``.

    Returns:
        The export folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False (nothing is written).
        ValueError: inconsistent arguments (names, weights, specs, vocabulary, LoRA layers in the
            background, ...), detected before anything is written.
    """
    path = Path(path)
    lora_names = _lora_names(peft_model, adapter_names)
    expert_models = dict(expert_models or {})
    weights, specs = dict(weights or {}), dict(specs or {})
    extra = {} if extra is None else extra
    _check_expert_settings(lora_names + [str(n) for n in expert_models], weights, specs, extra)
    ref_checksums = _check_background(path, tokenizer, background, background_ref, peft_model)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    contents = _ExportContents(tokenizer, background, background_ref, ref_checksums, peft_model, lora_names,
                               expert_models, weights, specs, extra)
    atomic_save(contents.write, path, overwrite)
    return path


def _lora_names(peft_model, adapter_names: Sequence[str]) -> list[str]:
    """The adapters to export: ``adapter_names``, or every adapter of ``peft_model``."""
    if peft_model is None and adapter_names:
        raise ValueError("adapter_names given without peft_model")
    lora_names = [str(n) for n in (adapter_names or (list(peft_model.peft_config) if peft_model is not None else []))]
    for name in lora_names:
        if name not in peft_model.peft_config:
            raise ValueError(f"adapter {name!r} is not in peft_model (it holds {sorted(peft_model.peft_config)})")
    return lora_names


def _check_expert_settings(names: list[str], weights: Mapping, specs: Mapping, extra: Any) -> None:
    """Expert names, and the weights, specs and extra stored with them, before anything is written."""
    _check_names(names, "export_composition")
    for what, mapping in (("weights", weights), ("specs", specs)):
        unknown = sorted(set(mapping) - set(names))
        if unknown:
            raise ValueError(f"{what} names unknown experts {unknown}; experts are {names}")
    for name, spec in specs.items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"specs[{name!r}] must be a dict, got {type(spec).__name__}")
    if not isinstance(extra, Mapping):
        raise ValueError(f"extra must be a dict, got {type(extra).__name__}")
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"weights[{name!r}] must be a number, got {w!r}")
    try:
        yaml.safe_dump({"specs": _plain(specs), "extra": _plain(extra)})
    except yaml.YAMLError as err:
        raise ValueError(f"specs/extra must be plain YAML data (dicts, lists, str, numbers): {err}") from err


def _check_background(path: Path, tokenizer, background, background_ref: str | None, peft_model) -> dict[str, str]:
    """Check the background given to `export_composition` (exactly one source, no adapter layers, a vocabulary
    that holds the tokenizer's); return a reference's weight checksums (``{}`` without one)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if background is not None and background_ref is not None:
        raise ValueError("pass either background or background_ref, not both")
    if background is None and background_ref is None and peft_model is None:
        raise ValueError("no background: pass background, background_ref or peft_model")
    if background is not None and any(isinstance(m, BaseTunerLayer) for m in background.modules()):
        raise ValueError(
            "background contains PEFT adapter layers; pass the PeftModel as peft_model and leave background "
            "unset (its base model is then saved without adapters)"
        )
    ref_checksums: dict[str, str] = {}
    if background_ref is not None:
        ref_dir = resolve_ref(path, str(background_ref))
        if not (ref_dir / "config.json").is_file():
            raise ValueError(f"background_ref {background_ref!r}: {ref_dir} is not an HF model folder (no config.json)")
        ref_checksums = _weight_checksums(ref_dir, f"background_ref {background_ref!r}")
        vocab = _read_config_vocab(ref_dir)
    else:
        bg_model = background if background is not None else peft_model.get_base_model()
        vocab = bg_model.config.get_text_config().vocab_size
    check_vocab(tokenizer, vocab, "export_composition: background")
    return ref_checksums


@dataclass
class _ExportContents:
    """What `export_composition` writes, checked; `write` lays it out in a folder."""

    tokenizer: Any
    background: Any
    background_ref: str | None
    ref_checksums: dict[str, str]
    peft_model: Any
    lora_names: list[str]
    expert_models: dict[str, Any]
    weights: dict[str, float]
    specs: dict[str, dict]
    extra: Mapping

    def write(self, tmp: Path) -> None:
        tmp.mkdir()
        self.tokenizer.save_pretrained(tmp / "tokenizer")
        background_entry = self._write_background(tmp)
        experts = []
        for name in self.lora_names:
            _save_adapter(self.peft_model, name, tmp / "experts" / name, tmp / ".peft-scratch")
            experts.append(_expert_entry(name, "lora", self.weights, self.specs))
        for name, model in self.expert_models.items():
            model.save_pretrained(tmp / "experts" / name)
            experts.append(_expert_entry(name, "model", self.weights, self.specs))
        write_manifest(tmp, background_entry, experts, self.extra)

    def _write_background(self, tmp: Path) -> dict[str, Any]:
        """Save the background under ``tmp/background`` (or nothing, for a reference); its manifest entry."""
        if self.background_ref is not None:
            return {"ref": str(self.background_ref), "checksums": self.ref_checksums}
        background = self.background
        if background is None:  # the PeftModel's base model, adapters removed, on a copy
            background = copy.deepcopy(self.peft_model).unload()
        background.save_pretrained(tmp / "background")
        return {"path": "background"}


def write_manifest(folder: Path, background: dict, experts: list[dict], extra: Mapping) -> dict:
    """Write ``folder/composition.yaml``: the given entries (tokenizer at ``tokenizer/``) and the sha256 of
    every file under ``folder``; return it as `load_manifest` reads it back.

    Raises:
        ValueError: a pickle file under ``folder``, or a manifest that does not read back.
    """
    pickles = [p for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ValueError(f"export produced pickle files {[str(p.relative_to(folder)) for p in pickles]}")
    manifest = {
        "format_version": FORMAT_VERSION,
        "background": background,
        "tokenizer": "tokenizer",
        "experts": experts,
        "checksums": {
            p.relative_to(folder).as_posix(): sha256_file(p)
            for p in sorted(folder.rglob("*")) if p.is_file() and p != folder / MANIFEST_NAME
        },
        "extra": _plain(extra),
    }
    (folder / MANIFEST_NAME).write_text(yaml.safe_dump(manifest, sort_keys=False))
    return load_manifest(folder)  # what we wrote must read back


def _save_adapter(peft_model, name: str, dest: Path, scratch: Path) -> None:
    """Save one adapter as ``dest/{adapter_config.json, adapter_model.safetensors}``."""
    peft_model.save_pretrained(scratch, selected_adapters=[name], safe_serialization=True)
    src = scratch if name == "default" else scratch / name
    dest.mkdir(parents=True)
    for fname in ("adapter_config.json", "adapter_model.safetensors"):
        if not (src / fname).is_file():
            raise ValueError(f"peft did not write {fname} for adapter {name!r}")
        shutil.move(str(src / fname), str(dest / fname))
    shutil.rmtree(scratch)


def _expert_entry(name: str, kind: str, weights: Mapping, specs: Mapping) -> dict:
    return {
        "name": name,
        "kind": kind,
        "path": f"experts/{name}",
        "weight": float(weights.get(name, 1.0)),
        "spec": _plain(specs.get(name, {})),
    }


# ---------------------------------------------------------------------- manifest


@dataclass
class Manifest:
    """A ``composition.yaml``, checked: `read` parses the file and its top-level keys; construction checks every
    value (`__post_init__`), each failure a ``ValueError`` naming the file and the key. Defaults filled in:
    ``extra`` and each expert's ``spec`` ``{}``, its ``weight`` 1.0 (a float)."""

    file: Path
    format_version: int
    background: dict
    tokenizer: str
    experts: list[dict]
    checksums: dict[str, str]
    extra: dict

    @classmethod
    def read(cls, path: str | os.PathLike) -> Manifest:
        """The manifest of an export folder, or of the manifest file itself."""
        path = Path(path)
        file = path / MANIFEST_NAME if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{file}: no composition manifest there")
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"{file}: not valid YAML: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{file}: the manifest must be a mapping, got {type(data).__name__}")
        if data.get("extra") is None:
            data["extra"] = {}
        for key in _TOP_KEYS:
            if key not in data:
                raise _key_error(file, key, "is missing")
        for key in data:
            if key not in _TOP_KEYS:
                raise _key_error(file, str(key), f"is unknown (allowed: {', '.join(_TOP_KEYS)})")
        return cls(file=file, **data)

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION or isinstance(self.format_version, bool):
            raise self.fail("format_version", f"must be {FORMAT_VERSION}, got {self.format_version!r}")
        self._check_background()
        _check_relpath(self.tokenizer, "tokenizer", self.fail)
        self._check_experts()
        _check_checksums(self.checksums, "checksums", self.fail)
        for key in self.checksums:
            _check_relpath(key, f"checksums[{key!r}]", self.fail)
        if not isinstance(self.extra, dict):
            raise self.fail("extra", f"must be a mapping, got {type(self.extra).__name__}")

    def fail(self, key: str, msg: str) -> ValueError:
        """The error for a bad value at ``key``."""
        return _key_error(self.file, key, msg)

    def to_dict(self) -> dict:
        """The manifest as the mapping its file holds."""
        return {key: getattr(self, key) for key in _TOP_KEYS}

    def _check_background(self) -> None:
        bg = self.background
        if not isinstance(bg, dict) or len({"path", "ref"} & set(bg)) != 1:
            raise self.fail("background", "must be a mapping with exactly one of 'path' or 'ref'")
        allowed = {"path"} if "path" in bg else {"ref", "checksums"}
        for key in bg:
            if key not in allowed:
                raise self.fail(f"background.{key}", f"is unknown (allowed: {sorted(allowed)})")
        if "path" in bg:
            _check_relpath(bg["path"], "background.path", self.fail)
            return
        if not isinstance(bg["ref"], str) or not bg["ref"]:
            raise self.fail("background.ref", f"must be a non-empty string, got {bg['ref']!r}")
        bg.setdefault("checksums", {})
        _check_checksums(bg["checksums"], "background.checksums", self.fail)

    def _check_experts(self) -> None:
        if self.experts is None:
            self.experts = []
        if not isinstance(self.experts, list):
            raise self.fail("experts", f"must be a list, got {type(self.experts).__name__}")
        seen: set[str] = set()
        for i, entry in enumerate(self.experts):
            self._check_expert(f"experts[{i}]", entry, seen)
            seen.add(entry["name"])

    def _check_expert(self, where: str, e: Any, seen: set[str]) -> None:
        """One entry of ``experts`` (its defaults filled in, its weight made a float)."""
        if not isinstance(e, dict):
            raise self.fail(where, f"must be a mapping, got {type(e).__name__}")
        e.setdefault("spec", {})
        e.setdefault("weight", 1.0)
        for key in _EXPERT_KEYS:
            if key not in e:
                raise self.fail(f"{where}.{key}", "is missing")
        for key in e:
            if key not in _EXPERT_KEYS:
                raise self.fail(f"{where}.{key}", f"is unknown (allowed: {', '.join(_EXPERT_KEYS)})")
        name = e["name"]
        if not isinstance(name, str) or not EXPERT_NAME_RE.match(name) or name == "__base__":
            raise self.fail(f"{where}.name", f"must be a simple name ([A-Za-z0-9_.-], not '__base__'), got {name!r}")
        if name in seen:
            raise self.fail(f"{where}.name", f"repeats the expert name {name!r}")
        if e["kind"] not in EXPERT_KINDS:
            raise self.fail(f"{where}.kind", f"must be one of {EXPERT_KINDS}, got {e['kind']!r}")
        _check_relpath(e["path"], f"{where}.path", self.fail)
        w = e["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise self.fail(f"{where}.weight", f"must be a number, got {w!r}")
        e["weight"] = float(w)
        if e["spec"] is None:
            e["spec"] = {}
        if not isinstance(e["spec"], dict):
            raise self.fail(f"{where}.spec", f"must be a mapping, got {type(e['spec']).__name__}")


def load_manifest(path: str | os.PathLike) -> dict:
    """Parse and validate ``composition.yaml`` (``path`` is the export folder or the file itself): `Manifest`
    as a dict.

    Returns:
        The manifest as a dict (``extra`` and each expert's ``spec`` default to ``{}``).

    Raises:
        ValueError: unreadable YAML, a missing/unknown key or a value of the wrong type, naming the file
            and the key.
    """
    return Manifest.read(path).to_dict()


def _key_error(file: Path, key: str, msg: str) -> ValueError:
    return ValueError(f"{file}: key {key!r} {msg}")


def verify_export(path: str | os.PathLike, manifest: dict | None = None) -> None:
    """Check every file the manifest lists against its sha256, and that no unlisted or pickle file is there.

    Raises:
        ValueError: naming the missing, corrupt, truncated, unlisted or pickle file.
    """
    root = export_root(path)
    manifest = load_manifest(root) if manifest is None else manifest
    _verify_files(root, manifest["checksums"], "export")
    listed = set(manifest["checksums"])
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or rel == MANIFEST_NAME:
            continue
        if p.suffix in PICKLE_SUFFIXES:
            raise ValueError(f"{p}: pickle files are never loaded; remove it from the export")
        if p.suffix == WEIGHT_SUFFIX and rel not in listed:
            raise ValueError(f"{p}: weight file not listed in {MANIFEST_NAME} checksums")
    for rel in _required_files(manifest):
        if rel not in listed:
            raise ValueError(f"{root / rel}: required file is not listed in {MANIFEST_NAME} checksums")
    bg = manifest["background"]
    if "ref" in bg:
        ref_dir = resolve_ref(root, bg["ref"])
        if not ref_dir.is_dir():
            raise ValueError(f"background ref {bg['ref']!r}: {ref_dir} does not exist")
        _verify_files(ref_dir, bg["checksums"], f"background ref {bg['ref']!r}")
        now = _weight_checksums(ref_dir, f"background ref {bg['ref']!r}")
        missing = sorted(set(now) - set(bg["checksums"]))
        if missing:
            raise ValueError(f"{ref_dir / missing[0]}: weight file not listed in the background ref's checksums")


def _required_files(manifest: dict) -> list[str]:
    files = []
    for e in manifest["experts"]:
        if e["kind"] == "lora":
            files += [f"{e['path']}/adapter_config.json", f"{e['path']}/adapter_model.safetensors"]
        else:
            files.append(f"{e['path']}/config.json")
    if "path" in manifest["background"]:
        files.append(f"{manifest['background']['path']}/config.json")
    return files


# ---------------------------------------------------------------------- loading


@dataclass
class LoadedExport:
    """An export's components, checked and loaded (what `ComposedLM.from_manifest` composes).

    `experts` is a `PeftModel` holding every LoRA adapter (adapters backend) or a list of full models
    (separate backend); `specs` and `weights` are one per expert, in manifest order.
    """

    tokenizer: Any
    background: Any
    experts: Any
    names: list[str]
    weights: list[float]
    specs: list[dict]
    extra: dict


@quiet_loading()
def load_export(path: str | os.PathLike, *, backend: str = "adapters") -> LoadedExport:
    """Verify and load an export's components.

    Verifies checksums, loads the tokenizer from ``tokenizer/`` and checks it fits the background's
    vocabulary. ``backend="adapters"``: every expert must be LoRA; they are loaded into one PeftModel
    (``PeftModel.from_pretrained`` + ``load_adapter``). With no experts at all, the separate backend is
    returned (there is nothing to batch). ``backend="separate"``: each LoRA is merged into its own deep
    copy of the background (``merge_and_unload``); full-model experts are loaded as they are.
    """
    from peft import PeftModel

    if backend not in ("adapters", "separate"):
        raise ValueError(f"backend must be 'adapters' or 'separate', got {backend!r}")
    root = export_root(path)
    manifest = load_manifest(root)
    verify_export(root, manifest)
    tokenizer = load_tokenizer(root / manifest["tokenizer"])
    bg = manifest["background"]
    bg_dir = root / bg["path"] if "path" in bg else resolve_ref(root, bg["ref"])
    background = pretrained_causal_lm(bg_dir)
    check_vocab(tokenizer, background.config.get_text_config().vocab_size, str(root / manifest["tokenizer"]))
    entries = manifest["experts"]
    names = [e["name"] for e in entries]
    if backend == "adapters" and entries:
        full = [e["name"] for e in entries if e["kind"] != "lora"]
        if full:
            raise ValueError(f"experts {full} are full models; load them with backend='separate'")
        experts = PeftModel.from_pretrained(background, str(root / entries[0]["path"]), adapter_name=names[0])
        for e in entries[1:]:
            experts.load_adapter(str(root / e["path"]), adapter_name=e["name"])
    else:
        experts = []
        for e in entries:
            if e["kind"] == "lora":
                wrapped = PeftModel.from_pretrained(copy.deepcopy(background), str(root / e["path"]))
                experts.append(wrapped.merge_and_unload())
            else:
                experts.append(pretrained_causal_lm(root / e["path"]))
    return LoadedExport(tokenizer, background, experts, names, [e["weight"] for e in entries],
                        [e["spec"] for e in entries], manifest["extra"])


# ---------------------------------------------------------------------- small helpers


def export_root(path: str | os.PathLike) -> Path:
    """The export folder of ``path``: the folder itself, or the folder of its ``composition.yaml``."""
    path = Path(path)
    return path.parent if path.name == MANIFEST_NAME and path.is_file() else path


def resolve_ref(root: Path, ref: str) -> Path:
    """The folder a ``background.ref`` names: ``~`` expanded; a relative one is relative to the export ``root``."""
    ref_path = Path(ref).expanduser()
    return ref_path if ref_path.is_absolute() else (root / ref_path)


def _check_names(names: list[str], where: str) -> None:
    seen = set()
    for name in names:
        if not EXPERT_NAME_RE.match(name) or name == "__base__":
            raise ValueError(f"{where}: expert name {name!r} must match [A-Za-z0-9][A-Za-z0-9_.-]* (not '__base__')")
        if name in seen:
            raise ValueError(f"{where}: expert name {name!r} is used twice")
        seen.add(name)


def _check_relpath(value: Any, key: str, fail) -> None:
    if not isinstance(value, str) or not value:
        raise fail(key, f"must be a non-empty relative path, got {value!r}")
    p = Path(value)
    if p.is_absolute() or ".." in p.parts:
        raise fail(key, f"must stay inside the export folder, got {value!r}")


def _check_checksums(value: Any, key: str, fail) -> None:
    if not isinstance(value, dict):
        raise fail(key, f"must be a mapping of file -> sha256, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str) or not _SHA_RE.match(v):
            raise fail(f"{key}[{k!r}]", f"must be a 64-hex-digit sha256, got {v!r}")


def _verify_files(root: Path, checksums: Mapping[str, str], what: str) -> None:
    for rel, expected in checksums.items():
        file = root / rel
        if not file.is_file():
            raise ValueError(f"{file}: listed in the {what} checksums but missing")
        if sha256_file(file) != expected:
            raise ValueError(f"{file}: sha256 mismatch (corrupt or truncated file)")


def _weight_checksums(folder: Path, what: str) -> dict[str, str]:
    pickles = [p.name for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    weights = sorted(p for p in folder.rglob(f"*{WEIGHT_SUFFIX}") if p.is_file())
    if not weights:
        raise ValueError(f"{what}: no safetensors weights in {folder}" + (f" (only pickles {pickles})" if pickles else ""))
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in weights}


def _read_config_vocab(folder: Path) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    return getattr(config.get_text_config(), "vocab_size", None)


def _plain(value: Any) -> Any:
    """Turn mappings/sequences (e.g. OmegaConf containers) into plain dicts/lists for YAML."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
