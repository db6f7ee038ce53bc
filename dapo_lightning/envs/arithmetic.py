"""The built-in ``arithmetic`` environment: tools of two whole numbers each, so that a question
with three or more numbers takes several calls whose results combine.

Where the ``calculator`` reads a whole expression (one call copies the question), here each
call does one operation::

    add(a, b) = a + b        subtract(a, b) = a - b        multiply(a, b) = a * b

so ``23 * 47 * 56`` is ``multiply(23, 47)`` -> 1081, then ``multiply(1081, 56)`` -> 60536: the
policy has to carry a tool's result into its next call. :func:`plan_calls` gives the calls
that evaluate an expression of whole numbers and ``+ - *`` with the usual precedence
(``*`` first, then ``+`` and ``-`` left to right); :meth:`ArithmeticEnvironment.solution_turns`
writes them as one call per turn (the cold start's traces, :mod:`dapo_lightning.sft`).
"""

from __future__ import annotations

import json
import re

from dapo_lightning.envs.base import register_environment
from dapo_lightning.envs.calculator import question_expressions
from dapo_lightning.envs.tools import ToolEnvironment
from dapo_lightning.prompts import PromptRecord

#: One binary call: the tool's name and its two operands.
Call = tuple[str, int, int]

_TOOL_OF = {"+": "add", "-": "subtract", "*": "multiply"}
_APPLY = {"add": int.__add__, "subtract": int.__sub__, "multiply": int.__mul__}
_PLAIN_RE = re.compile(r"\s*(\d+)\s*((?:[-+*]\s*\d+\s*)*)$")
_STEP_RE = re.compile(r"([-+*])\s*(\d+)")


def plan_calls(expression: str) -> tuple[list[Call], int] | None:
    """The binary calls that evaluate ``expression`` and its value; None when it is not whole
    numbers joined by ``+ - *`` (no parentheses, signs or division).

    Products first, left to right (``a * b * c``: ``multiply(a, b)`` then ``multiply(ab, c)``),
    then the sums and differences of the products' results, left to right::

        plan_calls("2 + 3 * 4") == ([("multiply", 3, 4), ("add", 2, 12)], 14)
    """
    match = _PLAIN_RE.match(expression)
    if match is None:
        return None
    calls: list[Call] = []
    terms, signs = [int(match.group(1))], []
    for op, number in _STEP_RE.findall(match.group(2)):
        if op == "*":
            calls.append(("multiply", terms[-1], int(number)))
            terms[-1] = terms[-1] * int(number)
        else:
            terms.append(int(number))
            signs.append(op)
    value = terms[0]
    for sign, term in zip(signs, terms[1:]):
        calls.append((_TOOL_OF[sign], value, term))
        value = _APPLY[_TOOL_OF[sign]](value, term)
    return calls, value


def call_text(call: Call) -> str:
    """``call`` in the tag format: ``<tool_call>{"name": "add", "arguments": {"a": 2, "b":
    12}}</tool_call>``."""
    name, a, b = call
    return f"<tool_call>{json.dumps({'name': name, 'arguments': {'a': a, 'b': b}})}</tool_call>"


@register_environment("arithmetic")
class ArithmeticEnvironment(ToolEnvironment):
    """Episodes with three tools of two whole numbers each: ``add``, ``subtract``,
    ``multiply`` (the module docstring). A turn without a tool call is the final answer (the
    run's reward function scores it).

    The instructions (a system message before every prompt) name the tools with one example
    call, shorter than the schemas' listing (~90 tokens against ~300).

    Args:
        hint: Add to the instructions that more than two numbers take more calls, each on the
            result of the last (default True).
    """

    def __init__(self, hint: bool = True) -> None:
        super().__init__()
        if not isinstance(hint, bool):
            raise ValueError(f"ArithmeticEnvironment hint must be true or false, got {hint!r}.")
        self.hint = hint

    def add(self, a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def subtract(self, a: int, b: int) -> int:
        """Subtract the second whole number from the first.

        Args:
            a: The number to subtract from.
            b: The number to subtract.
        """
        return a - b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    def solution_turns(self, record: PromptRecord) -> list[str] | None:
        """One call per turn on the longest expression of the prompt's last message
        (:func:`plan_calls`), then "The answer is N."; None when there is none."""
        for expression in question_expressions(record):
            planned = plan_calls(expression)
            if planned is not None and planned[0]:
                calls, value = planned
                return [call_text(c) for c in calls] + [f"The answer is {value}."]
        return None

    def instructions(self) -> str:
        text = (
            "You can use three tools, each on two whole numbers: add(a, b), subtract(a, b) and "
            "multiply(a, b). To use one, reply with only "
            '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>; its '
            "result comes back in the next message. When you know the answer, reply without a "
            "tool call."
        )
        if self.hint:
            text += " For more than two numbers, call a tool again on the result of the last call."
        return text
