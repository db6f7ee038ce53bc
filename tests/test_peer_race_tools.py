"""TRL's tool calling on the agent recipe (``benchmarks/peer_race_tools.py``, issue 57): what
TRL 1.16 refuses with SmolLM2's kind of chat template, and its multi-turn loop running two
updates on the tiny model with the cold start's call format, our tools and our observation
tokens."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("reasoning_gym")

from benchmarks.peer_race_tools import (  # noqa: E402
    TAG_RESPONSE_TEMPLATE,
    TINY_PROMPT_LENGTH,
    arithmetic_tools,
    build_trl_tools,
    tiny_model,
    tool_tokenizer,
    with_tool_calls,
)
from dapo_lightning.envs.arithmetic import ArithmeticEnvironment, call_text  # noqa: E402
from dapo_lightning.envs.runner import ObservationFormatter  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _trainer(model_dir: Path, tokenizer: Any, out: Path, **tools: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=GRPOConfig(
            output_dir=str(out),
            use_cpu=True,
            report_to=[],
            num_generations=2,
            per_device_train_batch_size=2,
        ),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "2 * 3?"}]}]),
        processing_class=tokenizer,
        **(tools or {"tools": arithmetic_tools()}),
    )


def test_trl_refuses_a_chatml_template_then_an_unknown_one(model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's (and the tiny model's) ChatML template drops ``tool_calls``: TRL's
    ``supports_tool_calling`` refuses it; with the calls rendered, ``add_response_schema``
    refuses the template it does not know. Our two settings get past both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="does not support tool calling"):
        _trainer(model_dir, tokenizer, tmp_path)
    tokenizer.chat_template = with_tool_calls(tokenizer.chat_template)
    with pytest.raises(ValueError, match="Unrecognized chat template, failed to add response"):
        _trainer(model_dir, tokenizer, tmp_path)
    tokenizer.response_template = TAG_RESPONSE_TEMPLATE
    assert _trainer(model_dir, tokenizer, tmp_path).tools


def test_trl_environment_factory_offers_every_public_method(
    model_dir: Path, tmp_path: Path
) -> None:
    """``environment_factory=ArithmeticEnvironment``: TRL takes every public function of the
    class but ``reset`` as a tool, and parsing a turn then fails on a method that is no tool."""
    from transformers.utils.chat_template_utils import DocstringParsingException
    from trl.chat_template_utils import parse_response

    tokenizer = tool_tokenizer(model_dir)
    trainer = _trainer(model_dir, tokenizer, tmp_path, environment_factory=ArithmeticEnvironment)
    names = sorted(t.__name__ for t in trainer.tools)
    assert names == ["add", "instructions", "multiply", "prompt_example", "reward",
                     "solution_turns", "step", "subtract", "tool_functions", "tool_schemas"]  # fmt: skip
    ids = tokenizer(call_text(("multiply", 2, 3)), add_special_tokens=False)["input_ids"]
    with pytest.raises(DocstringParsingException, match="for reward because the docstring"):
        parse_response(tokenizer, ids, prefix=[], tools=trainer._env_tools[None])


def test_with_tool_calls_writes_the_cold_start_format(model_dir: Path) -> None:
    """An assistant message's tool call renders exactly as the cold start's demonstrations
    write it; a template without the ChatML content line is refused."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = with_tool_calls(tokenizer.chat_template)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 4, "b": 7}}}
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ],
        tokenize=False,
    )
    assert f"<|im_start|>assistant\n{call_text(('multiply', 4, 7))}<|im_end|>" in text
    with pytest.raises(ValueError, match="exactly once"):
        with_tool_calls("{{ messages[0]['content'] }}")


def test_trl_runs_two_updates_with_our_calls_tools_and_observations(
    model_dir: Path, tmp_path: Path
) -> None:
    """The first turn of every episode is forced to a tag-format call (half of them with an
    argument the schema refuses); TRL parses each, runs our environment's tool, appends the
    episode runner's observation tokens (masked out of the loss), lets the model write the
    next turn, scores it and makes two updates."""
    args = argparse.Namespace(
        max_updates=2, trl_generation="hf", budget_min=60.0, every_min=60.0, clock="cpu",
        cores=1, max_prompt_length=TINY_PROMPT_LENGTH,
    )  # fmt: skip
    trainer, score = build_trl_tools(model_dir, tmp_path, 0, args)
    tokenizer = trainer.processing_class
    good = call_text(("multiply", 15, 43))
    bad = '<tool_call>{"name": "multiply", "arguments": {"a": 15, "b": 43, "c": 2}}</tool_call>'
    forced = [tokenizer(t + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
              for t in (good, bad)]  # fmt: skip
    single_turn = trainer._generate_single_turn

    def first_turn_forced(prompt_ids: list[list[int]], *a: Any, **kw: Any) -> Any:
        if len(prompt_ids) == trainer.args.generation_batch_size:  # the first turn
            return [list(forced[k % 2]) for k in range(len(prompt_ids))], None
        return single_turn(prompt_ids, *a, **kw)

    batches = []
    generate = trainer._generate

    def keep(*a: Any, **kw: Any) -> Any:
        batches.append(generate(*a, **kw))
        return batches[-1]

    trainer._generate_single_turn = first_turn_forced
    trainer._generate = keep
    trainer.train()

    assert trainer.state.global_step == 2 and len(batches) == 1
    _, completion_ids, tool_mask, completions, *_ = batches[0]
    env, formatter = ArithmeticEnvironment(), ObservationFormatter(tokenizer, "tool")
    answers = {0: "645", 1: env.step(bad).observation}
    assert answers[1] == "error: multiply() has no argument 'c' (arguments: ['a', 'b'])"
    for k, (ids, mask, messages) in enumerate(zip(completion_ids, tool_mask, completions)):
        call = messages[0]["tool_calls"][0]["function"]
        assert call == {
            "name": "multiply",
            "arguments": {"a": 15, "b": 43, **({"c": 2} if k % 2 else {})},
        }
        assert messages[1] == {"role": "tool", "name": "multiply", "content": answers[k % 2]}
        observation = formatter(answers[k % 2])
        start, end = len(forced[k % 2]), len(forced[k % 2]) + len(observation)
        assert ids[:start] == forced[k % 2] and ids[start:end] == observation
        assert mask[:start] == [1] * start and mask[start:end] == [0] * len(observation)
        assert all(mask[end:])
    (row,) = score.rows
    assert row["calling"] == 1.0 and row["calls_per_episode"] == 1.0
    assert row["tool_errors_per_call"] == 0.5 and row["turns"] >= 1.5
    assert row["acc"] == 0.0 and row["zero_std_groups"] == 1.0  # a random model is never right
    assert (tmp_path / "snapshots.jsonl").exists()
