"""Tasks: each supplies a tokenizer, rows and the decoding-side evaluation (`data.tasks.base.Task`).

`TASKS` maps the config's `task.name` to the `Task` class that implements it. A task module registers its
class with `register_task`; the built-in tasks' modules are imported only when their task is first looked up,
and a task of one's own registers itself when its module is imported::

    from data.tasks import Task, register_task

    @register_task("my_task")
    class MyTask(Task):
        config_class = MyTaskConfig
        ...
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from data.tasks.base import (
    EVAL_SPLITS,
    REG_DATA_CHOICES,
    SPLITS,
    Expert,
    Task,
    TaskError,
    check_split,
)

TaskT = TypeVar("TaskT", bound=type[Task])


class TaskRegistry(Mapping[str, type[Task]]):
    """Task classes by name. Built-in names map to the module that registers them, imported on first lookup;
    names and membership (`in`, iteration) never import a module.

    Args:
        builtin: built-in task name -> the module whose import registers it.
    """

    def __init__(self, builtin: Mapping[str, str]) -> None:
        self._modules = dict(builtin)
        self._classes: dict[str, type[Task]] = {}

    def register(self, name: str, cls: type[Task]) -> None:
        """Register `cls` as task `name`; `TaskError` if the name is taken by another class."""
        if not isinstance(name, str) or not name:
            raise TaskError(f"a task name must be a non-empty string, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TaskError(f"task {name!r}: {cls!r} is not a subclass of data.tasks.Task")
        home = self._modules.get(name)
        if home is not None and cls.__module__ != home and not cls.__module__.startswith(home + "."):
            raise TaskError(f"task name {name!r} belongs to the built-in task in {home}; choose another name "
                            f"for {_qualified(cls)}")
        old = self._classes.get(name)
        if old is not None and _qualified(old) != _qualified(cls):
            raise TaskError(f"task name {name!r} is already registered to {_qualified(old)}")
        self._classes[name] = cls

    def __getitem__(self, name: str) -> type[Task]:
        if name not in self._classes and name in self._modules:
            importlib.import_module(self._modules[name])
        return self._classes[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._modules or name in self._classes)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._modules, *self._classes]))

    def __len__(self) -> int:
        return len(self._modules.keys() | self._classes.keys())

    def __repr__(self) -> str:
        return f"TaskRegistry({', '.join(self)})"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


TASKS = TaskRegistry({
    "letters": "data.tasks.letters",
    "intervals": "data.tasks.intervals",
    "text": "data.tasks.text",
    "features": "data.tasks.features",
})
"""Every task by `task.name`: the built-ins, then any registered with `register_task`."""


def register_task(name: str) -> Callable[[TaskT], TaskT]:
    """Class decorator: register a `Task` subclass as `task.name=name` (and set its `name` to it).
    `TaskError` if the name is taken by another class."""

    def register(cls: TaskT) -> TaskT:
        declared = cls.__dict__.get("name", name) if isinstance(cls, type) else name
        if declared != name:
            raise TaskError(f"{_qualified(cls)} declares name {declared!r} but registers as {name!r}")
        TASKS.register(name, cls)
        cls.name = name
        return cls

    return register


def task_class(name: str) -> type[Task]:
    """The `Task` subclass registered as `name`; `TaskError` naming it and the known tasks if there is none."""
    if name not in TASKS:
        raise TaskError(f"task.name={name!r} is not one of {', '.join(TASKS)}")
    return TASKS[name]


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


__all__ = ["EVAL_SPLITS", "REG_DATA_CHOICES", "SPLITS", "TASKS", "Expert", "Task", "TaskError", "TaskRegistry",
           "check_split", "register_task", "settings_from_node", "settings_node", "task_class"]
