"""Reward functions: one batch protocol, run with timeouts and failure accounting.

``get_reward("dapo" | "math_verify" | "arithmetic" | "last_number" | obj)`` returns a reward
object. The rewards of the built-in tasks live with their task in :mod:`dapo_lightning.tasks`.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from dapo_lightning.rewards.base import (
    RewardFailureError,
    RewardFunction,
    RewardOutputError,
    RewardResult,
    RewardRunner,
)
from dapo_lightning.rewards.dapo import DAPOAnswerReward, extract_answer_line, normalize_answer
from dapo_lightning.rewards.mathverify import MathVerifyReward

#: Built-in rewards by name, as ``"module:class"``: imported when asked for, because the task
#: modules that define some of them import this package.
REWARDS: dict[str, str] = {
    "dapo": "dapo_lightning.rewards.dapo:DAPOAnswerReward",
    "math_verify": "dapo_lightning.rewards.mathverify:MathVerifyReward",
    "arithmetic": "dapo_lightning.tasks.arithmetic:ArithmeticReward",
    "last_number": "dapo_lightning.tasks.word_problems:LastNumberReward",
}


def reward_class(name: str) -> type:
    """The class of the built-in reward ``name`` (a key of :data:`REWARDS`)."""
    module, _, cls = REWARDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_reward(name_or_obj: Any, **kwargs: Any) -> Any:
    """A reward object from a name in :data:`REWARDS` (built with ``kwargs``) or a callable.

    A callable is returned as is; it needs a ``failure_score`` attribute (the score of a sample
    whose scoring fails), which defaults to -1.0 when missing.
    """
    if isinstance(name_or_obj, str):
        if name_or_obj not in REWARDS:
            raise ValueError(
                f"reward={name_or_obj!r} is not a built-in reward: use one of "
                f"{sorted(REWARDS)} or pass a reward object (a callable "
                "(responses, ground_truths, **kw) -> list[RewardResult])."
            )
        return reward_class(name_or_obj)(**kwargs)
    if not callable(name_or_obj):
        raise TypeError(
            f"reward must be a name in {sorted(REWARDS)} or a callable, got "
            f"{type(name_or_obj).__name__}."
        )
    if kwargs:
        raise ValueError("reward_kwargs only apply to a reward given by name.")
    if not hasattr(name_or_obj, "failure_score"):
        with contextlib.suppress(AttributeError):  # objects with __slots__ keep the default
            name_or_obj.failure_score = -1.0
    return name_or_obj


__all__ = [
    "REWARDS",
    "DAPOAnswerReward",
    "MathVerifyReward",
    "RewardFailureError",
    "RewardFunction",
    "RewardOutputError",
    "RewardResult",
    "RewardRunner",
    "extract_answer_line",
    "get_reward",
    "normalize_answer",
    "reward_class",
]
