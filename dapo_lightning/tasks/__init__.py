"""Built-in tasks: generated problems, the reward they are scored with, by name.

``get_task("arithmetic").make_rows(seed=0, **task_kwargs)`` returns rows with ``prompt``,
``answer`` and ``uid`` fields (read with ``FieldMap("prompt", "answer", "uid", None)``); the
task's :attr:`Task.reward` names the reward (a key of
:data:`dapo_lightning.rewards.REWARDS`) that scores it by default.

One module per task holds its problems and its reward:

* :mod:`dapo_lightning.tasks.arithmetic`: ``"3+4="`` by difficulty level; strict exact-answer
  reward. Its quickstart warm-up checkpoint is in :mod:`dapo_lightning.tasks.arithmetic_warmup`.
* :mod:`dapo_lightning.tasks.word_problems`: two-step word problems as chat messages, scored by
  the last number of the response.
* :mod:`dapo_lightning.tasks.reasoning_gym`: the ``reasoning-gym`` package's procedural datasets
  (the ``tasks`` extra), scored by each dataset's own ``score_answer``; its rows carry their
  ``split`` (held-out problems from another seed) and the scorer's entry (``reward_kwargs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_lightning.tasks.arithmetic import ArithmeticReward, make_arithmetic_rows
from dapo_lightning.tasks.reasoning_gym import (
    ReasoningGymReward,
    check_task_kwargs,
    make_reasoning_gym_rows,
)
from dapo_lightning.tasks.word_problems import LastNumberReward, make_word_problem_rows


@dataclass(frozen=True)
class Task:
    """A built-in task.

    Args:
        name: The name ``task=`` takes.
        make_rows: ``make_rows(seed=..., **task_kwargs)`` -> rows with ``prompt``, ``answer``
            and ``uid`` fields.
        reward: The reward name it is scored with by default (a key of
            :data:`dapo_lightning.rewards.REWARDS`).
        description: One line for error messages and listings.
        check: ``check(**task_kwargs)`` raises ValueError for options ``make_rows`` would
            reject, without generating anything (the data module calls it when it is built);
            None: none.
    """

    name: str
    make_rows: Callable[..., list[dict[str, Any]]]
    reward: str
    description: str
    check: Callable[..., None] | None = None


#: Built-in tasks by name.
TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        make_rows=make_arithmetic_rows,
        reward="arithmetic",
        description="'a+b=' problems by difficulty level; plain-text prompts, exact answer",
    ),
    "word_problems": Task(
        name="word_problems",
        make_rows=make_word_problem_rows,
        reward="last_number",
        description="two-step word problems, numbers 1-10, chat prompts; last number scored",
    ),
    "reasoning_gym": Task(
        name="reasoning_gym",
        make_rows=make_reasoning_gym_rows,
        reward="reasoning_gym",
        description="reasoning-gym datasets or a weighted mix (tasks extra); their own scorer",
        check=check_task_kwargs,
    ),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``.

    Args:
        name: A key of :data:`TASKS`.

    Returns:
        The :class:`Task`.

    Raises:
        ValueError: ``name`` is not a built-in task (the message lists them).

    Example::

        rows = get_task("word_problems").make_rows(seed=0, num_prompts=64)
    """
    if name not in TASKS:
        known = "; ".join(f"{t.name!r} ({t.description})" for t in TASKS.values())
        raise ValueError(
            f"task={name!r} is not a built-in task: use one of {known}, or give prompt files "
            "(train_files) instead."
        )
    return TASKS[name]


__all__ = [
    "TASKS",
    "ArithmeticReward",
    "LastNumberReward",
    "ReasoningGymReward",
    "Task",
    "get_task",
    "make_arithmetic_rows",
    "make_reasoning_gym_rows",
    "make_word_problem_rows",
]
