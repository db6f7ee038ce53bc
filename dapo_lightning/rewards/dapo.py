"""The DAPO paper's rule reward: the last ``Answer:`` line, normalised, compared to the truth.

The DAPO prompts end with "The last line of your response should be of the form Answer:
$Answer". The rule (paper Eq. 7): ``R = +1`` when the extracted answer equals the ground truth
after normalisation, else ``-1``. Normalisation (our own rendering of the DAPO reference's math
normalisation) makes surface variants of one answer compare equal: ``$540$``, ``\\boxed{540}``,
``540.``, ``540 degrees``, ``1,000`` vs ``1000``, ``\\dfrac`` vs ``\\frac``.
"""

from __future__ import annotations

import re
from typing import Any

from dapo_lightning.rewards.base import RewardResult

_ANSWER_RE = re.compile(r"Answer\s*:\s*(.*)", re.IGNORECASE)

#: Words and LaTeX that carry no value in a final answer; removed before comparing.
_UNIT_WORDS = (
    "square units",
    "sq units",
    "units",
    "unit",
    "degrees",
    "degree",
    "cm",
    "meters",
    "meter",
    "inches",
    "inch",
    "feet",
    "foot",
    "minutes",
    "hours",
    "dollars",
    "cents",
    "points",
    "mph",
    "sq",
)
_LATEX_DROP = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", "^{\\circ}", "^\\circ", r"\%", "%")


def _unwrap(text: str, command: str) -> str:
    r"""Replace every ``\command{X}`` by ``X`` (balanced braces)."""
    while True:
        start = text.find(command + "{")
        if start < 0:
            return text
        i = start + len(command) + 1
        depth = 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # unbalanced: drop the command name only
            return text[:start] + text[start + len(command) + 1 :]
        text = text[:start] + text[start + len(command) + 1 : i - 1] + text[i:]


def normalize_answer(answer: str) -> str:
    r"""Canonical form of a final math answer, for string comparison.

    Steps: keep what follows a ``=`` (``x = 5`` -> ``5``); unwrap ``\boxed``, ``\text``,
    ``\textbf``, ``\mathrm``, ``\mbox``; drop ``$``, ``\left``/``\right``, spacing commands,
    degree and percent signs, unit words; ``\dfrac``/``\tfrac`` -> ``\frac``; remove spaces,
    a trailing ``.``, and thousands separators in plain integers (``1,000`` -> ``1000``);
    ``5.0`` -> ``5``.
    """
    s = answer.strip()
    for cmd in (r"\boxed", r"\fbox", r"\text", r"\textbf", r"\mathrm", r"\mbox", r"\mathbf"):
        s = _unwrap(s, cmd)
    s = s.replace("$", "")
    if "=" in s:
        s = s.split("=")[-1]
    for token in _LATEX_DROP:
        s = s.replace(token, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    for word in _UNIT_WORDS:
        s = re.sub(rf"(?<![A-Za-z\\]){re.escape(word)}(?![A-Za-z])", "", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def extract_answer_line(response: str) -> str | None:
    """What follows the last ``Answer:`` in ``response`` (to the end of that line), or None."""
    matches = _ANSWER_RE.findall(response)
    if not matches:
        return None
    return matches[-1].strip()


class DAPOAnswerReward:
    """The paper's reward: +1 when the last ``Answer:`` line matches the ground truth, else -1.

    Args:
        correct_score: Score of a correct answer (paper: 1.0).
        wrong_score: Score of a wrong or missing answer (paper: -1.0); also the failure score.
        max_response_chars: Only the last this-many characters of a response are searched
            (bounds the cost on very long responses); ``None`` searches everything.
    """

    def __init__(
        self,
        correct_score: float = 1.0,
        wrong_score: float = -1.0,
        max_response_chars: int | None = 2000,
    ) -> None:
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.failure_score = wrong_score
        self.max_response_chars = max_response_chars

    def score_one(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response (see the class docstring)."""
        if self.max_response_chars is not None:
            response = response[-self.max_response_chars :]
        raw = extract_answer_line(response)
        pred = normalize_answer(raw) if raw is not None else None
        ok = pred is not None and pred != "" and pred == normalize_answer(str(ground_truth))
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=ok,
            extra={"has_answer": bool(pred), "pred": pred},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        return [self.score_one(r, g) for r, g in zip(responses, ground_truths)]
