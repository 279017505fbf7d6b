"""Rows of a data file, each with where it came from; every problem with the file is one line naming it.

`read_rows(path)` reads a JSON Lines, JSON, CSV or Parquet file (chosen by suffix), or a hub dataset
`name[:split]` through `datasets` where the name is no local path. Text files must be UTF-8 (a leading byte-order
mark and any mix of `\\n`, `\\r\\n` and `\\r` line ends are fine). A row is named `FILE line N` in line-based files
(JSON Lines, CSV: the 1-based line it starts on) and `FILE row N` otherwise (JSON arrays, Parquet, hub datasets).

A file that is missing, a folder, unreadable, a symbolic link loop, empty, not UTF-8, or not valid JSON/CSV/Parquet
raises `DataFileError` with the file and, where there is one, the line or row; nothing else is printed (the
hub loader's own log lines are held back while it reads).
"""

from __future__ import annotations

import codecs
import csv
import errno
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROW_FILE_TYPES: tuple[str, ...] = (".jsonl", ".json", ".csv", ".parquet")
_LINE_END = re.compile(r"\r\n|\r|\n")
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class DataFileError(ValueError):
    """A data file that cannot be read as rows: one line naming the file (and line or row)."""


@dataclass(frozen=True)
class Row:
    """One row of a data file: its fields and where it is (`FILE line N` or `FILE row N`)."""

    fields: dict[str, Any]
    where: str


def read_rows(path: str) -> list[Row]:
    """Every row of the data file `path` (or of the hub dataset `name[:split]`), in order; raises `DataFileError`
    when the file cannot be read or holds no rows."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in ROW_FILE_TYPES:
        if _is_folder(p):
            raise DataFileError(f"{path}: is a folder, not a data file (give the {'/'.join(ROW_FILE_TYPES)} files "
                                "in it)")
        if os.path.lexists(p):
            raise DataFileError(f"{path}: unknown data file type (use {', '.join(ROW_FILE_TYPES)})")
        rows = _read_hub(path)
    else:
        raw = _read_bytes(path)
        if not raw:
            raise DataFileError(f"{path}: data file is empty")
        if suffix == ".parquet":
            rows = _read_parquet(path)
        else:
            text = _decode(path, raw)
            rows = _read_csv(path, text) if suffix == ".csv" else _read_json(path, text, lines=suffix == ".jsonl")
    if not rows:
        raise DataFileError(f"{path}: data file is empty (no rows)")
    return rows


# --- the file's bytes --------------------------------------------------------------------------------
def _is_folder(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if os.path.islink(path):
            raise DataFileError(f"{path}: data file not found (a symbolic link to {os.readlink(path)}, which does "
                                "not exist)") from None
        raise DataFileError(f"{path}: data file not found") from None
    except IsADirectoryError:
        raise DataFileError(f"{path}: is a folder, not a data file (give the {'/'.join(ROW_FILE_TYPES)} files in "
                            "it)") from None
    except PermissionError:
        raise DataFileError(f"{path}: cannot be read by this user (permission denied)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataFileError(f"{path}: symbolic link loop (the link leads back to itself)") from None
        raise DataFileError(f"{path}: cannot read it: {err.strerror or err}") from None


def _decode(path: str, raw: bytes) -> str:
    """`raw` as UTF-8 text without a leading byte-order mark; anything else names the line of the first bad byte."""
    if raw.startswith(_UTF16_BOMS):
        raise DataFileError(f"{path}: not UTF-8 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        before = raw[:err.start].decode("utf-8")
        line_start = max(before.rfind("\n"), before.rfind("\r")) + 1
        line = len(_LINE_END.findall(before)) + 1
        raise DataFileError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte "
                            f"{len(before[line_start:].encode()) + 1} of the line); save the file as UTF-8") from None


# --- formats -----------------------------------------------------------------------------------------
def _read_json(path: str, text: str, lines: bool) -> list[Row]:
    """JSON Lines (one object per line; blank lines skipped), or for `.json` a list of objects, one object, or
    JSON Lines."""
    if not lines:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # not several objects one per line: the document's own error
                raise DataFileError(f"{path} line {err.lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
        else:
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list):
                raise DataFileError(f"{path}: a JSON data file holds a list of row objects (or one object per line), "
                                    f"got {_kind(data)}")
            for n, item in enumerate(data, 1):
                if not isinstance(item, dict):
                    raise DataFileError(f"{path} row {n}: a row must be a JSON object {{...}}, got {_kind(item)}")
            return [Row(item, f"{path} row {n}") for n, item in enumerate(data, 1)]
    rows = []
    for n, line in enumerate(_LINE_END.split(text), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{path} line {n}: not valid JSON: {err.msg} (column {err.colno})") from None
        if not isinstance(item, dict):
            raise DataFileError(f"{path} line {n}: a row must be a JSON object {{...}}, got {_kind(item)}")
        rows.append(Row(item, f"{path} line {n}"))
    return rows


def _read_csv(path: str, text: str) -> list[Row]:
    """A header line, then one record per line (quoted fields may span lines); every value is text."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] | None = None
    rows = []
    start = 1
    try:
        for record in reader:
            if record:
                if header is None:
                    header = record
                    seen = {name for name in header if header.count(name) > 1}
                    if seen:
                        raise DataFileError(f"{path} line {start}: the header names {sorted(seen)} more than once")
                elif len(record) != len(header):
                    raise DataFileError(f"{path} line {start}: {len(record)} field(s), the header has "
                                        f"{len(header)} ({header})")
                else:
                    rows.append(Row(dict(zip(header, record, strict=True)), f"{path} line {start}"))
            start = reader.line_num + 1
    except csv.Error as err:
        raise DataFileError(f"{path} line {reader.line_num}: not valid CSV: {err}") from None
    return rows


def _read_parquet(path: str) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - any reader error becomes one line naming the file
        raise DataFileError(f"{path}: not a readable Parquet file: {one_line(err)}") from None
    try:
        items = table.to_pylist()
    except UnicodeDecodeError:
        for n in range(table.num_rows):
            try:
                table.slice(n, 1).to_pylist()
            except UnicodeDecodeError:
                raise DataFileError(f"{path} row {n + 1}: a text value is not UTF-8") from None
        raise
    return [Row(item, f"{path} row {n}") for n, item in enumerate(items, 1)]


def _read_hub(name: str) -> list[Row]:
    """The rows of a hub dataset `name[:split]` (the split defaults to `train`)."""
    import datasets

    dataset, _, split = name.partition(":")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with quiet_loggers("datasets", "huggingface_hub", "fsspec"):
            table = datasets.load_dataset(dataset, split=split or "train")
    except Exception as err:  # noqa: BLE001 - any loader error becomes one line naming the dataset
        raise DataFileError(f"{name}: no such data file, and no hub dataset could be read: {one_line(err)}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    return [Row(item, f"{name} row {n}") for n, item in enumerate(table, 1)]


# --- small helpers -----------------------------------------------------------------------------------
@contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Hold back the named libraries' log lines (below CRITICAL) for the block: their error is ours to word."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (its lines joined), at most `limit` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "true/false", type(None): "null", int: "a number",
            float: "a number", dict: "an object"}.get(type(value), type(value).__name__)
