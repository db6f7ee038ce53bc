"""The built-in arithmetic task: problems with difficulty levels, their reward, and the
quickstart's warm-up checkpoint.

Rows are ``{"prompt": "3+4=", "answer": "7", "uid": "arith-1-3+4", "difficulty": 1}``. Every
character is ASCII, so the byte-level test tokenizer can write any answer; answers of two or
more digits (more than one token) appear from level 1 on (sums >= 10).

Levels (``operand_range`` and ``ops`` override them):

====== =========================== =========
level  operands                    ops
====== =========================== =========
0      0..4                        ``+``
1      0..9                        ``+``
2      10..99                      ``+``
3      0..9                        ``*``
4      10..99                      ``+ - *``
====== =========================== =========

The quickstart's warm-up (:func:`make_quickstart_checkpoint`) lives in
:mod:`dapo_lightning.tasks.arithmetic_warmup`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from dapo_lightning.rewards import register_reward
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.tasks.base import register_task

#: Default (operand range, ops) per difficulty level.
LEVELS: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {
    0: ((0, 4), ("+",)),
    1: ((0, 9), ("+",)),
    2: ((10, 99), ("+",)),
    3: ((0, 9), ("*",)),
    4: ((10, 99), ("+", "-", "*")),
}

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INT_RE = re.compile(r"-?\d+")


@register_task(
    "arithmetic",
    reward="arithmetic",
    description="'a+b=' problems by difficulty level; plain-text prompts, exact answer",
)
def make_arithmetic_rows(
    num_prompts: int = 256,
    level: int = 1,
    *,
    seed: int = 0,
    operand_range: tuple[int, int] | None = None,
    ops: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Distinct arithmetic problems ``"a<op>b="`` with their answers.

    Args:
        num_prompts: How many distinct problems (at most the number that exist).
        level: Difficulty level, a key of :data:`LEVELS`.
        seed: Same seed, same problems in the same order.
        operand_range: Inclusive ``(low, high)`` for both operands (overrides the level's).
        ops: Operators among ``+ - *`` (overrides the level's).

    Returns:
        Rows with ``prompt``, ``answer`` (the integer as text), ``uid`` and ``difficulty``.

    Raises:
        ValueError: An unknown level, an empty or unknown operator list, ``low > high`` or
            ``num_prompts < 1``.

    Example::

        make_arithmetic_rows(2, level=1, seed=0)[0]
        # {'prompt': '2+3=', 'answer': '5', 'uid': 'arith-1-2+3', 'difficulty': 1}
    """
    if level not in LEVELS:
        raise ValueError(f"arithmetic level must be one of {sorted(LEVELS)}, got {level}.")
    (lo, hi), level_ops = LEVELS[level]
    if operand_range is not None:
        lo, hi = operand_range
    ops = tuple(ops) if ops is not None else level_ops
    bad = [o for o in ops if o not in _OPS]
    if bad or not ops:
        raise ValueError(f"arithmetic ops must be a non-empty subset of {list(_OPS)}, got {ops}.")
    if lo > hi:
        raise ValueError(f"operand_range low {lo} is above high {hi}.")
    problems = [(a, op, b) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    rng = random.Random(seed)
    rng.shuffle(problems)
    problems = problems[:num_prompts]
    return [
        {
            "prompt": f"{a}{op}{b}=",
            "answer": str(_OPS[op](a, b)),
            "uid": f"arith-{level}-{a}{op}{b}",
            "difficulty": level,
        }
        for a, op, b in problems
    ]


@register_reward("arithmetic")
class ArithmeticReward:
    """+1 when the response gives the right integer, else -1 (reward name ``"arithmetic"``).

    Args:
        strict: True (default): the response with surrounding whitespace stripped must equal
            the answer exactly (``"7"``; ``"7 apples"`` is wrong). False: the last integer in
            the response is compared.
        correct_score: Score of a correct answer.
        wrong_score: Score of a wrong or missing answer; also the failure score.

    Example::

        ArithmeticReward()(["7", "~7"], ["7", "7"])  # scores [1.0, -1.0]
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
