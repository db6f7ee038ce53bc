"""Tools (dapo_lightning/envs/tools.py): an environment whose public typed methods are its
tools: the schemas read from signatures and docstrings (pinned), calls checked against them,
the environment's own reward, the instructions, and a chat template that renders tools."""

from __future__ import annotations

import json

import pytest
from _episode_envs import Shop
from transformers import AutoTokenizer

from dapo_lightning.checks import ConfigError
from dapo_lightning.envs import (
    CalculatorEnvironment,
    StepResult,
    ToolEnvironment,
    introduce_tools,
    prompt_tools,
    template_renders_tools,
)
from dapo_lightning.prompts import PromptRecord, encode_prompt


def call(tool: str, /, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def test_schemas_come_from_the_signatures_and_docstrings():
    assert Shop().tool_schemas() == [
        {
            "type": "function",
            "function": {
                "name": "price",
                "description": "The price of one item, in cents.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "item": {
                            "type": "string",
                            "description": "The item's name (apple or pear).",
                        }
                    },
                    "required": ["item"],
                },
                "return": {"type": "integer"},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "total",
                "description": "The cost of several items of one price.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "unit_cents": {
                            "type": "integer",
                            "description": "One item's price, in cents.",
                        },
                        "count": {"type": "integer", "description": "How many items."},
                    },
                    "required": ["unit_cents"],
                },
                "return": {"type": "integer"},
            },
        },
    ]
    assert sorted(Shop().tool_functions()) == ["price", "total"]  # not PRICES, reward, step


def test_calls_run_the_methods_and_bad_calls_are_tool_errors():
    env = Shop()
    env.reset(PromptRecord("u", "How much are 3 pears?", "135"))
    both = env.step(call("price", item="pear") + call("total", unit_cents=45, count=3))
    assert both == StepResult(observation="45\n135", tool_calls=2, metrics={"answer_chars": 0.0})
    cases = [
        (call("price", item=3), "price() argument 'item' must be string, got 3"),
        (call("total", unit_cents=True), "total() argument 'unit_cents' must be integer, got true"),
        (call("total", unit_cents=4.5), "total() argument 'unit_cents' must be integer, got 4.5"),
        (call("total", count=2), "total() needs the argument(s) ['unit_cents']"),
        (call("price", item="fig"), "'fig'"),  # the method's own KeyError
        (call("price", name="pear"), "price() has no argument 'name' (arguments: ['item'])"),
        (call("refund"), "no tool named 'refund' (tools: ['price', 'total'])"),
    ]
    for text, error in cases:
        result = env.step(text)
        assert (result.observation, result.tool_calls, result.tool_errors) == (
            f"error: {error}",
            1,
            1,
        )
    assert not result.done


def test_the_final_turn_gets_the_environments_reward():
    env = Shop()
    env.reset(PromptRecord("u", "How much are 3 pears?", "135"))
    assert env.step("It is 135 cents.") == StepResult(
        done=True, reward=1.0, metrics={"answer_chars": 16.0}
    )
    assert env.step("About 100.").reward == -1.0
    calculator = CalculatorEnvironment()  # no reward method: the run's reward function scores
    calculator.reset(PromptRecord("u", "q", "12"))
    assert calculator.step("12") == StepResult(done=True)


def test_a_tool_method_without_hints_or_docstring_is_a_config_error_naming_it():
    class NoHint(ToolEnvironment):
        def look(self, x):
            """Look.

            Args:
                x: What.
            """
            return "seen"

    class NoDoc(ToolEnvironment):
        def look(self, x: str) -> str:
            return "seen"

    for cls in (NoHint, NoDoc):
        with pytest.raises(
            ConfigError, match=rf"environment tool {cls.__name__}\.look: .*type hint"
        ):
            cls().tool_schemas()


def test_helpers_statics_and_properties_are_not_tools():
    class Env(ToolEnvironment):
        def _helper(self) -> str:
            return ""

        @staticmethod
        def util(x: int) -> int:
            return x

        @property
        def size(self) -> int:
            return 1

        def echo(self, text: str) -> str:
            """Echo.

            Args:
                text: The text.
            """
            return text

    assert [s["function"]["name"] for s in Env().tool_schemas()] == ["echo"]


def test_instructions_list_the_schemas_and_the_tag_format():
    text = Shop().instructions()
    assert json.dumps(Shop().tool_schemas()[0]["function"]) in text
    assert json.dumps(Shop().tool_schemas()[1]["function"]) in text
    assert '<tool_call>{"name": "price", "arguments": {}}</tool_call>' in text
    assert "calculator" in CalculatorEnvironment().instructions()  # its own, with an example


#: A chat template that renders tools= in the tag format (Qwen2.5's way, shortened).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}"
    "{%- endfor %}\nCall one as <tool_call>{...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_renders_tools_gets_the_schemas_not_the_instructions(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert not template_renders_tools(tokenizer)  # ChatML without a tool section
    assert prompt_tools(Shop(), tokenizer, True) == (Shop().instructions(), None)
    tokenizer.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(tokenizer)
    text, tools = prompt_tools(Shop(), tokenizer, True)
    assert text is None and tools == Shop().tool_schemas()
    assert prompt_tools(Shop(), tokenizer, False) == (Shop().instructions(), None)
    ids = encode_prompt(tokenizer, "How much are 3 pears?", True, tools)
    rendered = tokenizer.decode(ids)
    assert rendered.startswith('<|im_start|>system\nTools:{"type": "function", "function": {"name"')
    assert '"name": "total"' in rendered and rendered.endswith("<|im_start|>assistant")
    records = [PromptRecord("u", "How much are 3 pears?", "135")]
    assert introduce_tools(records, Shop(), tokenizer, True) == tools
    assert records[0].prompt == "How much are 3 pears?"  # the template tells of the tools
    assert introduce_tools(records, Shop(), tokenizer, False) is None
    assert records[0].prompt == f"{Shop().instructions()}\n\nHow much are 3 pears?"


@pytest.mark.parametrize(
    ("old", "new"), [("demonstration", "prompt_example"), ("demonstrate", "solution_turns")]
)
def test_an_environment_with_an_old_method_name_is_told_the_new_one(old, new):
    """A subclass written for an earlier release (demonstration(), demonstrate(record)) fails
    at class creation naming the method to rename to, not silently without demonstrations."""
    with pytest.raises(TypeError, match=rf"Old\.{old} is not read any more: rename it to {new}"):
        type("Old", (ToolEnvironment,), {old: lambda self, *a: None})
