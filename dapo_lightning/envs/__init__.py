"""Multi-turn episodes: environments, tools, and the runner that turns episodes into rollouts.

* :mod:`dapo_lightning.envs.base`: the :class:`Environment` protocol, :class:`StepResult`,
  :class:`EnvironmentConfig` (``data.kwargs.environment``), the tool-call tag format and
  :class:`ToolEnvironment`;
* :mod:`dapo_lightning.envs.calculator`: the built-in ``calculator`` environment;
* :mod:`dapo_lightning.envs.runner`: :class:`EpisodeRunner`, an engine that runs episodes;
* :mod:`dapo_lightning.envs.session`: the engine session and prompt instructions the data
  module uses.

Your own environment: a class with ``reset(record)`` and ``step(text) -> StepResult`` (or a
:class:`ToolEnvironment` with ``tools``), named by its dotted path in
``environment.name``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dapo_lightning.envs.base import (
    Environment,
    EnvironmentConfig,
    StepResult,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    parse_tool_calls,
)
from dapo_lightning.envs.calculator import CalculatorEnvironment, CalculatorError, evaluate
from dapo_lightning.envs.runner import (
    EnvironmentFailureError,
    Episode,
    EpisodeRunner,
    ObservationFormatter,
    environment_class,
)
from dapo_lightning.envs.session import EpisodeSession, with_instructions

#: Built-in environments by name (``environment.name``).
ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnvironment}


def environment_factory(config: EnvironmentConfig) -> Callable[[], Any]:
    """A function building one episode's environment from ``config`` (name or class path,
    ``kwargs``).

    Raises:
        ValueError: an unknown name, or constructor arguments the class does not take.
    """
    cls = environment_class(config.name, ENVIRONMENTS)
    kwargs = dict(config.kwargs)
    try:
        cls(**kwargs)
    except TypeError as err:
        raise ValueError(
            f"environment {config.name!r} cannot be built with kwargs={kwargs}: {err}."
        ) from err
    return lambda: cls(**kwargs)


__all__ = [
    "ENVIRONMENTS",
    "CalculatorEnvironment",
    "CalculatorError",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentFailureError",
    "Episode",
    "EpisodeRunner",
    "EpisodeSession",
    "ObservationFormatter",
    "StepResult",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "environment_class",
    "environment_factory",
    "evaluate",
    "parse_tool_calls",
    "with_instructions",
]
