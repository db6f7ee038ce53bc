"""The environment protocol of multi-turn episodes and its settings.

An *episode* starts from a prompt record. The policy writes an assistant turn; the
environment's :meth:`Environment.step` reads that turn's text and answers with a
:class:`StepResult`: an observation (a tool's output or a user turn) that is appended to the
conversation before the next assistant turn, or ``done``. When the episode is done the
environment may give the reward itself (``StepResult.reward``); otherwise the run's reward
function scores the final assistant turn, as it scores a single-turn response. Tools (the
tag format, environments whose methods are tools) live in :mod:`dapo_lightning.envs.tools`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dapo_lightning.checks import check_finite
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.registry import Registry

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What an environment answers to one assistant turn.

    Args:
        observation: Text shown to the policy as the next message (tool output, a user turn);
            ignored when ``done``.
        done: The episode is over (the last assistant turn is the final answer).
        reward: The episode's reward, given with ``done``; None lets the reward function score
            the final assistant turn.
        acc: Correctness with ``reward`` (None: ``reward > 0``).
        tool_calls: Tool calls the turn made (for ``env/tool_calls_mean``).
        tool_errors: Those of them that failed (bad call, tool error; ``env/tool_error_rate``).
        metrics: The environment's own numbers for this turn, logged as ``env/<name>``: summed
            over an episode's turns, then averaged over the step's episodes. Every name must be
            declared in the environment's ``metric_names`` (so every rank logs the same names,
            zeros included).
    """

    observation: str = ""
    done: bool = False
    reward: float | None = None
    acc: bool | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def check_step_result(result: Any, metric_names: tuple[str, ...] = ()) -> StepResult:
    """``result`` if it is a well-formed :class:`StepResult` whose ``metrics`` use only
    ``metric_names``.

    Raises:
        TypeError: not a StepResult, or a field of the wrong type (what an environment that
            "returns garbage" gets; the episode runner counts it as a failed episode), or a
            metric name the environment did not declare.
        ValueError: a non-finite reward or metric.
    """
    if not isinstance(result, StepResult):
        raise TypeError(f"step() returned {type(result).__name__}, not a StepResult.")
    if not isinstance(result.observation, str) or not isinstance(result.done, bool):
        raise TypeError("StepResult.observation must be a str and StepResult.done a bool.")
    for name in ("tool_calls", "tool_errors"):
        value = getattr(result, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"StepResult.{name} must be an int >= 0, got {value!r}.")
    if result.reward is not None:
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            raise TypeError(f"StepResult.reward must be a number or None, got {result.reward!r}.")
        if not math.isfinite(result.reward):
            raise ValueError(f"StepResult.reward must be finite, got {result.reward}.")
    if not isinstance(result.metrics, Mapping):
        raise TypeError(f"StepResult.metrics must be a dict, got {result.metrics!r}.")
    for name, value in result.metrics.items():
        if name not in metric_names:
            raise TypeError(
                f"StepResult.metrics has {name!r}, which the environment does not declare: add "
                f"it to the class's metric_names (declared: {list(metric_names)})."
            )
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"StepResult.metrics[{name!r}] must be a finite number, got {value!r}."
            )
    return result


def declared_metrics(env: Any) -> tuple[str, ...]:
    """The ``metric_names`` an environment declares (its ``StepResult.metrics`` keys)."""
    names = getattr(env, "metric_names", ())
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"{type(env).__name__}.metric_names must be a tuple of names, got {names!r}."
        )
    return tuple(names)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a fresh object per episode, built by the registry).

    ``reset`` starts the episode from its prompt record; ``step`` answers every assistant
    turn. An optional class attribute ``metric_names`` (a tuple) declares the names its
    ``StepResult.metrics`` may use (logged as ``env/<name>``). Both calls may raise or hang: the episode runner calls them in a worker thread with
    ``EnvironmentConfig.call_timeout_s`` and turns a fault into a failed episode.
    """

    def reset(self, record: PromptRecord) -> None:
        """Start an episode on ``record`` (its ``prompt``, ``answer``, ``meta``)."""
        ...

    def step(self, text: str) -> StepResult:
        """Answer the assistant turn ``text`` (decoded without special tokens)."""
        ...


def _unknown_environment(field: str, name: str, names: list[str]) -> str:
    return (
        f"{field}={name!r} is neither a built-in environment nor a registered one "
        f"({names}): give one of those, or the dotted path of your class (my_pkg.module.MyEnv)."
    )


#: Environments by name (``environment.name``): classes built with ``environment.kwargs``, one
#: object per episode (a dotted path may name any class, registered or not).
ENVIRONMENTS: Registry[type] = Registry(
    "environment",
    "environment.name",
    "register_environment",
    adopt=lambda obj: isinstance(obj, type),
    unknown=_unknown_environment,
)


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator registering an environment class (:class:`Environment`: ``reset`` and
    ``step``) under ``name``, for ``data.init_args.environment.name``."""
    return ENVIRONMENTS.register(name)


@dataclass(frozen=True)
class EnvironmentConfig:
    """Which environment episodes run in, and their limits (``data.init_args.environment``).

    Args:
        name: A registered environment (:data:`ENVIRONMENTS`: ``"calculator"``, or your class
            decorated with :func:`register_environment`), or the dotted path of your own class
            (``my_pkg.envs.MyEnv``; one object per episode, built with ``kwargs``).
        kwargs: Keyword arguments of the environment's constructor.
        max_turns: Most assistant turns per episode (the last one ends it whatever it says).
        max_episode_tokens: Most tokens of prompt + all assistant turns + all observations
            (<= the engine's context). None: room for ``max_turns`` turns and their
            observations, ``prompts.max_prompt_length + sampling.max_tokens + (max_turns - 1)
            * max_observation_tokens``, lowered to the engine's context where that is less
            (said once at start). ``sampling.max_tokens`` bounds the assistant tokens of an
            episode (overlong shaping measures those). An observation that does not fit ends
            its episode as ``"length"`` (``env/observations_cut``; a warning the first time,
            with the numbers).
        max_observation_tokens: Tokens budgeted per observation for the default
            ``max_episode_tokens`` (an observation may be longer while the episode fits).
        call_timeout_s: Most seconds one ``reset`` / ``step`` call may take; a call over it
            fails the episode (``env/timeouts``).
        max_failure_frac: Largest share of one generation's episodes that may fail
            (raise, hang, return garbage) before the run stops with an error.
        observation_role: Chat role of the observation messages.
        add_instructions: Put the environment's ``instructions()`` in front of every prompt
            as a system message (a text prefix without a chat template).
        demonstrate_unsolved: In a training group with no right episode, replace its first
            episode by the environment's demonstration (``solution_turns(record)``, played through
            the same runner and scored by the same reward; ToolExpander's demonstration
            replacement), so the group has a right answer to learn from. The demonstration was
            not sampled (its ``finish_reason`` is ``"demonstration"``) and is its own behaviour policy (its
            correction weight is 1). Counted in ``env/demonstrations``. Off by default.

    Raises:
        ValueError: a setting out of range, named with the fix.
    """

    name: str = "calculator"
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_episode_tokens: int | None = None
    max_observation_tokens: int = 64
    call_timeout_s: float = 10.0
    max_failure_frac: float = 0.1
    observation_role: str = "tool"
    add_instructions: bool = True
    demonstrate_unsolved: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                "environment.name must be a built-in environment name or a dotted class path."
            )
        if self.max_turns < 1:
            raise ValueError(f"environment.max_turns must be >= 1, got {self.max_turns}.")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            raise ValueError(
                f"environment.max_episode_tokens must be >= 2 or null, got {self.max_episode_tokens}."
            )
        if self.max_observation_tokens < 1:
            raise ValueError(
                "environment.max_observation_tokens must be >= 1, got "
                f"{self.max_observation_tokens}."
            )
        check_finite("environment.call_timeout_s", self.call_timeout_s, "Give seconds > 0.")
        if not self.call_timeout_s > 0:
            raise ValueError(
                f"environment.call_timeout_s must be > 0 seconds, got {self.call_timeout_s}."
            )
        if not 0 <= self.max_failure_frac <= 1:
            raise ValueError(
                f"environment.max_failure_frac must be in [0, 1], got {self.max_failure_frac}."
            )
        if not self.observation_role:
            raise ValueError("environment.observation_role must be a chat role, e.g. 'tool'.")

    def episode_budget(self, max_prompt_length: int, max_tokens: int) -> int:
        """``max_episode_tokens``, or the default that fits ``max_turns`` turns and their
        observations: ``max_prompt_length + max_tokens + (max_turns - 1) *
        max_observation_tokens``."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return max_prompt_length + max_tokens + (self.max_turns - 1) * self.max_observation_tokens

    def within_context(self, budget: int, context: int | None) -> int:
        """The episode budget ``budget`` (:meth:`episode_budget`) within an engine's ``context``
        (:attr:`~dapo_lightning.rollout.base.RolloutEngine.max_context_tokens`; None: unknown,
        no limit): ``min(budget, context)`` when ``max_episode_tokens`` is None (the default
        budget, lowered with a warning), else ``budget``.

        Raises:
            ValueError: a set ``max_episode_tokens`` (``budget``) exceeds ``context``.
        """
        if context is None or budget <= context:
            return budget
        if self.max_episode_tokens is None:
            log.warning(
                "environment.max_episode_tokens: the default budget for %d turns (%d tokens) "
                "is over the engine's context; using %d (set it, or lower "
                "environment.max_observation_tokens / max_turns)",
                self.max_turns, budget, context,
            )  # fmt: skip
            return context
        raise ValueError(
            f"environment.max_episode_tokens={budget} exceeds the engine's context ({context} "
            "tokens): lower it (or prompts.max_prompt_length / sampling.max_tokens when it is "
            "null)."
        )
