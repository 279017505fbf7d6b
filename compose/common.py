"""Small helpers shared across the framework: eval mode, the vocabulary check, atomic writes."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Put `module` in eval mode (peft needs it for per-row `adapter_names`) and restore every submodule's
    mode afterwards. Our adapters and models run without dropout, so gradients still flow unchanged."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def check_vocab(tokenizer, vocab_size: int | None, where: str) -> None:
    """Refuse a model whose vocabulary cannot hold every token of `tokenizer`.

    A larger embedding table is fine: pretrained checkpoints pad theirs (to a multiple of 64, say).
    """
    if tokenizer is not None and vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"{where}: the model's vocabulary has {vocab_size} tokens, fewer than the tokenizer's "
                         f"{len(tokenizer)}")


def move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename the finished `tmp` to `path`; an old `path` is removed only after that succeeded."""
    old = None
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if old is not None:
            old.rename(path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_save(save_fn: Callable[[Path], object], path: Path, overwrite: bool = True) -> Path:
    """Write a folder through `save_fn(tmp)` and move it into place only once complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_fn(tmp)
        move_into_place(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
