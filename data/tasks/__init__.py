"""Tasks: each supplies a tokenizer, rows and the decoding-side evaluation (`data.tasks.base.Task`).

`TASKS` maps the config's `task.name` to the module and class that implement it; modules are imported
only when their task is used.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from data.tasks.base import EVAL_SPLITS, REG_DATA_CHOICES, SPLITS, Expert, Task, TaskError

TASKS: dict[str, str] = {
    "letters": "data.tasks.letters:LettersTask",
    "intervals": "data.tasks.intervals:IntervalsTask",
    "text": "data.tasks.text:TextTask",
    "features": "data.tasks.features:FeaturesTask",
}


def task_class(name: str) -> type[Task]:
    """The `Task` subclass registered as `name`."""
    if name not in TASKS:
        raise TaskError(f"task.name={name!r} is not one of {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def settings_node(task: Task) -> dict[str, Any]:
    """The task's settings as its `task:` config node: `{"name": ..., **settings}` (plain data, e.g. for an
    export's manifest, so the task can be rebuilt without the run's config)."""
    return {"name": task.name, **dataclasses.asdict(task.cfg)}


def settings_from_node(node: Mapping[str, Any]) -> Any:
    """The settings object (an instance of the task's `config_class`) of a `task:` node, as `settings_node`
    writes it; raises `TaskError` naming an unknown task or key."""
    settings = dict(node)
    name = settings.pop("name", None)
    cls = task_class(name).config_class
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TaskError(f"task.{unknown[0]} is not a setting of the {name!r} task (it has {', '.join(sorted(known))})")
    try:
        return cls(**settings)
    except TypeError as e:
        raise TaskError(f"task settings of the {name!r} task: {e}") from None


__all__ = ["EVAL_SPLITS", "REG_DATA_CHOICES", "SPLITS", "TASKS", "Expert", "Task", "TaskError", "settings_from_node",
           "settings_node", "task_class"]
