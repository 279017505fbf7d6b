"""Tasks: each supplies a tokenizer, rows and the decoding-side evaluation (`data.tasks.base.Task`).

`TASKS` maps the config's `task.name` to the module and class that implement it; modules are imported
only when their task is used.
"""

from __future__ import annotations

import importlib

from data.tasks.base import EVAL_SPLITS, REG_DATA_CHOICES, SPLITS, Expert, Task, TaskError

TASKS: dict[str, str] = {
    "letters": "data.tasks.letters:LettersTask",
    "intervals": "data.tasks.intervals:IntervalsTask",
    "text": "data.tasks.text:TextTask",
}


def task_class(name: str) -> type[Task]:
    """The `Task` subclass registered as `name`."""
    if name not in TASKS:
        raise TaskError(f"task.name={name!r} is not one of {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["EVAL_SPLITS", "REG_DATA_CHOICES", "SPLITS", "TASKS", "Expert", "Task", "TaskError", "task_class"]
