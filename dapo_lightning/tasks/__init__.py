"""Tasks: generated problems and the reward they are scored with, by name.

``get_task("arithmetic").make_rows(seed=0, **task_kwargs)`` returns rows with ``prompt``,
``answer`` and ``uid`` fields (read with ``FieldMap("prompt", "answer", "uid", None)``); the
task's :attr:`Task.reward` names the reward (registered in
:data:`dapo_lightning.rewards.REWARDS`) that scores it by default. :mod:`dapo_lightning.tasks.base`
holds :class:`Task` and the table; your own task is a function decorated with
:func:`register_task` in your own module.

One module per built-in task holds its problems and its reward, each registered there:

* :mod:`dapo_lightning.tasks.arithmetic`: ``"3+4="`` by difficulty level; strict exact-answer
  reward. Its quickstart warm-up checkpoint is in :mod:`dapo_lightning.tasks.arithmetic_warmup`.
* :mod:`dapo_lightning.tasks.word_problems`: two-step word problems as chat messages, scored by
  the last number of the response.
* :mod:`dapo_lightning.tasks.reasoning_gym`: the ``reasoning-gym`` package's procedural datasets
  (the ``tasks`` extra), scored by each dataset's own ``score_answer``; its rows carry their
  ``split`` (held-out problems from another seed) and the scorer's entry (``reward_kwargs``).
* :mod:`dapo_lightning.tasks.code_functions`: generated "write f(x) that ..." problems with
  unit tests, scored by the ``code_tests`` reward in the sandbox; held-out problems too.
"""

from __future__ import annotations

from dapo_lightning.tasks.arithmetic import ArithmeticReward, make_arithmetic_rows
from dapo_lightning.tasks.base import TASKS, Task, get_task, register_task
from dapo_lightning.tasks.code_functions import make_code_function_rows
from dapo_lightning.tasks.reasoning_gym import ReasoningGymReward, make_reasoning_gym_rows
from dapo_lightning.tasks.word_problems import LastNumberReward, make_word_problem_rows

__all__ = [
    "TASKS",
    "ArithmeticReward",
    "LastNumberReward",
    "ReasoningGymReward",
    "Task",
    "get_task",
    "make_arithmetic_rows",
    "make_code_function_rows",
    "make_reasoning_gym_rows",
    "make_word_problem_rows",
    "register_task",
]
