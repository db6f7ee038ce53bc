"""What a task is, and the table of tasks by name (:func:`register_task` fills it).

A task is a problem generator and the reward it is scored with. Your own, in your own module::

    @register_task("my_sums", reward="my_reward", description="sums of three numbers")
    def make_my_sums(seed: int = 0, num_prompts: int = 64) -> list[dict]:
        return [{"prompt": ..., "answer": ..., "uid": ...} for ...]

selected by ``data.init_args.prompts.task: my_sums`` (once its module is imported) or by the dotted path
``my_pkg.tasks.make_my_sums``, with ``data.init_args.task_kwargs`` passed to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_lightning.registry import Registry

#: ``make_rows(seed=..., **task_kwargs)`` -> rows with ``prompt``, ``answer``, ``uid`` fields.
MakeRows = Callable[..., list[dict[str, Any]]]


@dataclass(frozen=True)
class Task:
    """A task.

    Args:
        name: The name ``task=`` takes.
        make_rows: ``make_rows(seed=..., **task_kwargs)`` -> rows with ``prompt``, ``answer``
            and ``uid`` fields.
        reward: The reward it is scored with by default (a name or dotted path of
            :data:`dapo_lightning.rewards.REWARDS`).
        description: One line for error messages and listings.
        check: ``check(**task_kwargs)`` raises ValueError for options ``make_rows`` would
            reject, without generating anything (the data module calls it when it is built);
            None: none.
    """

    name: str
    make_rows: MakeRows
    reward: str
    description: str
    check: Callable[..., None] | None = None


def _unknown_task(field: str, name: str, names: list[str]) -> str:
    known = "; ".join(f"{t.name!r} ({t.description})" for t in map(get_task, names))
    return (
        f"{field}={name!r} is not a built-in task or a registered one: use one of {known}; the "
        "dotted path of a function decorated with @register_task; or give prompt files "
        "(train_files) instead."
    )


#: Tasks by name: their ``make_rows`` functions, with ``reward``, ``description`` and ``check``.
TASKS: Registry[MakeRows] = Registry("task", "task", "register_task", unknown=_unknown_task)


def register_task(
    name: str,
    *,
    reward: str,
    description: str = "",
    check: Callable[..., None] | None = None,
) -> Callable[[MakeRows], MakeRows]:
    """Decorator registering a problem generator ``make_rows(seed=..., **task_kwargs)`` as the
    task ``name``, scored by default with the reward ``reward`` (see :class:`Task`)."""
    return TASKS.register(name, reward=reward, description=description, check=check)


def get_task(name: str) -> Task:
    """The task called ``name`` (or decorated at the dotted path ``name``).

    Raises:
        ValueError: ``name`` is neither (the message lists the tasks).
        ImportError: a dotted path that does not import.

    Example::

        rows = get_task("word_problems").make_rows(seed=0, num_prompts=64)
    """
    entry = TASKS.get(name)
    if "reward" not in entry.traits:
        raise ValueError(f"task={name!r} is not decorated with @register_task(..., reward=...).")
    return Task(
        name=entry.name,
        make_rows=entry.fn,
        reward=entry.traits["reward"],
        description=entry.traits["description"],
        check=entry.traits["check"],
    )
