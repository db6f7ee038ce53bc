"""The ``code_tests`` reward: the response's code is run against its prompt's test cases in the
sandbox (:mod:`dapo_lightning.sandbox`); +1 when every test passes, else -1.

A prompt's ground truth (its ``answer``) holds the tests: a JSON list of Python snippets
(``["assert f(2) == 4", "assert f(0) == 0"]``), or plain text with one snippet per line. The
response's code is its last fenced block (```` ```python ... ``` ````), or the whole response
when it has none (:func:`extract_code`). One sandboxed program per response runs the code, then
each test in the code's namespace (:func:`harness_program`); a test passes when it runs without
raising. The program reports each test's outcome on a descriptor of its own, marked with a
random token; the code's stdout goes nowhere, so printing cannot push the report out of the
kept output.

The report is the program's word: code that digs the token out of its own interpreter (frame
inspection) could forge it. That is reward hacking inside the sandbox, not a way out of it.
"""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dapo_lightning.checks import check_finite
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.sandbox import as_sandbox_config, check_isolation, shared_sandbox
from dapo_lightning.sandbox.config import SandboxConfig
from dapo_lightning.sandbox.runner import Sandbox, SandboxResult

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The code of a response: the body of its last fenced block (```` ```python ````,
    ```` ```py ```` or a bare ```` ``` ````), else the whole text, stripped."""
    blocks = _FENCE_RE.findall(text)
    return (blocks[-1] if blocks else text).strip()


def parse_tests(ground_truth: str) -> list[str]:
    """The test snippets of a ground truth: a JSON list of strings, else one snippet per
    non-empty line.

    Raises:
        ValueError: no test, or a JSON list with something that is not text.
    """
    text = str(ground_truth).strip()
    tests: Any = None
    if text.startswith("["):
        try:
            tests = json.loads(text)
        except json.JSONDecodeError:
            tests = None
    if tests is None:
        tests = [line for line in text.splitlines() if line.strip()]
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("code_tests: the ground truth must be a JSON list of test snippets.")
    if not tests:
        raise ValueError("code_tests: the ground truth holds no test.")
    return tests


#: The program that runs a solution and its tests (``{code}``, ``{tests}``, ``{token}`` filled
#: with Python literals). The report descriptor is a copy of stdout taken before the code runs;
#: stdout itself then points at /dev/null.
_PROGRAM = """\
import os as _os
_report = _os.dup(1)
_null = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_null, 1)
_ns = {{"__name__": "__main__"}}
_tests = {tests}
try:
    exec(compile({code}, "<solution>", "exec"), _ns)
    _ok = True
except BaseException as _err:
    import sys as _sys
    print(f"the solution raised {{type(_err).__name__}}: {{_err}}"[:500], file=_sys.stderr)
    _ok = False
for _i, _test in enumerate(_tests):
    _passed = False
    if _ok:
        try:
            exec(compile(_test, f"<test {{_i}}>", "exec"), _ns)
            _passed = True
        except BaseException:
            _passed = False
    _os.write(_report, ({token} + ("P" if _passed else "F") + "\\n").encode())
"""


def harness_program(code: str, tests: list[str], token: str) -> str:
    """The sandboxed program for one response: run ``code`` as ``__main__``, then each of
    ``tests`` in its namespace, writing ``token + "P"`` (passed) or ``token + "F"`` per test,
    in order, as a line of its own to the report descriptor (the original stdout)."""
    return _PROGRAM.format(code=repr(code), tests=repr(list(tests)), token=repr(token))


def count_passes(stdout: str, token: str, total: int) -> int:
    """Tests reported passed in ``stdout``: lines ``token + "P"`` among the first ``total``
    report lines (a program killed mid-way reports the tests it finished)."""
    marks = [line[len(token) :] for line in stdout.splitlines() if line.startswith(token)]
    return sum(1 for mark in marks[:total] if mark == "P")


class CodeTestsReward:
    """+1 when the response's code passes all its prompt's tests in the sandbox, else -1
    (reward name ``"code_tests"``; module docstring). ``extra``: ``pass_frac`` (tests passed
    / tests, logged as ``reward/pass_frac``), ``sandbox_timeout`` (1.0 when the program ran
    over ``sandbox.timeout_s``).

    Args:
        sandbox: The sandbox's settings (:class:`~dapo_lightning.sandbox.SandboxConfig`, or a
            mapping of its fields; ``timeout_s`` bounds one response's code and tests
            together). Checked when the reward is built: no working bwrap is an error then.
        correct_score: Score when every test passes.
        wrong_score: Score otherwise (no code, a failing test, a timeout); also the failure
            score.
    """

    def __init__(
        self,
        sandbox: SandboxConfig | dict[str, Any] | None = None,
        correct_score: float = 1.0,
        wrong_score: float = -1.0,
    ) -> None:
        self.sandbox = as_sandbox_config(sandbox, "data.scoring.reward_kwargs.sandbox")
        for name, value in (("correct_score", correct_score), ("wrong_score", wrong_score)):
            check_finite(f"data.scoring.reward_kwargs.{name}", value, "Give a finite score.")
        check_isolation(self.sandbox)
        self.correct_score = float(correct_score)
        self.wrong_score = float(wrong_score)
        self.failure_score = self.wrong_score

    def _sandbox(self) -> Sandbox:
        return shared_sandbox(self.sandbox)

    def score_one(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response (its code against the tests of ``ground_truth``)."""
        tests = parse_tests(ground_truth)
        code = extract_code(response)
        if not code:
            extra = {"has_answer": False, "pass_frac": 0.0, "sandbox_timeout": 0.0}
            return RewardResult(self.wrong_score, False, extra)
        token = "@@" + secrets.token_hex(8) + "@@"
        result: SandboxResult = self._sandbox().run(harness_program(code, tests, token))
        passed = count_passes(result.stdout, token, len(tests))
        ok = passed == len(tests)
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=ok,
            extra={
                "has_answer": True,
                "pass_frac": passed / len(tests),
                "sandbox_timeout": float(result.status == "timeout"),
            },
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        """Score a batch, ``sandbox.pool_size`` responses at a time (at least one)."""
        threads = max(1, min(self.sandbox.pool_size, len(responses)))
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(self.score_one, responses, ground_truths))
