"""A built-in synthetic task: arithmetic with difficulty levels, deterministic by seed.

Rows are ``{"prompt": "3+4=", "answer": "7", "uid": "arith-1-0003", "difficulty": 1}``. Every
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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

#: Default (operand range, ops) per difficulty level.
LEVELS: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {
    0: ((0, 4), ("+",)),
    1: ((0, 9), ("+",)),
    2: ((10, 99), ("+",)),
    3: ((0, 9), ("*",)),
    4: ((10, 99), ("+", "-", "*")),
}

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


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
