r"""The DAPO paper's rule reward, scored the way verl's ``math_dapo.compute_score`` scores it.

The DAPO prompts end with "The last line of your response should be of the form Answer:
$Answer". The rule (paper Eq. 7): ``R = +1`` when the extracted answer equals the ground truth,
else ``-1``. The reference implementation the paper trained with is verl's
``verl/utils/reward_score/math_dapo.py``; :class:`DAPOAnswerReward` reproduces its score, its
``acc`` and its extracted prediction exactly (checked case by case against outputs recorded
from verl 0.9.1 in ``tests/data/verl_math_dapo_outputs.json``, written by
``scripts/record_verl_rewards.py``). This is our own code; the behaviour, quirks included, is
the reference's, and :class:`DAPOAnswerReward`'s docstring spells it out.
"""

from __future__ import annotations

import re
from typing import Any

from dapo_lightning.rewards.results import RewardResult

#: The prediction when a response has neither an ``Answer:`` line nor a ``\boxed{}`` answer
#: (the reference's sentinel string; it never equals a normalised ground truth in practice).
NO_ANSWER = "[INVALID]"

#: ``Answer`` (any case), optional whitespace (newlines included), ``:``, optional whitespace,
#: then the rest of that line (at least one character).
_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

_BOX_OPEN = "\\boxed{"

#: Normalisation step 2: literal rewrites, applied in this order (each to every occurrence).
_REWRITES: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

#: Normalisation step 3: substrings deleted wherever they occur, in this order. Plain substring
#: deletion, not word matching: ``"squareunits"`` loses ``square`` and then ``units``.
_DELETED: tuple[str, ...] = (
    # unit and counting words
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    # empty or unit-only \text{} groups
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}",
    # ordinal, degree sign, spacing, LaTeX thousands separators, quotes, dots
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip

#: Step 4: a line holding two ``$`` becomes the text between its first two ``$`` (in ``$``).
_MATH_SPAN_RE = re.compile(r"[^\n$]*\$([^\n$]*)\$[^\n]*")
#: Step 5: ``\text{X}``, ``\textbf{X}``, ``\overline{X}`` -> ``X`` (X: up to the first ``}`` on
#: the same line, so nested braces are cut at the inner ``}``); each pass runs over the whole
#: string before the next one starts.
_UNWRAP_RES = tuple(
    re.compile(rf"\\{cmd}\{{([^\n}}]*)\}}") for cmd in ("text", "textbf", "overline")
)
#: Step 6: ``\boxed{X}`` -> ``X`` (X: up to the *last* ``}`` on the same line).
_BOXED_GREEDY_RE = re.compile(r"\\boxed\{([^\n]*)\}")
#: Step 7: shorthand ``frac`` and ``sqrt`` arguments get their braces.
_FRAC_SHORT_RE = re.compile(r"frac([^{])([^\n])")
_SQRT_SHORT_RE = re.compile(r"sqrt([^{])")


def normalize_answer(answer: str) -> str:
    r"""The reference's canonical form of a final answer, for exact string comparison.

    See :class:`DAPOAnswerReward` for the steps. Examples: ``"x = 5"`` -> ``"5"``,
    ``"\\$1,000"`` -> ``"1000"``, ``"10 km"`` -> ``"10"``, ``"\\frac12"`` -> ``"\\frac{1}{2}"``,
    while ``"540."``, ``"5.0"``, ``"12\\%"`` and ``"\\dfrac{1}{2}"`` stay as they are.
    """
    s = str(answer).split("=")[-1]
    for old, new in _REWRITES:
        s = s.replace(old, new)
    for junk in _DELETED:
        s = s.replace(junk, "")
    s = _MATH_SPAN_RE.sub(r"$\1$", s)
    for unwrap in _UNWRAP_RES:
        s = unwrap.sub(r"\1", s)
    s = _BOXED_GREEDY_RE.sub(r"\1", s)
    s = _FRAC_SHORT_RE.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORT_RE.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer_line(response: str) -> str | None:
    r"""The raw text after the last ``Answer:`` in ``response`` (to the end of its line), or None.

    ``Answer`` matches in any case; whitespace around the ``:`` may include newlines, so
    ``"Answer:\n42"`` gives ``"42"``. An ``Answer:`` with nothing after it on its line and
    nothing on the next does not count. Matches do not overlap: in ``"Answer: 3, Answer: 4"``
    the only match is ``"3, Answer: 4"``. The text is returned unstripped and unnormalised.
    """
    matches = _ANSWER_RE.findall(response)
    return matches[-1] if matches else None


def extract_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (balanced braces), or None.

    The last ``\boxed{`` is taken and its braces are counted (escaped ``\{``/``\}`` count
    too); when they never balance, there is no boxed answer, even if an earlier one is
    complete. ``\boxed 5`` (no brace) is not a boxed answer.
    """
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for pos in range(start + len(_BOX_OPEN) - 1, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOX_OPEN) : pos]
    return None


class DAPOAnswerReward:
    r"""The paper's reward: +1 when the response's final answer matches the truth, else -1.

    The behaviour is verl's ``math_dapo.compute_score`` (verl 0.9.1), step by step:

    1. **Window.** Only the last ``max_response_chars`` (300) characters of the response are
       looked at; an answer further from the end is not seen.
    2. **Answer line.** The last ``Answer:`` match in the window (see
       :func:`extract_answer_line`) is normalised (below), and so is the ground truth; the
       answer is right when the two normalised strings are equal. The prediction
       (``extra["pred"]``) is the normalised answer, ``""`` included (``Answer: $$``).
    3. **Boxed fallback.** When there is no ``Answer:`` match (or its normalised text is the
       sentinel :data:`NO_ANSWER`), the last ``\boxed{...}`` (see :func:`extract_boxed`) in
       the last 100 characters of the window is the prediction, raw: it is compared with the
       *unnormalised* ground truth, so ``\boxed{540}`` matches ``540`` but ``\boxed{ 540 }``
       and ``\boxed{\dfrac{1}{2}}`` do not match ``540`` and ``\frac{1}{2}``.
    4. **Nothing found.** The prediction is :data:`NO_ANSWER` (``"[INVALID]"``) and the
       answer is wrong (unless the ground truth itself normalises to that sentinel).

    With ``strict_box_verify=True`` steps 2-4 are replaced by step 3 alone: the boxed answer
    in the last 100 characters, compared raw; the prediction is None when there is none.
    ``pause_tokens_index`` (a per-sample list of 4 ints, passed to :meth:`score_one` or as a
    per-sample list to ``__call__``) moves step 3's region to start 100 characters before its
    last entry (a position in the 300-character window; a start below 0 counts from the end,
    as a Python slice does).

    **Normalisation** (:func:`normalize_answer`; each step applies to every occurrence):

    1. Keep only what follows the last ``=`` (``x = 5`` -> `` 5``).
    2. Literal rewrites, in order: delete ``"an "``, then ``"a "``; ``.$`` -> ``$``; delete
       ``\$`` (so ``\$5`` -> ``5``), ``"\ "`` and every space; ``mbox`` -> ``text``;
       ``,\text{and}`` and ``\text{and}`` -> ``,``; ``\text{m}`` -> ``\text{}``.
    3. Delete these substrings wherever they occur, in order: ``square``, ``ways``,
       ``integers``, ``dollars``, ``mph``, ``inches``, ``hours``, ``km``, ``units``,
       ``\ldots``, ``sue``, ``points``, ``feet``, ``minutes``, ``digits``, ``cents``,
       ``degrees``, ``cm``, ``gm``, ``pounds``, ``meters``, ``meals``, ``edges``,
       ``students``, ``childrentickets``, ``multiples``, ``\text{s}``, ``\text{.}``,
       ``\text{<newline>s}``, ``\text{}^2``, ``\text{}^3``, ``\text{<newline>}``, ``\text{}``,
       ``\mathrm{th}``, ``^\circ``, ``^{\circ}``, ``\;``, ``,\!``, ``{,}``, ``"``, ``\dots``.
       Deletion is by substring, case-sensitive, not by word (``7apples`` keeps its word).
    4. A line containing two ``$`` is replaced by ``$X$``, X being the text between its
       first two ``$`` (so ``$540$.`` -> ``$540$``, but ``42$.`` is left alone).
    5. ``\text{X}``, then ``\textbf{X}``, then ``\overline{X}`` -> ``X``, X ending at the
       first ``}`` (``0.\overline{12}`` -> ``0.12``).
    6. ``\boxed{X}`` -> ``X``, X ending at the last ``}`` of the line.
    7. ``frac`` followed by two characters, the first not ``{``, gets them braced
       (``\frac12`` -> ``\frac{1}{2}``, ``\dfrac12`` -> ``\dfrac{1}{2}``); ``sqrt`` followed
       by a character other than ``{`` gets it braced (``\sqrt3`` -> ``\sqrt{3}``).
    8. Delete every ``$``.
    9. When the result without its commas is all digits (``str.isdigit``), drop the commas
       (``1,000`` and ``10,00`` -> ``1000``; ``1,000.5`` keeps its comma).
    10. Strip surrounding whitespace.

    Nothing else is normalised: ``\dfrac``/``\tfrac`` stay distinct from ``\frac``,
    ``\left``/``\right``, ``\mathrm{A}``, ``\%``/``%``, ``\,`` and a trailing ``.`` stay, and
    ``5.0`` differs from ``5``.

    Args:
        correct_score: Score of a correct answer (paper and reference: 1.0).
        wrong_score: Score of a wrong or missing answer (paper and reference: -1.0); also the
            failure score.
        max_response_chars: The window of step 1 (reference: 300). A deliberate option:
            ``None`` looks at the whole response.
        strict_box_verify: The reference's ``strict_box_verify`` (default False): score the
            boxed answer only.

    Each result's ``extra`` holds ``pred`` (the reference's prediction: a str, or None in
    strict mode when no box is found) and ``has_answer`` (an answer was found: ``pred`` is
    neither None, ``""`` nor :data:`NO_ANSWER`). A non-str ground truth is turned into a str
    first (the reference accepts str only).
    """

    def __init__(
        self,
        correct_score: float = 1.0,
        wrong_score: float = -1.0,
        max_response_chars: int | None = 300,
        strict_box_verify: bool = False,
    ) -> None:
        if max_response_chars is not None and max_response_chars < 1:
            raise ValueError(
                f"max_response_chars must be >= 1 or None (the whole response), got "
                f"{max_response_chars}."
            )
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.failure_score = wrong_score
        self.max_response_chars = max_response_chars
        self.strict_box_verify = strict_box_verify

    @staticmethod
    def _boxed_region(window: str, pause_tokens_index: list[int] | None) -> str:
        if pause_tokens_index is None:
            return window[-100:]
        if len(pause_tokens_index) != 4:
            raise ValueError(
                f"pause_tokens_index must hold 4 positions, got {len(pause_tokens_index)}."
            )
        return window[int(pause_tokens_index[-1]) - 100 :]

    def judge(
        self, response: str, ground_truth: str, pause_tokens_index: list[int] | None = None
    ) -> tuple[bool, str | None]:
        """``(correct, pred)`` for one response, as the class docstring describes."""
        truth = str(ground_truth)
        window = response
        if self.max_response_chars is not None:
            window = response[-self.max_response_chars :]
        if not self.strict_box_verify:
            line = extract_answer_line(window)
            pred = normalize_answer(line if line is not None else NO_ANSWER)
            if pred != NO_ANSWER:
                return pred == normalize_answer(truth), pred
        boxed = extract_boxed(self._boxed_region(window, pause_tokens_index))
        if boxed is not None or self.strict_box_verify:
            return boxed == truth, boxed
        return NO_ANSWER == normalize_answer(truth), NO_ANSWER

    def score_one(
        self, response: str, ground_truth: str, pause_tokens_index: list[int] | None = None
    ) -> RewardResult:
        """Score one response (see the class docstring)."""
        ok, pred = self.judge(response, ground_truth, pause_tokens_index)
        return RewardResult(
            score=self.correct_score if ok else self.wrong_score,
            acc=ok,
            extra={"has_answer": bool(pred) and pred != NO_ANSWER, "pred": pred},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        pauses = kw.get("pause_tokens_index") or [None] * len(responses)
        return [self.score_one(r, g, p) for r, g, p in zip(responses, ground_truths, pauses)]
