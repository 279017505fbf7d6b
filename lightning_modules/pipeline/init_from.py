"""`expert.init_from`: experts that start from an existing PEFT adapter or HF model folder, checked against the
background before anything is trained.

`expert.init_from` is one folder (a run that trains one expert) or a mapping {expert name: folder}; experts not
named start fresh. An adapter fits when it was trained on this background: by the background's checksums where
they are recorded (the adapter lies in an export whose manifest records its background, or its
`base_model_name_or_path` is a local folder), else by architecture and shapes: every module it adapts exists in
the background with the shapes its weights have. A full model fits when its architecture, vocabulary and weight
shapes are the background's. Every failure is a one-line `ConfigError` naming `expert.init_from` and the folder.

`expert.init_base` names the model the folders were trained against when it is not the background (experts
fine-tuned on a public model, moved onto a background tuned from it, given as `background.path` or tuned in the
same run from `model.pretrained_path`): adapters are then checked against it where their background is recorded,
and every folder and the base itself must have the background's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_modules.expert import INIT_MODES, init_kind
from lightning_modules.pipeline.config import ConfigError

KEY = "expert.init_from"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def init_from_folders(cfg: DictConfig) -> dict[str, Path]:
    """{expert name: folder} from `expert.init_from` (null, one folder for a run's one trained expert, or a mapping
    {name: folder} over trained experts)."""
    value = cfg.expert.init_from
    names = [e.name for e in cfg.experts]
    if value is None:
        return {}
    if isinstance(value, str):
        if len(names) != 1:
            raise ConfigError(f"{KEY}={value}: one folder starts one expert, and this run trains {len(names)} "
                              f"({', '.join(names)}): give a mapping {{expert name: folder}}")
        return {names[0]: Path(value)}
    if not isinstance(value, DictConfig) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(f"{KEY}: give an adapter or model folder, or a mapping {{expert name: folder}}, got "
                          f"{OmegaConf.to_container(value) if OmegaConf.is_config(value) else value!r}")
    unknown = [str(k) for k in value if k not in names]
    if unknown:
        raise ConfigError(f"{KEY}: {unknown[0]!r} is not an expert of this run ({', '.join(names)})")
    return {str(k): Path(v) for k, v in value.items()}


def check_init_from(cfg: DictConfig) -> None:
    """Each `expert.init_from` folder is an adapter or a model that fits the run's background and `expert.mode`."""
    folders = init_from_folders(cfg)
    if not folders:
        if cfg.expert.init_base:
            raise ConfigError(f"expert.init_base={cfg.expert.init_base}: set without {KEY} (it names the model the "
                              f"{KEY} folders were trained against)")
        return
    from lightning_modules.pipeline.models import pretrained_folder

    if cfg.background.path:
        background = pretrained_folder(cfg.background.path, "background.path")
    elif cfg.expert.init_base and cfg.model.pretrained_path:
        # the background is tuned in this run from model.pretrained_path and the folders move onto it: they must
        # fit the model it starts from
        background = pretrained_folder(cfg.model.pretrained_path, "model.pretrained_path")
    else:
        raise ConfigError(f"{KEY} needs background.path (the background the adapter or model was trained against, "
                          "kept as it is) or expert.init_base with a background tuned in this run from "
                          "model.pretrained_path: a background trained from scratch fits no existing expert")
    if not (background / "config.json").is_file():
        return  # load_pretrained names the missing background (stages.plan_run)
    base = init_base_folder(cfg)
    if base is not None:
        where = f"expert.init_base={cfg.expert.init_base}"
        if not (base / "config.json").is_file():
            raise ConfigError(f"{where}: not an HF model folder (config.json)")
        check_model(base, background, where)
    for name, folder in folders.items():
        where = f"{KEY}" + (f".{name}" if not isinstance(cfg.expert.init_from, str) else "") + f"={folder}"
        try:
            kind = init_kind(folder)
        except ValueError:
            raise ConfigError(f"{where}: neither a PEFT adapter folder (adapter_config.json) nor an HF model folder "
                              "(config.json)") from None
        if cfg.expert.mode not in INIT_MODES[kind]:
            raise ConfigError(f"{where} is a {'PEFT adapter' if kind == 'adapter' else 'full model'}: it starts an "
                              f"expert of expert.mode={' or '.join(INIT_MODES[kind])}, got expert.mode="
                              f"{cfg.expert.mode}")
        if kind == "adapter":
            check_adapter(folder, background, where, trained_on=base)
        else:
            check_model(folder, background, where)


def init_base_folder(cfg: DictConfig) -> Path | None:
    """The HF folder of `expert.init_base` (a name such as `smollm2` converted as `background.path` is), or None."""
    if not cfg.expert.init_base:
        return None
    from lightning_modules.pipeline.models import pretrained_folder

    return pretrained_folder(cfg.expert.init_base, "expert.init_base")


# ---------------------------------------------------------------------- adapters


def check_adapter(folder: Path, background: Path, where: str, trained_on: Path | None = None) -> None:
    """A LoRA adapter folder trained on `trained_on` (default: `background`; by checksums where recorded) whose
    modules and shapes fit `background`."""
    config = _read_json(folder / "adapter_config.json", where)
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: a {config.get('peft_type')} adapter; only LoRA adapters start an expert")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{where}: {ADAPTER_WEIGHTS} missing (adapters are read from safetensors only)")
    recorded = _recorded_background(folder, config.get("base_model_name_or_path"))
    if recorded is not None:
        source, files = recorded
        expected = trained_on or background
        if not _same_weights(files, _weight_files(expected)):
            said = f"expert.init_base={expected}" if trained_on else f"background.path={background}"
            raise ConfigError(f"{where}: trained on another background ({source}) than {said}")
    _check_adapter_shapes(folder, background, where)


def _recorded_background(folder: Path, base: str | None) -> tuple[str, list[Path]] | None:
    """`(where it is recorded, its weight files)` of the background an adapter was trained on, when known: the
    background of the export holding the adapter (its manifest verifies its files), or a local
    `base_model_name_or_path` folder."""
    from compose.export import MANIFEST_NAME, load_manifest, resolve_ref, verify_export

    export = folder.parent.parent
    if (export / MANIFEST_NAME).is_file():
        try:
            manifest = load_manifest(export)
            verify_export(export, manifest)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{KEY}={folder}: {str(e).splitlines()[0]}") from None
        if any((export / e["path"]).resolve() == folder.resolve() for e in manifest["experts"]):
            entry = manifest["background"]
            root = export / entry["path"] if "path" in entry else resolve_ref(export, entry["ref"])
            return f"{export / MANIFEST_NAME}", _weight_files(root)
    if base and Path(base).is_dir() and _weight_files(Path(base)):
        return f"base_model_name_or_path={base}", _weight_files(Path(base))
    return None


def _check_adapter_shapes(folder: Path, background: Path, where: str) -> None:
    """Every LoRA weight sits on a module of the background whose input and output sizes it fits."""
    from safetensors import safe_open

    modules = dict(_meta_model(background, where).named_modules())
    with safe_open(folder / ADAPTER_WEIGHTS, framework="pt") as f:
        for key in f.keys():
            parts = key.split(".")
            part = next((p for p in parts if p in _LORA_PARTS), None)
            if part is None:
                continue
            path = ".".join(parts[:parts.index(part)]).removeprefix("base_model.model.")
            module = modules.get(path)
            if module is None:
                raise ConfigError(f"{where}: adapts {path}, which the background ({background}) does not have "
                                  "(another architecture)")
            shape, (n_in, n_out) = tuple(f.get_slice(key).get_shape()), _in_out(module)
            fits = shape[1] == n_in if part.endswith("_A") else shape[0] == n_out
            if not fits:
                raise ConfigError(f"{where}: {key} has shape {list(shape)}, which does not fit {path} of the "
                                  f"background ({n_in} in, {n_out} out): trained on another model")


def _in_out(module: Any) -> tuple[int, int]:
    """Input and output sizes of a module LoRA adapts (linear, GPT-2's Conv1D, embedding)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return -1, -1  # not a module LoRA adapts: fits nothing


# ---------------------------------------------------------------------- full models


def check_model(folder: Path, background: Path, where: str) -> None:
    """A full HF model of the background's architecture, vocabulary and weight shapes."""
    from safetensors import safe_open

    ours, theirs = _read_json(background / "config.json", "background.path"), _read_json(folder / "config.json", where)
    if ours.get("model_type") != theirs.get("model_type"):
        raise ConfigError(f"{where}: model_type {theirs.get('model_type')!r}, another architecture than the "
                          f"background's ({ours.get('model_type')!r})")
    vocab_ours, vocab_theirs = _vocab_size(ours), _vocab_size(theirs)
    if vocab_ours != vocab_theirs:
        raise ConfigError(f"{where}: a vocabulary of {vocab_theirs} tokens, another vocabulary than the background's "
                          f"({vocab_ours})")
    files = _weight_files(folder)
    if not files:
        raise ConfigError(f"{where}: no *.safetensors weights (models are read from safetensors only)")
    shapes = {k: tuple(v.shape) for k, v in _meta_model(background, "background.path").state_dict().items()}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                if key in shapes and shapes[key] != shape:
                    raise ConfigError(f"{where}: {key} has shape {list(shape)}, the background's "
                                      f"{list(shapes[key])}: another size of model")


def _vocab_size(config: dict) -> int | None:
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path, where: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {path.name}: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {path.name} is not a JSON object")
    return value


def _meta_model(folder: Path, where: str) -> Any:
    """The model of `folder`'s config with no weights (on the meta device): its module tree and shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise ConfigError(f"{where}: cannot build the model of {folder}: {str(e).splitlines()[0]}") from None


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _same_weights(a: list[Path], b: list[Path]) -> bool:
    """The same tensors: the same file checksums, or else the same tensors by name (a model saved again may differ
    in its files' metadata only)."""
    import torch
    from safetensors import safe_open

    from lightning_modules.pipeline.models import file_sha256

    if not a or not b:
        return False
    if sorted(map(file_sha256, a)) == sorted(map(file_sha256, b)):
        return True
    tensors: dict[str, Any] = {}
    for file in a:
        with safe_open(file, framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    seen = set()
    for file in b:
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                if k not in tensors or not torch.equal(tensors[k], f.get_tensor(k)):
                    return False
                seen.add(k)
    return seen == set(tensors)
