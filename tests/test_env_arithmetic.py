"""The arithmetic environment (dapo_lightning/envs/arithmetic.py): binary tools whose results
chain, the calls that evaluate an expression (pinned against the calculator's independent
parser), and its demonstrations played as RL episodes."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from dapo_lightning.envs import (
    ENVIRONMENTS,
    ArithmeticEnvironment,
    EnvironmentConfig,
    ObservationFormatter,
    evaluate,
    plan_calls,
)
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.sft import training_demonstrations


def call(name: str, a: int, b: int) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': {'a': a, 'b': b}})}</tool_call>"


def record(text: str, answer: str = "0") -> PromptRecord:
    return PromptRecord(text, [{"role": "user", "content": text}], answer)


def test_plan_calls_multiplies_first_then_adds_and_subtracts_left_to_right():
    assert plan_calls("15 * 43 * 75") == ([("multiply", 15, 43), ("multiply", 645, 75)], 48375)
    assert plan_calls("2 + 3 * 4") == ([("multiply", 3, 4), ("add", 2, 12)], 14)
    assert plan_calls("23*47 + 56*12") == (
        [("multiply", 23, 47), ("multiply", 56, 12), ("add", 1081, 672)],
        1753,
    )
    assert plan_calls("9 - 4 - 3") == ([("subtract", 9, 4), ("subtract", 5, 3)], 2)
    assert plan_calls("7") == ([], 7)
    for text in ("(1 + 2) * 3", "8 / 2", "-3 + 4", "3 +", "2 ^ 3", ""):
        assert plan_calls(text) is None, text


def test_plan_calls_value_equals_the_calculators_and_its_calls_chain():
    """On random expressions the planned value is the calculator parser's, and replaying the
    calls (each result fed forward) gives every intermediate value exactly."""
    rng = random.Random(0)
    for _ in range(300):
        terms = [str(rng.randint(0, 99)) for _ in range(rng.randint(1, 5))]
        ops = [rng.choice("+-*") for _ in terms[1:]]
        text = terms[0] + "".join(f" {o} {t}" for o, t in zip(ops, terms[1:]))
        calls, value = plan_calls(text)
        assert value == evaluate(text)
        assert len(calls) == len(ops)
        env = ArithmeticEnvironment()
        results = [int(getattr(env, name)(a, b)) for name, a, b in calls]
        assert results[-1:] == ([value] if calls else [])


def test_tools_answer_and_a_chain_of_two_calls_reads_each_result():
    env = ArithmeticEnvironment()
    env.reset(record("Solve the following multiplication: 15 * 43 * 75."))
    first = env.step(call("multiply", 15, 43))
    assert (first.observation, first.tool_calls, first.tool_errors, first.done) == (
        "645",
        1,
        0,
        False,
    )
    second = env.step(call("multiply", 645, 75))
    assert second.observation == "48375"
    assert env.step(call("subtract", 3, 10)).observation == "-7"
    assert env.step(call("add", 2, 3) + call("add", 5, 5)).observation == "5\n10"
    bad = env.step(call("multiply", 1, 2).replace('"b": 2', '"b": 2, "c": 3'))
    assert bad.tool_errors == 1 and "has no argument 'c'" in bad.observation
    assert (
        env.step(
            '<tool_call>{"name": "multiply", "arguments": {"a": "3", "b": 4}}</tool_call>'
        ).tool_errors
        == 1
    )
    final = env.step("The answer is 48375.")
    assert final.done and final.reward is None  # the run's reward function scores it
    assert ENVIRONMENTS.get("arithmetic").fn is ArithmeticEnvironment


def test_demonstrations_are_one_call_per_turn_then_the_answer():
    env = ArithmeticEnvironment()
    assert env.solution_turns(record("Solve the following multiplication: 15 * 43 * 75.")) == [
        call("multiply", 15, 43), call("multiply", 645, 75), "The answer is 48375.",
    ]  # fmt: skip
    assert env.solution_turns(record("Calculate 7 - 3.")) == [
        call("subtract", 7, 3),
        "The answer is 4.",
    ]
    assert env.solution_turns(record("What is the answer?")) is None
    assert env.solution_turns(record("Calculate 12.")) is None  # no operation: nothing to call


def test_instructions_name_the_tools_and_the_hint_is_optional():
    text = ArithmeticEnvironment().instructions()
    assert "add(a, b), subtract(a, b) and multiply(a, b)" in text
    assert call("multiply", 3, 4) in text and "result of the last call" in text
    assert "result of the last call" not in ArithmeticEnvironment(hint=False).instructions()
    with pytest.raises(ValueError, match="hint must be true or false"):
        ArithmeticEnvironment(hint="yes")
    assert [s["function"]["name"] for s in ArithmeticEnvironment().tool_schemas()] == [
        "add", "multiply", "subtract",
    ]  # fmt: skip


def test_a_chained_demonstration_is_an_rl_episode_with_two_observations(tiny_checkpoint):
    """ "2*3*4=": call, EOS, observation "6", call, EOS, observation "24", answer, EOS (an
    independent build of the tokens); only the three assistant turns are in the loss mask."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    r = record("2*3*4=")
    r.prompt_ids = encode_prompt(tokenizer, r.prompt, True)
    rollouts = training_demonstrations(
        [r], EnvironmentConfig(name="arithmetic"), tokenizer, max_tokens=200,
        max_episode_tokens=512,
    )  # fmt: skip
    eos = tokenizer.eos_token_id
    observe = ObservationFormatter(tokenizer, "tool", True)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first, second = ids(call("multiply", 2, 3)), ids(call("multiply", 6, 4))
    answer = ids("The answer is 24.")
    obs1, obs2 = observe("6"), observe("24")
    assert rollouts.response_ids == [[*first, eos, *obs1, *second, eos, *obs2, *answer, eos]]
    assert rollouts.token_mask == [
        [1] * (len(first) + 1) + [0] * len(obs1) + [1] * (len(second) + 1) + [0] * len(obs2)
        + [1] * (len(answer) + 1)
    ]  # fmt: skip
