"""A composition straight from Hugging Face model folders: a background and full-model experts.

:func:`compose_folders` builds the *separate* backend of :class:`compose.ComposedLM` from a background folder
and one folder per expert (public full fine-tunes such as MergeBench's, no export needed)::

    composed = compose_folders("models/gemma-2-2b", {"math": "models/gemma-2-2b_math",
                                                     "coding": "models/gemma-2-2b_coding"},
                               dtype="bfloat16", device="cuda")

Every folder is checked before any weights are read (exists, has ``config.json`` and safetensors weights);
only safetensors are loaded and no remote code runs. An expert folder that carries its own tokenizer must
have the background's (same vocabulary and special tokens).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from compose.composed_lm import ComposedLM
from compose.model_io import load_tokenizer, pretrained_causal_lm, torch_dtype
from compose.quiet import quiet_loading

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_folder(folder: str | os.PathLike, what: str) -> Path:
    """``folder`` as a Path once it is an HF model folder with safetensors weights.

    Raises:
        ValueError: one line naming ``what`` and the folder: missing, no ``config.json``, no safetensors.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"{what} {path}: no such folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{what} {path}: not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{what} {path}: no safetensors weights (pickled weights are never loaded)")
    return path


def load_causal_lm(folder: str | os.PathLike, what: str = "model", *, dtype: str | torch.dtype | None = None,
                   device: str | torch.device | None = None, attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM from an HF folder (safetensors only, no remote code), in eval mode.

    Args:
        what: how errors name the folder (``"background"``, ``"expert 'math'"``).
        dtype: ``float32``, ``bfloat16``, ``float16`` (a name or a torch dtype); default: the checkpoint's.
        device: where to put it.
        attn_implementation: e.g. ``"eager"`` (Gemma-2 soft-caps its attention logits only there).

    Raises:
        ValueError: a bad folder (:func:`check_model_folder`) or one that holds no causal LM.
    """
    path = check_model_folder(folder, what)
    dtype = None if dtype is None else torch_dtype(dtype)
    try:
        with quiet_loading():
            model = pretrained_causal_lm(path, dtype=dtype, attn_implementation=attn_implementation)
    except (ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what} {path}: not a causal LM ({first})") from None
    return model if device is None else model.to(device)


def compose_folders(background: str | os.PathLike, experts: Mapping[str, str | os.PathLike], *,
                    tokenizer: str | os.PathLike | None = None, weights: Sequence[float] | None = None,
                    dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                    attn_implementation: str | None = None, composition: str = "soft") -> ComposedLM:
    """The separate-backend :class:`ComposedLM` of a background folder and full-model expert folders.

    Args:
        background: the background's HF folder.
        experts: expert name -> HF folder, in composition order.
        tokenizer: the tokenizer's folder (default: the background's).
        weights, composition: as in :class:`ComposedLM`.
        dtype, device, attn_implementation: as in :func:`load_causal_lm`.

    Raises:
        ValueError: a bad folder (checked for all components before any weights are read), a folder with no
            tokenizer, or an expert whose vocabulary or tokenizer differs from the background's.
    """
    bg_dir = check_model_folder(background, "background")
    expert_dirs = {str(n): check_model_folder(p, f"expert {n!r}") for n, p in experts.items()}
    tok_dir = Path(tokenizer).expanduser() if tokenizer is not None else bg_dir
    if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(f"tokenizer {tok_dir}: no tokenizer files there ({', '.join(_TOKENIZER_FILES)})")
    tokenizers = [load_tokenizer(tok_dir)] + [
        load_tokenizer(d) if any((d / f).is_file() for f in _TOKENIZER_FILES) else None for d in expert_dirs.values()
    ]
    load = dict(dtype=dtype, device=device, attn_implementation=attn_implementation)
    bg_model = load_causal_lm(bg_dir, "background", **load)
    models = [load_causal_lm(d, f"expert {n!r}", **load) for n, d in expert_dirs.items()]
    return ComposedLM(bg_model, models, names=list(expert_dirs), weights=weights, tokenizer=tokenizers,
                      composition=composition)
