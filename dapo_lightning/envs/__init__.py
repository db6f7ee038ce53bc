"""Multi-turn episodes: environments, tools, and the runner that turns episodes into rollouts.

* :mod:`dapo_lightning.envs.base`: the :class:`Environment` protocol, :class:`StepResult`,
  :class:`EnvironmentConfig` (``data.init_args.environment``) and :data:`ENVIRONMENTS` (the
  environments by name);
* :mod:`dapo_lightning.envs.tools`: the tool-call tag format and :class:`ToolEnvironment`,
  an environment whose public typed methods are its tools;
* :mod:`dapo_lightning.envs.calculator`: the built-in ``calculator`` environment;
* :mod:`dapo_lightning.envs.arithmetic`: the built-in ``arithmetic`` environment (binary tools);
* :mod:`dapo_lightning.envs.python_tool`: the built-in ``python`` environment (code run in the
  sandbox, :mod:`dapo_lightning.sandbox`);
* :mod:`dapo_lightning.envs.runner`: :class:`EpisodeRunner`, an engine that runs episodes;
* :mod:`dapo_lightning.envs.calls`: every environment call (its constructor included) under
  ``call_timeout_s`` and the stop checks;
* :mod:`dapo_lightning.envs.session`: the engine session and prompt instructions the data
  module uses.

Your own environment: a class with ``reset(record)`` and ``step(text) -> StepResult`` (or a
:class:`ToolEnvironment` subclass whose public methods are the tools), named in
``data.init_args.environment.name`` by its dotted path, or by the name it is registered under
with :func:`register_environment` (once its module is imported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dapo_lightning.envs.arithmetic import ArithmeticEnvironment, plan_calls
from dapo_lightning.envs.base import (
    ENVIRONMENTS,
    Environment,
    EnvironmentConfig,
    StepResult,
    register_environment,
)
from dapo_lightning.envs.calculator import CalculatorEnvironment, CalculatorError, evaluate
from dapo_lightning.envs.calls import build_environment
from dapo_lightning.envs.python_tool import PythonToolEnvironment
from dapo_lightning.envs.runner import (
    EnvironmentFailureError,
    Episode,
    EpisodeRunner,
    ObservationFormatter,
)
from dapo_lightning.envs.session import (
    EpisodeSession,
    introduce_tools,
    prompt_tools,
    unsolved_demonstrations,
    with_instructions,
)
from dapo_lightning.envs.tools import (
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    parse_tool_calls,
    template_renders_tools,
)


def environment_class(name: str) -> type:
    """The environment class registered as ``name``, or at the dotted path ``name``.

    Raises:
        ValueError: neither (the message lists the registered names).
        ImportError: a dotted path that does not import.
    """
    return ENVIRONMENTS.get(name).fn


def environment_factory(config: EnvironmentConfig) -> Callable[[], Any]:
    """A function building one episode's environment from ``config`` (name or class path,
    ``kwargs``), under ``config.call_timeout_s`` and the stop checks
    (:func:`~dapo_lightning.envs.calls.build_environment`); one is built here, as a check.

    Raises:
        ValueError: an unknown name, or constructor arguments the class does not take.
        EnvironmentFailureError: the constructor ran over ``call_timeout_s``.
    """
    cls = environment_class(config.name)
    kwargs = dict(config.kwargs)

    def make() -> Any:
        return build_environment(lambda: cls(**kwargs), config.call_timeout_s, config.name)

    try:
        make()
    except TypeError as err:
        raise ValueError(
            f"environment {config.name!r} cannot be built with kwargs={kwargs}: {err}."
        ) from err
    return make


__all__ = [
    "ENVIRONMENTS",
    "ArithmeticEnvironment",
    "CalculatorEnvironment",
    "CalculatorError",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentFailureError",
    "Episode",
    "EpisodeRunner",
    "EpisodeSession",
    "ObservationFormatter",
    "PythonToolEnvironment",
    "StepResult",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "environment_class",
    "environment_factory",
    "evaluate",
    "introduce_tools",
    "parse_tool_calls",
    "plan_calls",
    "prompt_tools",
    "register_environment",
    "template_renders_tools",
    "unsolved_demonstrations",
    "with_instructions",
]
