"""Reward functions: one batch protocol, run with timeouts and failure accounting.

``get_reward("dapo" | "math_verify" | "arithmetic" | "last_number" | "reasoning_gym" | obj)`` returns a reward
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
    "reasoning_gym": "dapo_lightning.tasks.reasoning_gym:ReasoningGymReward",
}


def reward_class(name: str) -> type:
    """The class of the built-in reward ``name`` (a key of :data:`REWARDS`)."""
    module, _, cls = REWARDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_reward(name_or_obj: Any, **kwargs: Any) -> Any:
    """A reward object from a name in :data:`REWARDS` (built with ``kwargs``) or a callable.

    A callable is returned as is; it needs a ``failure_score`` attribute (the score of a sample
    whose scoring fails), which defaults to -1.0 when missing. A config's
    ``{"class_path": "pkg.module.Class", "init_args": {...}}`` is imported and built (with
    ``kwargs`` added to its ``init_args``).

    Raises:
        ImportError: A ``class_path`` that does not import (names it and the import error).
        ValueError: An unknown name, or ``kwargs`` with a reward object.
        TypeError: Neither a name, a ``class_path`` nor a callable.
    """
    if isinstance(name_or_obj, dict) and "class_path" in name_or_obj:
        name_or_obj = _reward_from_class_path(name_or_obj, kwargs)
        kwargs = {}
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
            f"reward must be a name in {sorted(REWARDS)}, a {{class_path: ..., init_args: ...}} "
            f"or a callable, got {type(name_or_obj).__name__} {name_or_obj!r:.200}."
        )
    if kwargs:
        raise ValueError("reward_kwargs only apply to a reward given by name.")
    if not hasattr(name_or_obj, "failure_score"):
        with contextlib.suppress(AttributeError):  # objects with __slots__ keep the default
            name_or_obj.failure_score = -1.0
    return name_or_obj


def _reward_from_class_path(spec: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Build ``spec["class_path"](**spec["init_args"], **kwargs)``; errors name the class path."""
    path = str(spec["class_path"])
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"reward class_path {path!r} does not import ({type(err).__name__}: {err}): check "
            "the spelling, that the module is importable from where the command runs (e.g. "
            "on PYTHONPATH or pip-installed), and that it defines the class."
        ) from err
    if cls is None:
        raise ImportError(
            f"reward class_path {path!r} must be a dotted path 'package.module.Class'."
        )
    init_args = {**(spec.get("init_args") or {}), **kwargs}
    try:
        return cls(**init_args)
    except TypeError as err:
        raise TypeError(
            f"reward class_path {path!r} could not be built with init_args {init_args}: {err}."
        ) from err


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
