"""The built-in calculator environment: one tool that evaluates arithmetic exactly.

The expression language is numbers (``12``, ``3.5``, ``.5``) and ``+ - * / ( )`` with the
usual precedence (``*`` and ``/`` before ``+`` and ``-``, left to right) and unary ``+`` /
``-``. It is evaluated by a small recursive-descent parser over exact fractions, never by
``eval``::

    expression := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := ("+" | "-") factor | number | "(" expression ")"

Results are printed as integers when they are whole (``12``), else as decimals with at most
10 significant digits (``0.3333333333``). Division by zero, an unknown character, a missing
parenthesis or an over-long expression raise :class:`CalculatorError` (the environment answers
``error: ...``).
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

from dapo_lightning.envs.base import StepResult, register_environment
from dapo_lightning.envs.tools import ToolEnvironment
from dapo_lightning.prompts import PromptRecord

#: Longest expression the calculator reads (characters) and deepest nesting.
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32

_TOKEN_RE = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\S))")


class CalculatorError(ValueError):
    """An expression the calculator cannot evaluate (the message says why)."""


def _tokenize(expression: str) -> list[str]:
    tokens = []
    for match in _TOKEN_RE.finditer(expression):
        number, other = match.groups()
        if number is not None:
            tokens.append(number)
        elif other is not None:
            if other not in "+-*/()":
                raise CalculatorError(f"unexpected character {other!r}")
            tokens.append(other)
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.pos += 1
        return token

    def expression(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor(depth)
            if op == "*":
                value = value * right
            elif right == 0:
                raise CalculatorError("division by zero")
            else:
                value = value / right
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH}")
        token = self.take()
        if token in ("+", "-"):
            value = self.factor(depth + 1)
            return value if token == "+" else -value
        if token == "(":
            value = self.expression(depth + 1)
            if self.peek() != ")":
                raise CalculatorError("a '(' is not closed")
            self.take()
            return value
        if token in "*/)":
            raise CalculatorError(f"unexpected {token!r}")
        return Fraction(token)


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression`` (see the module docstring for the language).

    Raises:
        CalculatorError: empty, too long, a bad character, unbalanced parentheses, trailing
            tokens, or division by zero.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokenize(expression)
    if not tokens:
        raise CalculatorError("the expression is empty")
    parser = _Parser(tokens)
    value = parser.expression(0)
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after the expression")
    return value


def format_number(value: Fraction) -> str:
    """``value`` as text: an integer when whole, else a decimal of <= 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


#: Candidate expressions in a question: digits and operators, at least one operator.
_EXPRESSION_RE = re.compile(r"[-(\d][\d\s.()]*(?:[-+*/][\s(]*[\d.][\d\s.()]*)+")


def question_expressions(record: PromptRecord) -> list[str]:
    """The arithmetic expressions in the text of ``record``'s last message, longest first
    ("Calculate 7 - 3." -> ``["7 - 3"]``): what the built-in environments' demonstrations
    compute."""
    text: Any = record.prompt
    if not isinstance(text, str):  # chat messages: the last one's content
        text = str(text[-1]["content"]) if text else ""
    found = (e.strip().rstrip(".").strip() for e in _EXPRESSION_RE.findall(text))
    return sorted(found, key=len, reverse=True)


#: The calculator's worked example (``example: true``): a question, the call, the result, the
#: answer, as chat turns (the result's ``tool`` role becomes ``environment.observation_role``).
EXAMPLE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "What is 12 * 34 + 5?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34+5"}}'
        "</tool_call>",
    },
    {"role": "tool", "content": "413"},
    {"role": "assistant", "content": "12 * 34 + 5 = 413"},
)


@register_environment("calculator")
class CalculatorEnvironment(ToolEnvironment):
    """Episodes with one tool, ``calculator(expression)``.

    A turn with ``<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}
    </tool_call>`` gets ``12`` back as the next message; a turn without a tool call is the
    final answer (the run's reward function scores it).

    Args:
        nudge: A user turn sent back when the first turns of an episode make no tool call
            (e.g. ``"Check it with the calculator first."``), so a model that never tries the
            tool is asked to once; None (default): such a turn is the final answer.
        example: Start every prompt with one worked example as chat turns (:data:`EXAMPLE`:
            a product, the call, its result, the answer; :meth:`prompt_example`).
    """

    def __init__(self, nudge: str | None = None, example: bool = False) -> None:
        super().__init__()
        if nudge is not None and (not isinstance(nudge, str) or not nudge.strip()):
            raise ValueError("CalculatorEnvironment nudge must be a non-empty text or None.")
        if not isinstance(example, bool):
            raise ValueError(
                f"CalculatorEnvironment example must be true or false, got {example!r}."
            )
        self.nudge = nudge
        self.example = example
        self.called = False

    def prompt_example(self) -> list[dict[str, str]] | None:
        """:data:`EXAMPLE` when ``example`` is on, else None."""
        return [dict(m) for m in EXAMPLE] if self.example else None

    def solution_turns(self, record: PromptRecord) -> list[str] | None:
        """A call on the longest expression in the prompt's last message that evaluates,
        then its value as the answer ("The answer is 4959."); None when there is none."""
        for expression in question_expressions(record):
            try:
                value = format_number(evaluate(expression))
            except CalculatorError:
                continue
            call = {"name": "calculator", "arguments": {"expression": expression}}
            return [f"<tool_call>{json.dumps(call)}</tool_call>", f"The answer is {value}."]
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: Numbers, + - * / and parentheses, e.g. "3*4".
        """
        return format_number(evaluate(expression))

    def step(self, text: str) -> StepResult:
        result = super().step(text)
        self.called = self.called or result.tool_calls > 0
        if result.done and self.nudge is not None and not self.called:
            self.called = True  # nudged once: the next turn without a call is the answer
            return StepResult(observation=self.nudge)
        return result

    def instructions(self) -> str:
        return (
            "You can use a calculator. To use it, reply with only "
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call> '
            "(numbers, + - * / and parentheses); its result comes back in the next message. "
            "When you know the answer, reply without a tool call."
        )
