"""Export folder + manifest: roundtrips on both backends, checksums, atomic and non-destructive writes."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import VOCAB, char_tokenizer, tiny_model, tiny_peft

from compose import ComposedLM, Manifest, export_composition, load_manifest


def batch():
    ids = torch.randint(5, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return ids, mask


SPECS = {"a2b": {"rules": {"A": "B"}}, "c2d": {"rules": {"C": "D"}, "interval": {"start": "[", "end": "]"}}}


def export_lora(path: Path, arch: str = "llama", **kw):
    peft_model = tiny_peft(arch, names=("a2b", "c2d"))
    kw.setdefault("weights", {"a2b": 1.0, "c2d": 0.5})
    out = export_composition(path, tokenizer=char_tokenizer(), peft_model=peft_model, adapter_names=["a2b", "c2d"],
                             specs=SPECS, extra={"run": "unit-test"}, **kw)
    return out, peft_model


def tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- roundtrips


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_roundtrip_both_backends(tmp_path, arch):
    path, peft_model = export_lora(tmp_path / "export", arch)
    ids, mask = batch()
    original = ComposedLM.from_peft(peft_model, ["a2b", "c2d"], weights=[1.0, 0.5]).score(ids, mask)

    manifest = load_manifest(path)
    assert manifest["format_version"] == 1 and manifest["background"] == {"path": "background"}
    assert [(e["name"], e["kind"], e["path"], e["weight"]) for e in manifest["experts"]] == [
        ("a2b", "lora", "experts/a2b", 1.0), ("c2d", "lora", "experts/c2d", 0.5)]
    assert manifest["experts"][0]["spec"] == {"rules": {"A": "B"}} and manifest["extra"] == {"run": "unit-test"}
    assert {"background/model.safetensors", "experts/a2b/adapter_model.safetensors",
            "experts/c2d/adapter_model.safetensors"} <= set(manifest["checksums"])
    assert (path / "experts/a2b/adapter_config.json").is_file()
    assert not list(path.rglob("*.bin")) and not list(tmp_path.glob(".export*"))

    for backend in ("adapters", "separate"):
        loaded = ComposedLM.from_manifest(path, backend=backend, device="cpu")
        assert loaded.backend == backend and loaded.names == ["a2b", "c2d"] and loaded.weights == [1.0, 0.5]
        assert dict(zip(loaded.names, loaded.specs, strict=True)) == SPECS and loaded.tokenizer.get_vocab() == char_tokenizer().get_vocab()
        assert loaded.tokenizer.eos_token == "<eos>"
        diff = (loaded.score(ids, mask) - original).abs().max().item()
        assert diff < 1e-5, (backend, diff)


def test_full_model_experts_and_background_ref(tmp_path):
    background, expert = tiny_model(seed=0), tiny_model(seed=1)
    background.save_pretrained(tmp_path / "bg")
    path = export_composition(tmp_path / "export", tokenizer=char_tokenizer(), background_ref=str(tmp_path / "bg"),
                              expert_models={"full": expert}, weights={"full": 0.8})
    manifest = load_manifest(path / "composition.yaml")
    assert manifest["background"]["ref"] == str(tmp_path / "bg") and not (path / "background").exists()
    assert list(manifest["background"]["checksums"]) == ["model.safetensors"]
    ids, mask = batch()
    expected = ComposedLM(background, [expert], weights=[0.8]).score(ids, mask)
    loaded = ComposedLM.from_manifest(path, backend="separate")
    torch.testing.assert_close(loaded.score(ids, mask), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"\['full'\] are full models.*separate"):
        ComposedLM.from_manifest(path, backend="adapters")
    # The referenced background changed after export: refused.
    weights = tmp_path / "bg" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match="model.safetensors"):
        ComposedLM.from_manifest(path, backend="separate")


# ---------------------------------------------------------------------------------------------- integrity


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_weight_file_is_named(tmp_path, damage):
    path, _ = export_lora(tmp_path / "export")
    target = path / "experts" / "c2d" / "adapter_model.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="experts/c2d/adapter_model.safetensors"):
        ComposedLM.from_manifest(path)


def test_unlisted_or_pickle_files_refused(tmp_path):
    path, _ = export_lora(tmp_path / "export")
    (path / "experts" / "a2b" / "extra.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match=r"extra\.bin: pickle"):
        ComposedLM.from_manifest(path)


def test_tokenizer_larger_than_vocab_refused(tmp_path):
    big = char_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefgh")
    with pytest.raises(ValueError, match="vocabulary has 32 tokens, fewer than the tokenizer.s 39"):
        export_composition(tmp_path / "export", tokenizer=big, background=tiny_model())
    assert not (tmp_path / "export").exists()


def test_tokenizer_larger_than_vocab_refused_at_load(tmp_path):
    path, _ = export_lora(tmp_path / "export")
    char_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefgh").save_pretrained(path / "tokenizer")
    manifest = yaml.safe_load((path / "composition.yaml").read_text())
    for rel in list(manifest["checksums"]):  # re-sign, so only the vocabulary check can object
        manifest["checksums"][rel] = hashlib.sha256((path / rel).read_bytes()).hexdigest()
    (path / "composition.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(ValueError, match="vocabulary has 32 tokens, fewer than the tokenizer.s 39"):
        ComposedLM.from_manifest(path)


def test_manifest_validation_names_key(tmp_path):
    path, _ = export_lora(tmp_path / "export")
    file = path / "composition.yaml"
    good = yaml.safe_load(file.read_text())
    cases = [
        (lambda m: m["experts"][1].__setitem__("weight", "heavy"), r"experts\[1\]\.weight"),
        (lambda m: m["experts"][0].__setitem__("kind", "dora"), r"experts\[0\]\.kind"),
        (lambda m: m.__setitem__("colour", 1), "'colour' is unknown"),
        (lambda m: m.pop("checksums"), "'checksums' is missing"),
        (lambda m: m["experts"][0].__setitem__("path", "../elsewhere"), "inside the export folder"),
        (lambda m: m.__setitem__("format_version", 2), "format_version"),
    ]
    for edit, pattern in cases:
        m = copy.deepcopy(good)
        edit(m)
        file.write_text(yaml.safe_dump(m))
        with pytest.raises(ValueError, match="composition.yaml") as info:
            load_manifest(path)
        assert info.match(pattern)


def test_manifest_dataclass_fills_defaults_and_checks_on_construction(tmp_path):
    path, _ = export_lora(tmp_path / "export")
    file = path / "composition.yaml"
    data = yaml.safe_load(file.read_text())
    data["experts"][0].pop("spec")
    data["experts"][1]["weight"] = 2
    data.pop("extra")
    file.write_text(yaml.safe_dump(data))
    manifest = Manifest.read(path)
    assert manifest.file == file and manifest.extra == {} and manifest.experts[0]["spec"] == {}
    assert manifest.experts[1]["weight"] == 2.0 and isinstance(manifest.experts[1]["weight"], float)
    assert manifest.to_dict() == load_manifest(file)
    with pytest.raises(ValueError, match=r"composition.yaml: key 'experts\[1\]\.name' repeats the expert name 'a2b'"):
        Manifest(**{**manifest.to_dict(), "file": file,
                    "experts": [dict(manifest.experts[0]), {**manifest.experts[0], "path": "experts/x"}]})


# ---------------------------------------------------------------------------------------------- atomicity


def test_existing_folder_refused_and_left_intact(tmp_path):
    path, _ = export_lora(tmp_path / "export")
    before = tree(path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_composition(path, tokenizer=char_tokenizer(), background=tiny_model(seed=3))
    assert tree(path) == before
    export_composition(path, tokenizer=char_tokenizer(), background=tiny_model(seed=3), overwrite=True)
    manifest = load_manifest(path)
    assert manifest["experts"] == [] and tree(path) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary siblings left


def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch):
    expert = tiny_model(seed=1)

    def broken_save(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(expert, "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        export_composition(tmp_path / "export", tokenizer=char_tokenizer(), background=tiny_model(),
                           expert_models={"x": expert})
    assert list(tmp_path.iterdir()) == []
    # Replacing an existing export: a failure keeps the old one whole.
    path, _ = export_lora(tmp_path / "export")
    before = tree(path)
    with pytest.raises(RuntimeError, match="disk full"):
        export_composition(path, tokenizer=char_tokenizer(), background=tiny_model(),
                           expert_models={"x": expert}, overwrite=True)
    assert tree(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_bad_export_arguments_write_nothing(tmp_path):
    peft_model = tiny_peft(names=("a2b", "c2d"))
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="weights names unknown experts"):
        export_composition(tmp_path / "e", tokenizer=tok, peft_model=peft_model, weights={"zz": 1.0})
    with pytest.raises(ValueError, match="PEFT adapter layers"):
        export_composition(tmp_path / "e", tokenizer=tok, background=peft_model.get_base_model())
    with pytest.raises(ValueError, match="used twice"):
        export_composition(tmp_path / "e", tokenizer=tok, peft_model=peft_model, adapter_names=["a2b"],
                           expert_models={"a2b": tiny_model()})
    with pytest.raises(ValueError, match="plain YAML"):
        export_composition(tmp_path / "e", tokenizer=tok, peft_model=peft_model, specs={"a2b": {"f": object()}})
    assert list(tmp_path.iterdir()) == []
