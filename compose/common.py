"""Small helpers shared across the framework: eval mode, the vocabulary check, position ids, atomic writes."""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Put `module` in eval mode (peft needs it for per-row `adapter_names`) and restore every submodule's
    mode afterwards. Our adapters and models run without dropout, so gradients still flow unchanged."""
    modes = [(m, m.training) for m in module.modules()]
    # A big PeftModel has thousands of modules: skip eval()'s walk when they already are in eval mode (only the
    # root, e.g. a fresh wrapper, may not be), and restore only what changed.
    if any(training for _, training in modes[1:]):
        module.eval()
    else:
        module.training = False
    try:
        yield
    finally:
        for m, training in modes:
            if m.training != training:
                m.training = training


def check_vocab(tokenizer, vocab_size: int | None, where: str) -> None:
    """Refuse a model whose vocabulary cannot hold every token of `tokenizer`.

    A larger embedding table is fine: pretrained checkpoints pad theirs (to a multiple of 64, say).
    """
    if tokenizer is not None and vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"{where}: the model's vocabulary has {vocab_size} tokens, fewer than the tokenizer's "
                         f"{len(tokenizer)}")


# A model whose config holds this token id couples its output positions to its input's (position coupling,
# `model.position_encoding: coupled`, README "Length generalization"): the t-th token after `<bos>` sits at 2t, the
# separator at 1 and the j-th token after it at 2j + 1. In `<bos> x <sep> y` the step that predicts `y_t` (position
# 2t − 1) then sits one before `x_t` (2t), the same offset under RoPE at every length and after any edit of the
# prefix; the odd/even split leaves room to spread the input over random positions in training
# (`lightning_modules.background.training_position_ids`) while that offset stays 1.
POSITION_RESTART_KEY = "position_restart_token_id"


def position_restart_token(model: nn.Module) -> int | None:
    """The token id at which `model` restarts its position ids (`POSITION_RESTART_KEY` in its config), if any."""
    if hasattr(model, "get_base_model"):  # a PeftModel: the wrapped model's config
        model = model.get_base_model()
    return getattr(getattr(model, "config", None), POSITION_RESTART_KEY, None)


def position_ids(input_ids: Tensor, attention_mask: Tensor | None = None,
                 restart_token_id: int | None = None) -> Tensor:
    """Position ids `[B, T]` as Hugging Face `generate` computes them (count of attended tokens before each one,
    0 at padding); with a `restart_token_id`, coupled (`POSITION_RESTART_KEY`): `2i` before the first such token,
    `2j + 1` for the j-th token from the latest one on."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    if restart_token_id is not None:
        restart = (input_ids == restart_token_id) & (attention_mask != 0)
        since = positions - torch.where(restart, positions, 0).cummax(-1).values
        positions = torch.where(restart.cumsum(-1) > 0, 2 * since + 1, 2 * positions)
        positions = positions.masked_fill(attention_mask == 0, 0)
    return positions


def next_position_ids(last: Tensor, next_tokens: Tensor, restart_token_id: int | None = None) -> Tensor:
    """The position ids `[B, 1]` of the tokens `next_tokens` `[B]` that follow positions `last` `[B, 1]` (cached
    decoding), consistent with `position_ids`."""
    if restart_token_id is None:
        return last + 1
    return (last + 2).masked_fill(next_tokens[:, None] == restart_token_id, 1)


def model_position_ids(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """The position ids a training or scoring forward of `model` needs: None (the model's own default) unless
    its config restarts positions at a token (`position_restart_token`)."""
    restart = position_restart_token(model)
    return None if restart is None else position_ids(input_ids, attention_mask, restart)


# Every atomic write here goes through a hidden sibling named `.<name>.tmp-<id>` (an old folder being replaced
# is parked as `.<name>.old-<id>`): a process killed mid-write leaves only such names, which
# `remove_stale_temporaries` recognises.
_STALE = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]+$")


def row_blocks(t: Tensor | None, n: int) -> Tensor | None:
    """``t`` as ``n`` row blocks ``[t; t; …]`` (``t.repeat(n, 1)``), for the adapters backend's ``(k+1)·B`` batch.
    ``torch.cat`` records one or two ATen ops where ``repeat`` records about 30, three times in every decoding step."""
    return t if t is None or n == 1 else torch.cat([t] * n)


def _sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}"


def move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename the finished `tmp` to `path`; an old `path` is removed only after that succeeded."""
    old = None
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        old = _sibling(path, "old")
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
    tmp = _sibling(path, "tmp")
    try:
        save_fn(tmp)
        pause_point(f"{path.parent.name}/{path.name}")  # (tests: a kill with the folder written, not yet in place)
        move_into_place(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file `path` to write; it replaces `path` (`os.replace`) once the block
    ends without error, and is removed otherwise. A process killed inside the block leaves `path` as it was."""
    path = Path(path)
    tmp = _sibling(path, "tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to a temporary sibling, then rename it over `path`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove what interrupted atomic writes left anywhere under `folder` (`.<name>.tmp-<id>` files and
    folders, `.<name>.old-<id>` folders); return them. Only for a folder no process is writing to."""
    found = sorted((p for p in Path(folder).rglob(".*") if _STALE.match(p.name)), key=lambda p: len(p.parts))
    removed = []
    for p in found:
        if any(parent in removed for parent in p.parents):
            continue  # inside one already removed
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


PAUSE_ENV = "COMPOSABLE_EXPERTS_PAUSE_AT"


def pause_point(name: str) -> None:
    """A fault-injection point for tests: when `$COMPOSABLE_EXPERTS_PAUSE_AT` equals `name`, print
    `[pause] name` and wait (forever) to be killed. Points: `<folder>/<name>` of every `atomic_save` (the
    folder written, not yet moved into place) and `<run folder>/<stage> step <n>` after each training step."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    print(f"[pause] {name}", flush=True)
    sys.stdout.flush()
    while True:
        time.sleep(3600)


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes ``name`` (cached per class: ``inspect.signature`` costs ~40 µs a step)."""
    if "forward" in vars(model):  # an instance-level forward (e.g. accelerate's hooks): ask it directly
        return _takes(model.forward, name)
    return name in _forward_parameters(type(model))


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
