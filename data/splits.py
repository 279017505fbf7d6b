"""Seeded, disjoint splits for synthetic tasks. No Lightning here."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from `seed` and labels, stable across processes (unlike `hash`)."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def draw_excluding(make: Callable[[int], list[str]], n: int, exclude: set[str], what: str,
                   max_attempts: int = 20) -> list[str]:
    """`n` strings from `make(0), make(1), ...` that are not in `exclude`.

    If the string space is too small for that, warns and lets the split overlap `exclude`.
    """
    out = [x for x in make(0) if x not in exclude]
    attempt = 1
    while len(out) < n and attempt <= max_attempts:
        out += [x for x in make(attempt) if x not in exclude]
        attempt += 1
    if len(out) < n:
        warnings.warn(f"{what}: could not draw {n} inputs disjoint from the earlier splits (string space too "
                      f"small for the lengths and alphabet); the split overlaps them", stacklevel=3)
        out += make(0)[: n - len(out)]
    return out[:n]
