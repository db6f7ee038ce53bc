r"""The DAPO "Answer:" reward against verl's ``math_dapo.compute_score``.

``tests/data/verl_math_dapo_outputs.json`` holds verl's score, acc and prediction on every case
of ``tests/data/dapo_reward_corpus.jsonl``, recorded by ``scripts/record_verl_rewards.py`` from
the real verl module (verl itself is not needed here). The worked examples below write the
expected values out, one group per kind of tricky answer, so that a change of behaviour reads
as a change of a visible value; the real AIME 2024 data checks the rule end to end.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dapo_lightning.rewards import DAPOAnswerReward, extract_answer_line, normalize_answer
from dapo_lightning.rewards.dapo import NO_ANSWER, extract_boxed

DATA = Path(__file__).parent / "data"
CORPUS = [
    json.loads(line)
    for line in (DATA / "dapo_reward_corpus.jsonl").read_text().splitlines()
    if line.strip()
]
VERL = json.loads((DATA / "verl_math_dapo_outputs.json").read_text())
VERL_BY_ID = {c["id"]: c for c in VERL["cases"]}
AIME = "/work/shared/data/aime-2024.parquet"
OPTIONS = ("strict_box_verify", "pause_tokens_index")


def _digest(case: dict) -> str:
    """The recording script's digest of a case's inputs (see scripts/record_verl_rewards.py)."""
    inputs = {k: case[k] for k in ("response", "ground_truth", *OPTIONS) if k in case}
    return hashlib.sha256(
        json.dumps(inputs, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()


def _score(response: str, truth: str, **opts):
    pause = opts.pop("pause_tokens_index", None)
    return DAPOAnswerReward(**opts).score_one(response, truth, pause)


# ---------------------------------------------------------------- the verl fixture


def test_fixture_matches_corpus():
    assert VERL["verl_version"] and VERL["date"]
    assert len(CORPUS) >= 60
    assert VERL["num_cases"] == len(CORPUS) == len(VERL_BY_ID)
    assert [c["id"] for c in CORPUS] == [c["id"] for c in VERL["cases"]]
    # A corpus case edited after recording must be recorded again.
    stale = [c["id"] for c in CORPUS if _digest(c) != VERL_BY_ID[c["id"]]["inputs_sha256"]]
    assert not stale, f"re-run scripts/record_verl_rewards.py: {stale}"
    categories = {c["category"] for c in CORPUS}
    for needed in ("boxed", "window", "frac", "period", "decimal", "percent", "units",
                   "leftright", "mathrm", "overline", "thousands", "dollar", "negative",
                   "multiple", "empty", "strict"):  # fmt: skip
        assert needed in categories, needed


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_equals_verl_math_dapo(case):
    ref = VERL_BY_ID[case["id"]]
    opts = {k: case[k] for k in OPTIONS if k in case}
    res = _score(case["response"], case["ground_truth"], **opts)
    assert (res.score, res.acc, res.extra["pred"]) == (ref["score"], ref["acc"], ref["pred"])
    assert isinstance(res.acc, bool) and isinstance(res.score, float)
    assert res.extra["has_answer"] == (ref["pred"] not in (None, "", NO_ANSWER))
    json.dumps(res.extra)  # plain python only


# ---------------------------------------------------------------- worked examples

# (response, ground truth, score, pred), grouped by what each group shows.
WORKED = {
    "ordinary": [
        ("Some work.\nAnswer: 540", "540", 1.0, "540"),
        ("Some work.\nAnswer: 541", "540", -1.0, "541"),
        ("answer : 540", "540", 1.0, "540"),
        ("Answer:\n540", "540", 1.0, "540"),
        ("Answer: x = 5", "5", 1.0, "5"),
        ("**Answer:** 540", "540", -1.0, "**540"),
        ("Answer: The answer is 42", "42", -1.0, "Theansweris42"),
        ("The answer is 540", "540", -1.0, NO_ANSWER),
    ],
    "multiple Answer lines: the last wins": [
        ("Answer: 540\nWait, no.\nAnswer: 541", "540", -1.0, "541"),
        ("Answer: 541\nOops.\nAnswer: 540", "540", 1.0, "540"),
        ("Answer: 3 or maybe Answer: 540", "540", -1.0, "3ormaybeAnswer:540"),
    ],
    "empty": [
        ("", "540", -1.0, NO_ANSWER),
        ("Work...\nAnswer:", "540", -1.0, NO_ANSWER),
        ("Work...\nAnswer: ", "540", -1.0, ""),
        ("Answer: $$", "540", -1.0, ""),
    ],
    "boxed fallback (no Answer line), compared raw": [
        ("So we get \\boxed{540}.", "540", 1.0, "540"),
        ("Thus $\\boxed{540}$", "540", 1.0, "540"),
        ("Thus \\boxed{ 540 }", "540", -1.0, " 540 "),
        ("Thus \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0, "\\frac{\\sqrt{3}}{2}"),
        ("Thus \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", -1.0, "\\dfrac{1}{2}"),
        ("First \\boxed{541}, then \\boxed{540}", "540", 1.0, "540"),
        ("Thus \\boxed{540", "540", -1.0, NO_ANSWER),
        ("Thus \\boxed{541}\nAnswer: 540", "540", 1.0, "540"),
        ("Thus \\boxed{540}\n" + "x" * 100, "540", -1.0, NO_ANSWER),
        ("Thus \\boxed{540}", "\\boxed{540}", -1.0, "540"),
        ("Answer: $\\boxed{540}$.", "540", 1.0, "540"),
    ],
    "dfrac is not frac; shorthand gets braces": [
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", -1.0, "\\dfrac{1}{2}"),
        ("Answer: \\dfrac{1}{2}", "\\dfrac{1}{2}", 1.0, "\\dfrac{1}{2}"),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
        ("Answer: \\frac 34", "\\frac{3}{4}", 1.0, "\\frac{3}{4}"),
        ("Answer: 2\\sqrt3", "2\\sqrt{3}", 1.0, "2\\sqrt{3}"),
        ("Answer: 3/4", "\\frac{3}{4}", -1.0, "3/4"),
    ],
    "trailing periods": [
        ("Answer: 540.", "540", -1.0, "540."),
        ("Answer: $540$.", "540", 1.0, "540"),
        ("Answer: $540.$", "540", 1.0, "540"),
        ("Answer: 42$.", "42", -1.0, "42."),
    ],
    "5.0 is not 5": [
        ("Answer: 5.0", "5", -1.0, "5.0"),
        ("Answer: 0.5", "0.5", 1.0, "0.5"),
    ],
    "percent stays": [
        ("Answer: 12\\%", "12", -1.0, "12\\%"),
        ("Answer: 12%", "12", -1.0, "12%"),
        ("Answer: 12\\%", "12\\%", 1.0, "12\\%"),
    ],
    "units and words: listed substrings go": [
        ("Answer: 10 km", "10", 1.0, "10"),
        ("Answer: 12 students", "12", 1.0, "12"),
        ("Answer: 3 square units", "3", 1.0, "3"),
        ("Answer: 30^\\circ", "30", 1.0, "30"),
        ("Answer: 10\\text{ cm}", "10", 1.0, "10"),
        ("Answer: an ellipse", "ellipse", 1.0, "ellipse"),
        ("Answer: 7 apples", "7", -1.0, "7apples"),
        ("Answer: 30\u00b0", "30", -1.0, "30\u00b0"),
    ],
    "left/right stay": [
        ("Answer: \\left(1, 2\\right)", "(1,2)", -1.0, "\\left(1,2\\right)"),
        ("Answer: (1, 2)", "(1,2)", 1.0, "(1,2)"),
    ],
    "mathrm stays, text/textbf/mbox unwrap": [
        ("Answer: \\mathrm{A}", "A", -1.0, "\\mathrm{A}"),
        ("Answer: \\text{A}", "A", 1.0, "A"),
        ("Answer: \\mbox{A}", "A", 1.0, "A"),
        ("Answer: 5\\mathrm{th}", "5", 1.0, "5"),
    ],
    "overline unwraps": [
        ("Answer: 0.\\overline{12}", "0.12", 1.0, "0.12"),
        ("Answer: \\overline{12}", "12", 1.0, "12"),
    ],
    "thousands separators": [
        ("Answer: 1,000", "1000", 1.0, "1000"),
        ("Answer: 1{,}000", "1000", 1.0, "1000"),
        ("Answer: 1,\\!000", "1000", 1.0, "1000"),
        ("Answer: 1\\,000", "1000", -1.0, "1\\,000"),
        ("Answer: 10,00", "1000", 1.0, "1000"),
        ("Answer: 1,000.5", "1000.5", -1.0, "1,000.5"),
    ],
    "negative numbers": [
        ("Answer: -5", "-5", 1.0, "-5"),
        ("Answer: -5", "5", -1.0, "-5"),
        ("Answer: $-\\frac{1}{2}$", "-\\frac{1}{2}", 1.0, "-\\frac{1}{2}"),
        ("Answer: \u22125", "-5", -1.0, "\u22125"),
    ],
}


@pytest.mark.parametrize(
    "response,truth,score,pred",
    [case for group in WORKED.values() for case in group],
    ids=[f"{name}-{i}" for name, group in WORKED.items() for i in range(len(group))],
)
def test_worked_examples(response, truth, score, pred):
    res = _score(response, truth)
    assert (res.score, res.acc, res.extra["pred"]) == (score, score > 0, pred)


def test_escaped_dollar_regression():
    # The old implementation stripped "$" before "\$", leaving "\5".
    for response, pred in (
        ("Answer: \\$5", "5"),
        ("Answer: $\\$5$", "5"),
        ("Answer: \\$1,000", "1000"),
        ("Answer: \\$5.50", "5.50"),
    ):
        res = _score(response, pred)
        assert (res.score, res.extra["pred"]) == (1.0, pred), response
    assert normalize_answer("\\$5") == "5"


def test_window_is_last_300_chars():
    filler = "\n" + "x" * 288
    near = "Answer: 540" + filler  # 300 characters: the label is just inside
    assert _score(near, "540").score == 1.0
    assert _score("A" + near, "540").score == 1.0
    far = "Answer: 540\n" + filler  # 301 characters: the "A" falls out
    res = _score(far, "540")
    assert (res.score, res.extra["pred"], res.extra["has_answer"]) == (-1.0, NO_ANSWER, False)
    # The deliberate option: the whole response.
    assert _score(far, "540", max_response_chars=None).score == 1.0
    assert _score("Answer: 540\n" + "y" * 5000, "540", max_response_chars=None).score == 1.0
    with pytest.raises(ValueError, match="max_response_chars"):
        DAPOAnswerReward(max_response_chars=0)


def test_strict_box_and_pause_tokens():
    res = _score("Answer: 540", "540", strict_box_verify=True)
    assert (res.score, res.extra["pred"], res.extra["has_answer"]) == (-1.0, None, False)
    assert _score("Answer: 541\n\\boxed{540}", "540", strict_box_verify=True).score == 1.0
    boxed_early = "\\boxed{540}" + "z" * 150
    assert _score(boxed_early, "540").extra["pred"] == NO_ANSWER
    assert _score(boxed_early, "540", pause_tokens_index=[0, 0, 0, 100]).score == 1.0
    # Through the batch call, as the runner passes per-sample keyword lists.
    reward = DAPOAnswerReward()
    out = reward(
        [boxed_early, boxed_early], ["540", "540"], pause_tokens_index=[None, [1, 2, 3, 100]]
    )
    assert [r.score for r in out] == [-1.0, 1.0]
    with pytest.raises(ValueError, match="4 positions"):
        reward.score_one(boxed_early, "540", [100])


def test_helpers_and_pickling():
    assert extract_answer_line("Answer: 1\nanswer:  2 ") == "2 "
    assert extract_answer_line("no label") is None
    assert extract_boxed("\\boxed{a{b}c} and \\boxed{d}") == "d"
    assert extract_boxed("\\boxed{d} and \\boxed{e") is None
    reward = pickle.loads(pickle.dumps(DAPOAnswerReward(strict_box_verify=True)))
    assert reward.strict_box_verify and reward.failure_score == -1.0


# normalize_answer, moved from tests/test_rewards.py; the values are now the reference's
# ("540.", "5.0", "12 \\%" and "\\dfrac" are no longer rewritten).
@pytest.mark.parametrize(
    "raw,norm",
    [
        ("$540$", "540"),
        ("\\boxed{540}", "540"),
        ("540.", "540."),
        ("1,000", "1000"),
        ("x = 5", "5"),
        ("30 degrees", "30"),
        ("30^\\circ", "30"),
        ("\\dfrac{1}{2}", "\\dfrac{1}{2}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\text{(A)}", "(A)"),
        ("5.0", "5.0"),
        ("12 \\%", "12\\%"),
        ("\\$5", "5"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


# ---------------------------------------------------------------- real data


def test_dapo_rule_on_every_aime_row():
    rows = pq.read_table(AIME).to_pylist()
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    assert len(truths) >= 900 and all(r["data_source"] == "math_dapo" for r in rows)
    reward = DAPOAnswerReward()
    right = [f"Some work.\nSo the result is clear.\nAnswer: {t}" for t in truths]
    variants = [f"reasoning...\nAnswer: $\\boxed{{{t}}}$." for t in truths]
    boxed_only = [f"so the result is \\boxed{{{t}}}" for t in truths]
    wrong = [f"Answer: {t}\nWait, no.\nAnswer: {int(t) + 1}" for t in truths]
    missing = [f"The answer is {t}" for t in truths]
    for batch, expect in (
        (right, 1.0), (variants, 1.0), (boxed_only, 1.0), (wrong, -1.0), (missing, -1.0)
    ):  # fmt: skip
        res = reward(batch, truths)
        assert [r.score for r in res] == [expect] * len(truths)
        assert all(r.acc == (expect > 0) for r in res)
    assert all(r.extra["has_answer"] for r in reward(wrong, truths))
    assert not any(r.extra["has_answer"] for r in reward(missing, truths))
