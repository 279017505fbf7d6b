"""The worked examples of docs/extending/ run as written: every ```python block of a page, in order, in one
namespace, from the repository root (what a reader pasting them into one session would do)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["new_divergence.md", "new_task.md", "new_model.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.fixture
def registries():
    """The pages register a task and a divergence: put both registries back afterwards, so the rest of the suite
    sees only the built-in names."""
    from data.tasks import TASKS
    from losses.divergences import DIVERGENCES

    tasks, divergences = set(TASKS), set(DIVERGENCES)
    yield
    for name in set(TASKS) - tasks:  # built-in tasks loaded meanwhile stay registered
        TASKS._classes.pop(name, None)
    for name in set(DIVERGENCES) - divergences:
        del DIVERGENCES[name]


@pytest.mark.parametrize("page", PAGES)
def test_extending_page_runs(page, monkeypatch, registries):
    blocks = python_blocks(ROOT / "docs" / "extending" / page)
    assert len(blocks) >= 3, f"{page}: expected a worked example in several python blocks"
    monkeypatch.chdir(ROOT)
    module = types.ModuleType(f"docs_example_{Path(page).stem}")  # a real module: dataclasses and pickling need one
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(blocks):
        code = compile(block, f"docs/extending/{page} (python block {i + 1})", "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102
