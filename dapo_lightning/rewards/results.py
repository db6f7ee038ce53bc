"""What a reward returns, how its output is checked, and the errors of scoring.

A reward function is a batch call::

    reward(responses: list[str], ground_truths: list[str], **kw) -> list[RewardResult]

:func:`check_reward_output` validates what it returned; a wrong count, a non-finite score or a
field of the wrong type is a bug of the reward, not a failed sample: :class:`RewardOutputError`
(a :class:`~dapo_lightning.checks.ConfigError`: the CLI prints it as one ``error:`` line and exits
with status 2). A sample whose scoring raised, timed out or killed its worker gets
:func:`failure_result`; too many of them in one round raise :class:`RewardFailureError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dapo_lightning.checks import ConfigError


@dataclass
class RewardResult:
    """The reward of one response.

    Args:
        score: The raw reward (the DAPO rule: +1 correct, -1 wrong).
        acc: True when the answer is correct (what the dynamic-sampling filter uses by default).
        extra: Free-form information; always has ``has_answer`` (a parseable answer was found).
    """

    score: float
    acc: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.extra.setdefault("has_answer", False)


@runtime_checkable
class RewardFunction(Protocol):
    """What a reward is: a batch callable (picklable when it runs in worker processes)."""

    #: Score given to a sample whose scoring raised or timed out.
    failure_score: float

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]: ...


class RewardFailureError(RuntimeError):
    """Too many samples of one round failed to score."""


class RewardOutputError(ConfigError):
    """The reward function returned something that is not a valid reward list (a bug of the
    reward: the message names it, the position and the fix)."""


#: Where a reward is set in the config (the start of every :class:`RewardOutputError`).
REWARD_FIELD = "data.reward"


def check_reward_output(results: Any, expected: int, reward: Any) -> list[RewardResult]:
    """Validate a reward's output: a list of ``expected`` RewardResults with finite scores and
    boolean ``acc``; raises :class:`RewardOutputError` naming the reward and the fix."""
    name = f"{REWARD_FIELD}: reward {type(reward).__name__}"
    if not isinstance(results, (list, tuple)) or len(results) != expected:
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise RewardOutputError(
            f"{name} returned {got} results for {expected} responses: a reward must "
            "return one RewardResult per response, in order."
        )
    for i, r in enumerate(results):
        if not isinstance(r, RewardResult):
            raise RewardOutputError(
                f"{name} returned a {type(r).__name__} at position {i}: return "
                "RewardResult(score=..., acc=..., extra={...})."
            )
        score = _as_float(r.score)
        if score is None:
            raise RewardOutputError(
                f"{name} returned RewardResult(score={r.score!r}) at position {i}: the "
                f"field score must be a number (a {type(r.score).__name__} is not); return "
                "a float, e.g. 1.0 for a right answer and -1.0 for a wrong one."
            )
        if not math.isfinite(score):
            raise RewardOutputError(
                f"{name} returned score={r.score} at position {i}: scores must be finite "
                "floats (a NaN or inf reward would poison the advantages); fix the reward to "
                "return a finite score, e.g. its failure_score for a response it cannot judge."
            )
        if isinstance(r.acc, (str, bytes)) or r.acc not in (True, False):
            raise RewardOutputError(
                f"{name} returned RewardResult(acc={r.acc!r}) at position {i}: the field "
                "acc must be True or False (is the answer right?)."
            )
    return list(results)


def _as_float(value: Any) -> float | None:
    """``float(value)`` for a number (Python, NumPy or a one-element tensor); None otherwise."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def failure_result(reward: Any, reason: str) -> RewardResult:
    """The result of a sample whose scoring failed (``reason``: "timeout" or the error text)."""
    return RewardResult(
        score=float(getattr(reward, "failure_score", -1.0)),
        acc=False,
        extra={"has_answer": False, "reward_failure": reason},
    )
