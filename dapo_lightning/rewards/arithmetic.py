"""Reward for the built-in arithmetic task (:mod:`dapo_lightning.data.arithmetic`)."""

from __future__ import annotations

import re
from typing import Any

from dapo_lightning.rewards.base import RewardResult

_INT_RE = re.compile(r"-?\d+")


class ArithmeticReward:
    """+1 when the response gives the right integer, else -1.

    Args:
        strict: True (default): the response with surrounding whitespace stripped must equal
            the answer exactly (``"7"``; ``"7 apples"`` is wrong). False: the last integer in
            the response is compared.
        correct_score: Score of a correct answer.
        wrong_score: Score of a wrong or missing answer; also the failure score.
    """

    def __init__(
        self, strict: bool = True, correct_score: float = 1.0, wrong_score: float = -1.0
    ) -> None:
        self.strict = strict
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.failure_score = wrong_score

    def score_one(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response."""
        truth = str(ground_truth).strip()
        if self.strict:
            pred: str | None = response.strip()
            has_answer = bool(_INT_RE.fullmatch(pred or ""))
        else:
            found = _INT_RE.findall(response)
            pred = found[-1] if found else None
            has_answer = pred is not None
        ok = pred is not None and pred == truth
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=ok,
            extra={"has_answer": has_answer},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        return [self.score_one(r, g) for r, g in zip(responses, ground_truths)]
