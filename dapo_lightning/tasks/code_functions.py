"""The built-in ``code_functions`` task: generated "write f(x) that ..." problems, each with unit
tests, scored by the ``code_tests`` reward (:mod:`dapo_lightning.rewards.code_tests`, the code
run in the sandbox).

A row is one problem, its tests (a JSON list of asserts, the ``answer`` the reward reads) and its
split::

    {"prompt": [{"role": "user", "content": "Write a Python function f(x) that returns x times
     3 plus 2. Reply with the code in a ```python block."}],
     "answer": '["assert f(0) == 2", "assert f(1) == 5", "assert f(-4) == -10", ...]',
     "uid": "code-linear-3-2", "split": "train",
     "solution": "```python\ndef f(x):\n    return x * 3 + 2\n```"}

The problems come from :data:`TEMPLATES`, each a sentence with small whole-number parameters
and the reference function the tests are computed from; a problem is its template and
parameters (its ``uid``). Held-out problems (``split: "val"``) are drawn with ``val_seed``
(default ``seed + 1_000_003``, as the reasoning-gym task) and never share a ``uid`` with a
training problem.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_lightning.tasks.base import register_task


@dataclass(frozen=True)
class Template:
    """One kind of problem.

    Args:
        name: Its part of the ``uid``.
        text: The request, ``str.format``-ed with the parameters (``{a}``, ``{b}``).
        params: ``params(rng)`` -> the parameters of one problem.
        inputs: The test inputs (Python literals, in call order).
        reference: ``reference(params)`` -> the function the tests' expected values come from.
        solution: The body of a right ``f`` (a return expression), ``str.format``-ed with the
            parameters: the row's ``solution``.
    """

    name: str
    text: str
    params: Callable[[random.Random], dict[str, Any]]
    inputs: tuple[Any, ...]
    reference: Callable[[dict[str, Any]], Callable[[Any], Any]]
    solution: str


#: The problem kinds: arithmetic on a number, predicates, lists, strings (~960 problems).
TEMPLATES: tuple[Template, ...] = (
    Template(
        "linear", "returns x times {a} plus {b}",
        lambda r: {"a": r.randint(2, 20), "b": r.randint(1, 30)},
        (0, 1, -4, 7), lambda p: lambda x: p["a"] * x + p["b"],
        "x * {a} + {b}",
    ),
    Template(
        "square_minus", "returns the square of x minus {a}",
        lambda r: {"a": r.randint(1, 100)},
        (0, 3, -5, 10), lambda p: lambda x: x * x - p["a"],
        "x * x - {a}",
    ),
    Template(
        "remainder", "returns the remainder of the integer x divided by {a}",
        lambda r: {"a": r.randint(2, 50)},
        (0, 7, 58, 100), lambda p: lambda x: x % p["a"],
        "x % {a}",
    ),
    Template(
        "divisible", "returns True when the integer x is divisible by {a}, else False",
        lambda r: {"a": r.randint(2, 50)},
        (0, 7, 12, 35, 40, 100), lambda p: lambda x: x % p["a"] == 0,
        "x % {a} == 0",
    ),
    Template(
        "larger", "returns the larger of the number x and {a}",
        lambda r: {"a": r.randint(-20, 50)},
        (-30, 0, 17, 60), lambda p: lambda x: max(x, p["a"]),
        "max(x, {a})",
    ),
    Template(
        "sum_above", "returns the sum of the numbers in the list x that are greater than {a}",
        lambda r: {"a": r.randint(-10, 30)},
        ([], [1, 5, 10], [3, 3, 12, 8], [20, -1, 6, 31]),
        lambda p: lambda x: sum(v for v in x if v > p["a"]),
        "sum(v for v in x if v > {a})",
    ),
    Template(
        "scale_list", "returns a list of the numbers in the list x, each multiplied by {a}",
        lambda r: {"a": r.randint(2, 30)},
        ([], [1], [2, -3, 5]), lambda p: lambda x: [v * p["a"] for v in x],
        "[v * {a} for v in x]",
    ),
    Template(
        "count_letter", "returns how many times the letter '{c}' occurs in the string x",
        lambda r: {"c": r.choice("abcdefghijklmnopqrstuvwxyz")},
        ("", "banana", "letters", "mississippi", "a quick brown fox jumps over the lazy dog"),
        lambda p: lambda x: x.count(p["c"]),
        "x.count('{c}')",
    ),
    Template(
        "repeat", "returns the string x repeated {a} times",
        lambda r: {"a": r.randint(2, 20)},
        ("", "ab", "xyz"), lambda p: lambda x: x * p["a"],
        "x * {a}",
    ),
    Template(
        "last_chars", "returns the last {a} characters of the string x",
        lambda r: {"a": r.randint(1, 6)},
        ("abcdefgh", "hello world", "seventeen"), lambda p: lambda x: x[-p["a"] :],
        "x[-{a}:]",
    ),
)  # fmt: skip

_TEMPLATE = {t.name: t for t in TEMPLATES}


def problem_row(template: Template, params: dict[str, Any], split: str) -> dict[str, Any]:
    """The row of one problem: the request as a user message, the tests ``assert f(input) ==
    expected`` for each of the template's inputs (a JSON list), the uid, the split, and a right
    ``solution`` (a fenced ``def f(x)``)."""
    f = template.reference(params)
    tests = [f"assert f({x!r}) == {f(x)!r}" for x in template.inputs]
    request = template.text.format(**params)
    content = (
        f"Write a Python function f(x) that {request}. Reply with the code in a ```python block."
    )
    uid = "-".join(["code", template.name, *(str(v) for v in params.values())])
    body = template.solution.format(**params)
    return {
        "prompt": [{"role": "user", "content": content}],
        "answer": json.dumps(tests),
        "uid": uid,
        "split": split,
        "solution": f"```python\ndef f(x):\n    return {body}\n```",
    }


def check_code_functions(
    size: int = 128, val_size: int = 64, templates: list[str] | None = None, **_: Any
) -> None:
    """Raise ValueError for options :func:`make_code_function_rows` would reject."""
    if size < 1 or val_size < 0:
        raise ValueError(
            f"code_functions: size must be >= 1, val_size >= 0 (got {size}, {val_size})."
        )
    unknown = sorted(set(templates or ()) - set(_TEMPLATE))
    if unknown:
        raise ValueError(
            f"code_functions: unknown templates {unknown}; known: {sorted(_TEMPLATE)}."
        )


@register_task(
    "code_functions",
    reward="code_tests",
    description="'write f(x) that ...' problems with unit tests, run in the sandbox",
    check=check_code_functions,
)
def make_code_function_rows(
    size: int = 128,
    val_size: int = 64,
    *,
    seed: int = 0,
    val_seed: int | None = None,
    templates: list[str] | None = None,
) -> list[dict[str, Any]]:
    """``size`` distinct training problems, then ``val_size`` distinct held-out ones.

    Each problem draws a template uniformly (of ``templates``, default all of
    :data:`TEMPLATES`) and its parameters; a draw whose uid was seen (in either split) is
    drawn again, so there are fewer problems only when the templates have fewer.

    Raises:
        ValueError: ``size < 1``, ``val_size < 0``, an unknown template name.
    """
    check_code_functions(size, val_size, templates)
    kinds = [_TEMPLATE[n] for n in templates] if templates else list(TEMPLATES)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    val_seed = seed + 1_000_003 if val_seed is None else val_seed
    for split, split_seed, total in (("train", seed, size), ("val", val_seed, val_size)):
        rng = random.Random(split_seed)
        made, tries = 0, 0
        while made < total and tries < 100 * (total + 1):
            tries += 1
            template = rng.choice(kinds)
            row = problem_row(template, template.params(rng), split)
            if row["uid"] not in seen:
                seen.add(row["uid"])
                rows.append(row)
                made += 1
    return rows
