"""The built-in word-problem task: seeded two-step word problems with small numbers, scored by
the last number of the response (:class:`LastNumberReward`, reward name ``"last_number"``).

Each problem combines two operations on operands 1-10 in one of :data:`TEMPLATES` (for example
multiply-then-subtract: "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples
are left?"). Every answer is a non-negative integer. Rows are::

    {"prompt": [{"role": "user", "content": "<problem> <instruction>"}],
     "answer": "10", "uid": "wp-mul_sub-3-4-2-tom-apples", "template": "mul_sub"}

The prompt is a list of chat messages, so the data module needs ``prompts.apply_chat_template: true``
(the default). The instruction (:data:`INSTRUCTION`) asks for one or two short sentences that
end with "The answer is N.": a 135M instruct model (SmolLM2-135M-Instruct, see
:mod:`dapo_lightning.models`) then writes ~35 tokens, which keeps rollouts short.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dapo_lightning.rewards import register_reward
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.tasks.base import register_task

#: The instruction appended to every problem (``instruction=`` replaces it). Measured on
#: SmolLM2-135M-Instruct (``make_word_problem_rows(64, seed=0)``, HF ``generate``, 64 new
#: tokens): greedy 3/64 right (34 tokens on average), sampled at temperature 1.0 3/128 (a
#: number in 79% of the responses). Other wordings, greedy: "Answer with just the number."
#: 3/64 (it rambles past 40 tokens), "Answer in one short sentence that ends with the number."
#: 1/64.
INSTRUCTION = "Solve it step by step in one or two short sentences, then write: The answer is N."

#: (name, pronoun) pairs the problems are told about.
PEOPLE: tuple[tuple[str, str], ...] = (
    ("Tom", "He"),
    ("Anna", "She"),
    ("Ben", "He"),
    ("Lily", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Leo", "He"),
    ("Zoe", "She"),
)

#: Countable things.
ITEMS: tuple[str, ...] = (
    "apples",
    "pencils",
    "cookies",
    "stickers",
    "marbles",
    "books",
    "oranges",
    "cards",
)


@dataclass(frozen=True)
class Template:
    """One kind of two-step problem.

    Args:
        name: Short id, part of every uid (``"mul_sub"``).
        text: ``str.format`` text with ``{name} {pron} {item} {a} {b} {c}`` (and ``{ab}`` =
            a * b for the sharing templates).
        answer: The answer from ``(a, b, c)``.
        valid: Which ``(a, b, c)`` give a well-posed problem (for example no more eaten than
            there are).
    """

    name: str
    text: str
    answer: Callable[[int, int, int], int]
    valid: Callable[[int, int, int], bool] = lambda a, b, c: True


#: The problem kinds (``templates=`` picks a subset by name, or a mix of :data:`MIXES`).
TEMPLATES: tuple[Template, ...] = (
    Template(
        "mul_sub",
        "{name} has {a} boxes with {b} {item} each. {pron} gives away {c} {item}. "
        "How many {item} are left?",
        lambda a, b, c: a * b - c,
        lambda a, b, c: c <= a * b,
    ),
    Template(
        "mul_add",
        "{name} has {a} bags with {b} {item} in each bag and {c} more {item} in a pocket. "
        "How many {item} does {name} have in all?",
        lambda a, b, c: a * b + c,
    ),
    Template(
        "add_mul",
        "{name} buys {a} red packs and {b} blue packs. Each pack has {c} {item}. "
        "How many {item} does {name} buy?",
        lambda a, b, c: (a + b) * c,
    ),
    Template(
        "sub_mul",
        "{name} has {a} jars. {b} of them are empty and each of the others holds {c} {item}. "
        "How many {item} are in the jars?",
        lambda a, b, c: (a - b) * c,
        lambda a, b, c: b < a,
    ),
    Template(
        "share_add",
        "{name} shares {ab} {item} equally among {b} friends. Then one friend finds {c} more "
        "{item}. How many {item} does that friend have now?",
        lambda a, b, c: a + c,
        lambda a, b, c: b >= 2,
    ),
    Template(
        "add_sub",
        "{name} has {a} {item}. A friend gives {name} {b} more, and then {name} loses {c}. "
        "How many {item} does {name} have now?",
        lambda a, b, c: a + b - c,
        lambda a, b, c: c <= a + b,
    ),
    Template(
        "add_add",
        "{name} has {a} {item}. {pron} finds {b} more {item} and then gets {c} more. "
        "How many {item} does {name} have now?",
        lambda a, b, c: a + b + c,
    ),
    Template(
        "sub_sub",
        "{name} has {a} {item}. {pron} gives {b} to a friend and then loses {c}. "
        "How many {item} are left?",
        lambda a, b, c: a - b - c,
        lambda a, b, c: b + c <= a,
    ),
    Template(
        "sub_add",
        "{name} has {a} {item}. {pron} gives away {b} and then buys {c} more. "
        "How many {item} does {name} have now?",
        lambda a, b, c: a - b + c,
        lambda a, b, c: b <= a,
    ),
)

#: Named template subsets (``templates="additive"``). ``"mixed"`` is the default: multiplication
#: in 4 of its 6 kinds. ``"additive"`` has addition and subtraction only (how well an untrained
#: model does on each: ``benchmarks/task_headroom.py``, results in ``benchmarks/RESULTS.md``).
MIXES: dict[str, tuple[str, ...]] = {
    "mixed": ("mul_sub", "mul_add", "add_mul", "sub_mul", "share_add", "add_sub"),
    "additive": ("add_sub", "add_add", "sub_sub", "sub_add"),
}

#: Operands are drawn from this inclusive range.
NUMBER_RANGE = (1, 10)

#: Singular of every plural noun the templates put after a number ("1 box", not "1 boxes").
SINGULAR: dict[str, str] = {
    **{item: item[:-1] for item in ITEMS},
    "boxes": "box",
    "bags": "bag",
    "packs": "pack",
    "jars": "jar",
    "friends": "friend",
}
_ONE_PLURAL_RE = re.compile(r"\b1 ((?:red |blue |more )?)([a-z]+)\b")


def _agree(text: str) -> str:
    """Singular nouns after a count of 1: "1 boxes" -> "1 box", "1 of them are" -> "1 of them is"."""
    text = _ONE_PLURAL_RE.sub(lambda m: f"1 {m[1]}{SINGULAR.get(m[2], m[2])}", text)
    return text.replace("1 of them are", "1 of them is")


def _pick_templates(names: Sequence[str] | str | None) -> list[Template]:
    known = {t.name: t for t in TEMPLATES}
    if names is None:
        names = MIXES["mixed"]
    elif isinstance(names, str):
        if names not in MIXES:
            raise ValueError(
                f"word_problems templates={names!r}: name a mix in {list(MIXES)} or give a list "
                f"of template names from {list(known)}."
            )
        names = MIXES[names]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"word_problems templates={list(names)!r}: give a non-empty subset of {list(known)}."
        )
    return [known[n] for n in names]


@register_task(
    "word_problems",
    reward="last_number",
    description="two-step word problems, numbers 1-10, chat prompts; last number scored",
)
def make_word_problem_rows(
    num_prompts: int = 256,
    *,
    seed: int = 0,
    templates: Sequence[str] | str | None = None,
    instruction: str = INSTRUCTION,
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """Distinct two-step word problems with operands 1-10 and non-negative integer answers.

    Args:
        num_prompts: How many distinct problems (1 to 20,000).
        seed: Same seed, same problems in the same order.
        templates: Names of the :data:`TEMPLATES` to draw from in turn, or the name of a mix
            in :data:`MIXES` (default ``"mixed"``).
        instruction: Text appended to each problem (the answer format asked for).
        system_prompt: A system message put before the problem; None uses the model's default
            (SmolLM2's chat template adds its own).

    Returns:
        Rows with ``prompt`` (chat messages), ``answer``, ``uid`` and ``template``.

    Raises:
        ValueError: ``num_prompts`` out of range or unknown template names.

    Example::

        rows = make_word_problem_rows(64, seed=1)
        rows[0]["prompt"][-1]["content"]  # "Mia has 7 jars. 2 of them are empty and ..."
    """
    if not 1 <= num_prompts <= 20_000:
        raise ValueError(f"word_problems num_prompts must be in [1, 20000], got {num_prompts}.")
    kinds = _pick_templates(templates)
    lo, hi = NUMBER_RANGE
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < num_prompts:
        kind = kinds[len(rows) % len(kinds)]
        a, b, c = (rng.randint(lo, hi) for _ in range(3))
        (name, pron), item = rng.choice(PEOPLE), rng.choice(ITEMS)
        uid = f"wp-{kind.name}-{a}-{b}-{c}-{name.lower()}-{item}"
        if uid in seen or not kind.valid(a, b, c):
            continue
        seen.add(uid)
        text = _agree(kind.text.format(name=name, pron=pron, item=item, a=a, b=b, c=c, ab=a * b))
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": f"{text} {instruction}".strip()})
        rows.append(
            {
                "prompt": messages,
                "answer": str(kind.answer(a, b, c)),
                "uid": uid,
                "template": kind.name,
            }
        )
    return rows


# A number: "1,234" (thousands separators), "12", "-3", "2.50". Not preceded by a letter or a
# digit, so "x2" or "H2O" do not count as numbers.
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_number(text: str) -> Fraction | None:
    """The value of the last number written in ``text``, or None when there is none.

    Example::

        last_number("3 * 4 = 12, minus 2 is 10.")  # Fraction(10, 1)
    """
    found = last_number_text(text)
    return Fraction(found) if found is not None else None


def last_number_text(text: str) -> str | None:
    """The last number written in ``text`` as it is written, thousands separators removed
    (``"-3"``, ``"2.50"``, ``"1234"``), or None when there is none."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


@register_reward("last_number")
class LastNumberReward:
    """+1 when the last number of the response equals the answer, else -1 (reward name
    ``"last_number"``).

    Values are compared, not strings: ``"10.0"`` and ``"10"`` both match an answer of 10.

    Args:
        correct_score: Score of a correct answer.
        wrong_score: Score of a wrong answer or of a response with no number; also the failure
            score.

    Example::

        LastNumberReward()(["3 boxes of 4 is 12, so 10 are left."], ["10"])[0].score  # 1.0
    """

    def __init__(self, correct_score: float = 1.0, wrong_score: float = -1.0) -> None:
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.failure_score = wrong_score

    def score_one(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response; ``extra`` has ``has_answer`` (a number was found)."""
        pred = last_number(response)
        truth = last_number(str(ground_truth))
        if truth is None:
            raise ValueError(f"last_number reward: the answer {ground_truth!r} is not a number.")
        ok = pred is not None and pred == truth
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=ok,
            extra={"has_answer": pred is not None},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        return [self.score_one(r, g) for r, g in zip(responses, ground_truths)]
