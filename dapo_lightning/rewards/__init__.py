"""Reward functions: one batch protocol, run with timeouts and failure accounting.

``get_reward("dapo" | "math_verify" | "code_tests" | "arithmetic" | "last_number" |
"reasoning_gym" | obj)`` returns a reward object (``code_tests``: code run against the prompt's
tests in the sandbox, :mod:`dapo_lightning.rewards.code_tests`). The rewards of the built-in
tasks live with their task in :mod:`dapo_lightning.tasks` and are registered there.
Your own reward class, in your own module::

    @register_reward("exact_match")
    class ExactMatch:
        failure_score = -1.0

        def __call__(self, responses, ground_truths, **kw) -> list[RewardResult]: ...

selected by ``data.init_args.reward: exact_match`` (once its module is imported) or by its dotted
path ``my_pkg.rewards.ExactMatch`` (any reward class, registered or not), built with
``data.init_args.scoring.reward_kwargs``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dapo_lightning.registry import Registry, import_object
from dapo_lightning.rewards.base import (
    RewardFailureError,
    RewardFunction,
    RewardOutputError,
    RewardResult,
    RewardRunner,
)
from dapo_lightning.rewards.code_tests import CodeTestsReward
from dapo_lightning.rewards.dapo import DAPOAnswerReward, extract_answer_line, normalize_answer
from dapo_lightning.rewards.mathverify import MathVerifyReward


def _unknown_reward(field: str, name: str, names: list[str]) -> str:
    return (
        f"{field}={name!r} is not a built-in reward or a registered one: use one of {names}, the "
        "dotted path 'pkg.module.Class' of a reward class, or pass a reward object (a callable "
        "(responses, ground_truths, **kw) -> list[RewardResult])."
    )


#: Rewards by name: classes built with ``scoring.reward_kwargs`` (a dotted path may name any
#: class, registered or not).
REWARDS: Registry[Callable[..., Any]] = Registry(
    "reward",
    "reward",
    "register_reward",
    adopt=lambda obj: isinstance(obj, type),
    unknown=_unknown_reward,
)
REWARDS.register("dapo")(DAPOAnswerReward)
REWARDS.register("math_verify")(MathVerifyReward)
REWARDS.register("code_tests")(CodeTestsReward)


def register_reward(name: str) -> Callable[[type], type]:
    """Class decorator registering a reward class under ``name`` (built with
    ``scoring.reward_kwargs``; its ``__call__(responses, ground_truths, **kw)`` returns one
    :class:`RewardResult` per response)."""
    return REWARDS.register(name)


def reward_class(name: str) -> type:
    """The class of the reward ``name`` (registered, or a dotted path)."""
    return REWARDS.get(name).fn


def get_reward(name_or_obj: Any, **kwargs: Any) -> Any:
    """A reward object from a name or dotted path of :data:`REWARDS` (built with ``kwargs``) or
    a callable.

    A callable is returned as is; it needs a ``failure_score`` attribute (the score of a sample
    whose scoring fails), which defaults to -1.0 when missing. A config's
    ``{"class_path": "pkg.module.Class", "init_args": {...}}`` is imported and built (with
    ``kwargs`` added to its ``init_args``).

    Raises:
        ImportError: A ``class_path`` or dotted path that does not import (names it and the
            import error; a :class:`~dapo_lightning.registry.ImportPathError`).
        ValueError: An unknown name, or ``kwargs`` with a reward object.
        TypeError: Neither a name, a ``class_path`` nor a callable.
    """
    if isinstance(name_or_obj, dict) and "class_path" in name_or_obj:
        name_or_obj = _reward_from_class_path(name_or_obj, kwargs)
        kwargs = {}
    if isinstance(name_or_obj, str):
        return reward_class(name_or_obj)(**kwargs)
    if not callable(name_or_obj):
        raise TypeError(
            f"reward must be a name in {REWARDS.names()}, a {{class_path: ..., init_args: ...}} "
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
    cls = import_object(path, "reward class_path")
    init_args = {**(spec.get("init_args") or {}), **kwargs}
    try:
        return cls(**init_args)
    except TypeError as err:
        raise TypeError(
            f"reward class_path {path!r} could not be built with init_args {init_args}: {err}."
        ) from err


__all__ = [
    "REWARDS",
    "CodeTestsReward",
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
    "register_reward",
    "reward_class",
]
