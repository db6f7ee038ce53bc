"""A reward backed by Hugging Face ``math-verify``: boxed and LaTeX answers, checked symbolically."""

from __future__ import annotations

import threading
from typing import Any

from dapo_lightning.rewards.results import RewardResult


class MathVerifyReward:
    r"""+1 when ``math_verify.verify(parse(truth), parse(response))`` holds, else -1.

    ``math_verify.parse`` finds the answer in the response (``\boxed{...}`` first, then LaTeX and
    plain expressions) and ``verify`` compares symbolically (``\frac{1}{2}`` equals ``0.5``).
    math-verify can be slow or hang on adversarial input: run it through
    :class:`~dapo_lightning.rewards.base.RewardRunner`, whose per-sample timeout kills it.

    Args:
        correct_score: Score of a correct answer.
        wrong_score: Score of a wrong or missing answer; also the failure score.
        float_rounding: Decimal places numbers are rounded to before comparing.
    """

    def __init__(
        self, correct_score: float = 1.0, wrong_score: float = -1.0, float_rounding: int = 6
    ) -> None:
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.failure_score = wrong_score
        self.float_rounding = float_rounding

    def score_one(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response."""
        from math_verify import parse, verify

        # math-verify's own timeouts use SIGALRM, which only works in the main thread.
        t = 5 if threading.current_thread() is threading.main_thread() else None
        gt = str(ground_truth)
        gold = parse(gt if "$" in gt or "\\" in gt else f"${gt}$", parsing_timeout=t)
        pred = parse(response, parsing_timeout=t)
        ok = bool(gold) and bool(pred)
        if ok:
            ok = verify(gold, pred, float_rounding=self.float_rounding, timeout_seconds=t)
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=bool(ok),
            extra={"has_answer": bool(pred), "pred": str(pred[-1]) if pred else None},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        return [self.score_one(r, g) for r, g in zip(responses, ground_truths)]
