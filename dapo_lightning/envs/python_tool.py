"""The built-in ``python`` environment: one tool that runs the policy's Python code in the
sandbox (:mod:`dapo_lightning.sandbox`) and shows it what the code printed.

A turn with ``<tool_call>{"name": "python", "arguments": {"code": "print(23 * 47 * 56)"}}
</tool_call>`` gets ``60536`` back as the next message: the code's stdout, then its stderr (a
traceback), then a note when it ran over its deadline or was killed, cut to
``max_observation_chars`` with a note (:func:`observation_text`). Each call is a fresh
sandboxed interpreter: nothing carries over between calls. Sandbox timeouts and errors (an
exit status other than 0: an exception, a crash, a limit) are counted per episode as
``env/sandbox_timeouts`` and ``env/sandbox_errors``; they are the code's failures, not the
tool's, so the episode goes on.

:meth:`PythonToolEnvironment.solution_turns` writes a correct episode for a question with a
whole-number expression (``print(15 * 43 * 75)``, then "The answer is 48375."): the traces of
the cold start (:mod:`dapo_lightning.sft`) and of ``environment.demonstrate_unsolved``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dapo_lightning.envs.base import StepResult, register_environment
from dapo_lightning.envs.calculator import CalculatorError, evaluate, question_expressions
from dapo_lightning.envs.tools import ToolEnvironment
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rewards.code_tests import extract_code
from dapo_lightning.sandbox import as_sandbox_config, shared_sandbox
from dapo_lightning.sandbox.config import SandboxConfig
from dapo_lightning.sandbox.runner import SandboxResult

#: What the policy sees when the code printed nothing and ended well.
NO_OUTPUT = "(no output)"

#: An expression whose Python value is its exact value: whole numbers, ``+ - *`` and brackets.
_WHOLE_RE = re.compile(r"[\d\s+\-*()]+")


def call_text(code: str) -> str:
    """A call of the ``python`` tool on ``code`` in the tag format: ``<tool_call>{"name":
    "python", "arguments": {"code": "print(2 * 3)"}}</tool_call>``."""
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def observation_text(result: SandboxResult, max_chars: int) -> str:
    """What the policy sees of one call: stdout, then stderr, cut to ``max_chars``
    characters (``[output truncated]`` when cut here or by the sandbox), then
    ``[timeout: ...]`` for a call past its deadline, or ``[killed by SIG...]`` for one a
    signal ended; :data:`NO_OUTPUT` when all of that is empty."""
    text = result.stdout
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
    cut = result.stdout_truncated or result.stderr_truncated or len(text) > max_chars
    notes = ["[output truncated]"] if cut else []
    if result.status == "timeout":
        notes.append(f"[timeout: {result.reason}; the code was killed]")
    elif result.status == "error" and result.reason.startswith("killed"):
        notes.append(f"[{result.reason}]")
    body = text[:max_chars].rstrip("\n")
    return "\n".join([body, *notes]).strip("\n") or NO_OUTPUT


@register_environment("python")
class PythonToolEnvironment(ToolEnvironment):
    """Episodes with one tool, ``python(code)``, run in the sandbox (module docstring). A turn
    without a tool call is the final answer (the run's reward function scores it).

    Args:
        sandbox: The sandbox's settings (:class:`~dapo_lightning.sandbox.SandboxConfig` or a
            mapping of its fields: ``timeout_s``, ``memory_mb``, ``pool_size``, ...). The
            episodes of a process share one sandbox (its warm pool) per settings; the first
            environment built checks it (no working bwrap: an error at start).
        max_observation_chars: Most characters of output shown to the policy per call.
    """

    metric_names = ("sandbox_timeouts", "sandbox_errors")

    def __init__(
        self,
        sandbox: SandboxConfig | dict[str, Any] | None = None,
        max_observation_chars: int = 1000,
    ) -> None:
        super().__init__()
        if isinstance(max_observation_chars, bool) or not (
            isinstance(max_observation_chars, int) and max_observation_chars >= 1
        ):
            raise ValueError(
                "PythonToolEnvironment max_observation_chars must be an integer >= 1, got "
                f"{max_observation_chars!r}."
            )
        self.sandbox_config = as_sandbox_config(sandbox, "environment.kwargs.sandbox")
        self.sandbox = shared_sandbox(self.sandbox_config)
        self.max_observation_chars = max_observation_chars
        self._counts = {"sandbox_timeouts": 0, "sandbox_errors": 0}

    def python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: The program (the standard library only; print what you want to see).
        """
        result = self.sandbox.run(extract_code(code))
        self._counts["sandbox_timeouts"] += result.status == "timeout"
        self._counts["sandbox_errors"] += result.status == "error"
        return observation_text(result, self.max_observation_chars)

    def step(self, text: str) -> StepResult:
        self._counts = dict.fromkeys(self._counts, 0)
        result = super().step(text)
        result.metrics = {name: float(n) for name, n in self._counts.items()}
        return result

    def solution_turns(self, record: PromptRecord) -> list[str] | None:
        """A call that prints the longest expression of whole numbers, ``+ - *`` and brackets
        in the prompt's last message, then its value as the answer::

            ["<tool_call>{... "code": "print(15 * 43 * 75)"}}</tool_call>", "The answer is 48375."]

        None when there is no such expression (one with ``/`` or decimals prints a float that
        Python and the question may write differently, so it gets no demonstration)."""
        for expression in question_expressions(record):
            if not _WHOLE_RE.fullmatch(expression):
                continue
            try:
                value = evaluate(expression)
            except CalculatorError:
                continue
            return [call_text(f"print({expression})"), f"The answer is {value.numerator}."]
        return None

    def instructions(self) -> str:
        return (
            "You can run Python code. To run it, reply with only "
            f"{call_text('print(23 * 47 * 56)')}; what the code prints comes back in "
            "the next message (each call starts afresh; the standard library only, no "
            "network). When you know the answer, reply without a tool call."
        )
