"""Reading Hugging Face models and tokenizers from local folders (safetensors only, no remote code unless asked),
the dtype names they load in, and the SHA-256 of a file that exports and caches are checked by."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# dtype name -> what `from_pretrained(dtype=...)` takes ("auto": as the checkpoint was saved)
DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
DTYPE_NAMES = tuple(DTYPES)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype (or ``"auto"``) from one of `DTYPE_NAMES` or a torch dtype.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    return DTYPES[dtype]


def pretrained_causal_lm(folder: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
                         attn_implementation: str | None = None,
                         trust_remote_code: bool = False) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` of an HF folder from its safetensors only, in eval mode.

    Args:
        dtype: one of `DTYPE_NAMES` or a torch dtype; None: transformers' default (as saved).
        attn_implementation: e.g. ``"eager"``, ``"sdpa"``; None: transformers' default.
        trust_remote_code: run the folder's own modelling code (off unless a config says so).

    Raises whatever transformers raises for a folder it cannot load; callers say which component it was.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"use_safetensors": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = torch_dtype(dtype)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in ``folder`` (``AutoTokenizer``, no remote code; a bare ``tokenizer.json`` folder
    through ``PreTrainedTokenizerFast``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError, KeyError):
        return PreTrainedTokenizerFast.from_pretrained(folder)


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 hex digest of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(Path(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
