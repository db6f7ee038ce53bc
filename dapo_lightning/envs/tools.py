"""Tools: the tag format of tool calls, and environments whose public methods are the tools.

Tool calls are written in one documented tag format, the Hermes / Qwen2.5 one (what Qwen2.5's
chat template asks a model for when it is given ``tools=``)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>

:func:`parse_tool_calls` reads them from a turn's text. A :class:`ToolEnvironment` declares
its tools as public methods with type hints and a Google-style docstring (a description, and
an ``Args:`` line per parameter); the class is the environment (``reset``, ``step``, and an
optional ``reward``)::

    class Shop(ToolEnvironment):
        def price(self, item: str) -> str:
            \"\"\"The price of an item, in cents.

            Args:
                item: The item's name.
            \"\"\"
            return str(PRICES[item])

Each method's JSON schema (:meth:`ToolEnvironment.tool_schemas`, the form chat templates take
as ``tools=``) comes from its signature and docstring (transformers' ``get_json_schema``);
a call's arguments are checked against it (names and JSON types), and a bad call, an unknown
tool or a tool that raises answers ``error: <message>`` (a tool error; the episode goes on).
Prompts tell the policy about the tools in one of two ways: where the tokenizer's chat template
renders tools in this tag format (its text mentions ``<tool_call>``, as Qwen2.5's does), the
prompts are rendered with ``tools=`` (:func:`template_renders_tools`); otherwise
:meth:`ToolEnvironment.instructions` (the schemas and the tag format) is a system message in
front of every prompt. Neither the tiny test tokenizer's ChatML template nor
SmolLM2-135M-Instruct's has a tool section, so they get the instructions.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dapo_lightning.checks import ConfigError
from dapo_lightning.envs.base import StepResult
from dapo_lightning.prompts import PromptRecord


class ToolCallError(ValueError):
    """A tool call that cannot be run (bad JSON, unknown tool, bad arguments)."""


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The tool calls of ``text`` in the tag format, in order.

    Each ``<tool_call>BODY</tool_call>`` must hold a JSON object
    ``{"name": str, "arguments": object}``; one that does not is returned as a
    :class:`ToolCallError` in its place (the environment reports it to the policy).
    """
    out: list[ToolCall | ToolCallError] = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as err:
            out.append(ToolCallError(f"the tool call is not valid JSON ({err.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(ToolCallError('a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            out.append(ToolCallError("the tool call's arguments must be a JSON object"))
            continue
        out.append(ToolCall(call["name"], arguments))
    return out


#: A tool: keyword arguments in, text (or a number) out; it raises to report an error.
Tool = Callable[..., Any]

#: JSON schema types -> the Python values of a JSON argument that match them.
JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Check a call's ``arguments`` against a tool's JSON ``schema`` (``{"type": "function",
    "function": {"name", "parameters": {"properties", "required"}}}``): every name declared,
    every required one given, each of its declared JSON type(s).

    Raises:
        ToolCallError: the first mismatch, in words the policy is shown.
    """
    function = schema["function"]
    name, parameters = function["name"], function.get("parameters", {})
    properties = parameters.get("properties", {})
    for key in arguments:
        if key not in properties:
            raise ToolCallError(f"{name}() has no argument {key!r} (arguments: {list(properties)})")
    missing = [key for key in parameters.get("required", []) if key not in arguments]
    if missing:
        raise ToolCallError(f"{name}() needs the argument(s) {missing}")
    for key, value in arguments.items():
        declared = properties[key].get("type")
        kinds = [declared] if isinstance(declared, str) else list(declared or [])
        known = [k for k in kinds if k in JSON_TYPES]
        if known and not any(JSON_TYPES[k](value) for k in known):
            raise ToolCallError(
                f"{name}() argument {key!r} must be {' or '.join(known)}, got {json.dumps(value)}"
            )


def tool_text(name: str, result: Any) -> str:
    """A tool's result as the observation text: text as it is, a finite number printed."""
    if isinstance(result, str):
        return result
    if isinstance(result, (int, float)) and not isinstance(result, bool) and math.isfinite(result):
        return str(result)
    raise TypeError(f"tool {name!r} returned {type(result).__name__}, not text or a number")


class _Unbound:
    """Stands in for ``self`` when a method's schema is read from its class."""


@functools.cache
def method_tool_schemas(cls: type) -> dict[str, dict[str, Any]]:
    """The JSON schemas of ``cls``'s tool methods (:func:`tool_method_names`), by name.

    Raises:
        ConfigError: a method without a type hint or a docstring entry for a parameter.
    """
    from transformers.utils import get_json_schema

    schemas = {}
    for name in tool_method_names(cls):
        try:
            schemas[name] = get_json_schema(types.MethodType(getattr(cls, name), _Unbound()))
        except Exception as err:  # transformers' DocstringParsing / TypeHintParsing errors
            raise ConfigError(
                f"environment tool {cls.__name__}.{name}: {err}. A tool method needs a type "
                "hint on every parameter and a docstring with a description and an 'Args:' "
                "line per parameter (or rename it with a leading underscore: not a tool)."
            ) from err
    return schemas


def tool_method_names(cls: type) -> list[str]:
    """The public methods ``cls`` adds to :class:`ToolEnvironment`: its tools, sorted."""
    base = set(dir(ToolEnvironment))
    names = []
    for name in dir(cls):
        if name.startswith("_") or name in base:
            continue
        if isinstance(inspect.getattr_static(cls, name), types.FunctionType):
            names.append(name)  # not a static or class method, a property or a value
    return sorted(names)


class ToolEnvironment:
    """An environment of tools: a turn with tool calls gets their outputs, a turn without one
    ends the episode (its reward: :meth:`reward`, else the run's reward function).

    The tools are the subclass's public methods (type hints and a docstring each; see the
    module docstring), or a :attr:`tools` mapping set on the class (then no schemas: write
    :meth:`instructions` yourself). A tool that raises (or a call that names no tool, or bad
    arguments) answers ``error: <message>`` and counts as a tool error; the episode goes on.
    Override :meth:`reset` (calling ``super().reset(record)``) to start an episode's state,
    :meth:`reward` to score the final answer, and declare ``metric_names`` for the
    ``StepResult.metrics`` your overrides return.
    """

    #: The tools by name, for tools that are not methods (empty: the public methods).
    tools: Mapping[str, Tool] = {}
    #: Names of the ``StepResult.metrics`` this environment reports (``env/<name>``).
    metric_names: tuple[str, ...] = ()

    #: Names of earlier releases, each with the method that replaced it.
    RENAMED = {"demonstration": "prompt_example", "demonstrate": "solution_turns"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in cls.RENAMED.items():
            if old in vars(cls):
                raise TypeError(
                    f"{cls.__name__}.{old} is not read any more: rename it to {new} "
                    "(the worked example in the prompt is prompt_example(), the assistant "
                    "turns of a correct episode are solution_turns(record))."
                )

    def __init__(self) -> None:
        self.record: PromptRecord | None = None

    def reset(self, record: PromptRecord) -> None:
        """Start an episode on ``record`` (kept as :attr:`record`: its answer, meta, ...)."""
        self.record = record

    def reward(self, answer: str) -> float | None:
        """The episode's reward for its final turn ``answer``; None (this default): the run's
        reward function scores it."""
        return None

    def prompt_example(self) -> list[dict[str, str]] | None:
        """A worked example as chat messages (a question, a tool call, its result, the
        answer), put in front of every prompt after the instructions (``add_instructions``):
        a small model copies the call format from it. None (this default): no example."""
        return None

    def solution_turns(self, record: PromptRecord) -> list[str] | None:
        """The assistant turns of a correct episode on ``record`` (tool calls in the tag
        format, then the answer), the traces of the supervised cold start
        (:mod:`dapo_lightning.sft`); None (this default): none for this record."""
        return None

    def tool_functions(self) -> dict[str, Tool]:
        """The callable tools by name: :attr:`tools`, else the tool methods of this object."""
        if self.tools:
            return dict(self.tools)
        return {name: getattr(self, name) for name in method_tool_schemas(type(self))}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tool methods' JSON schemas (empty when :attr:`tools` is set)."""
        return [] if self.tools else list(method_tool_schemas(type(self)).values())

    def instructions(self) -> str | None:
        """A system message telling the policy the tools and how to call them (None: no
        schemas to tell)."""
        schemas = self.tool_schemas()
        if not schemas:
            return None
        listed = "\n".join(json.dumps(s["function"]) for s in schemas)
        example = {"name": schemas[0]["function"]["name"], "arguments": {}}
        return (
            f"You can call these tools:\n{listed}\nTo call one, reply with only "
            f"<tool_call>{json.dumps(example)}</tool_call> with its arguments filled in; its "
            "result comes back in the next message. When you know the answer, reply without a "
            "tool call."
        )

    def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(done=True, reward=self.reward(text))
        outputs, errors = [], 0
        for call in calls:
            try:
                outputs.append(self._run(call))
            except (ToolCallError, ArithmeticError, TypeError, ValueError, LookupError) as err:
                errors += 1
                outputs.append(f"error: {err}")
        return StepResult(observation="\n".join(outputs), tool_calls=len(calls), tool_errors=errors)

    def _run(self, call: ToolCall | ToolCallError) -> str:
        if isinstance(call, ToolCallError):
            raise call
        tools = self.tool_functions()
        tool = tools.get(call.name)
        if tool is None:
            raise ToolCallError(f"no tool named {call.name!r} (tools: {sorted(tools)})")
        if not self.tools:
            check_arguments(method_tool_schemas(type(self))[call.name], call.arguments)
        return tool_text(call.name, tool(**call.arguments))


def template_renders_tools(tokenizer: Any) -> bool:
    """True when ``tokenizer``'s chat template renders ``tools=`` in the tag format the
    parser reads (its text mentions both ``tools`` and ``<tool_call>``, as Qwen2.5's)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return isinstance(template, str) and "tools" in template and "<tool_call>" in template
