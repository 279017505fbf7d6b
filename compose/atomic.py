"""Atomic writes of files and folders, the clean-up of what an interrupted one leaves, and the fault-injection
point tests kill a process at.

Every atomic write here goes through a hidden sibling named ``.<name>.tmp-<id>`` (an old folder being replaced is
parked as ``.<name>.old-<id>``): a process killed mid-write leaves only such names, which
`remove_stale_temporaries` recognises.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_STALE = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]+$")
PAUSE_ENV = "COMPOSABLE_EXPERTS_PAUSE_AT"


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
