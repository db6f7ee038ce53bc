"""The cold start (dapo_lightning.sft): demonstrations an environment writes, played through the
episode runner, and the supervised warm-up on them; ``dapo-lightning sft`` on the tiny model."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.sft_command import sft_main
from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.sampling.producer import DynamicSamplingConfig
from dapo_lightning.envs import EnvironmentConfig
from dapo_lightning.envs.calculator import EXAMPLE, CalculatorEnvironment
from dapo_lightning.envs.runner import ObservationFormatter
from dapo_lightning.envs.session import introduce_tools
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.sft import (
    Demonstrations,
    SFTConfig,
    SFTSettings,
    load_demonstration_records,
    masked_nll,
    pad_demonstrations,
    run_sft,
    training_demonstrations,
)
from dapo_lightning.tasks import get_task
from tests._harness import run_cli
from tests.test_cli import read_csv, series
from tests.test_envs_fit import HF_STOPS, fit

#: The tiny tokenizer spells bytes: a call is ~80 tokens, a prompt with the instructions ~290.
CALCULATOR = EnvironmentConfig(name="calculator", max_turns=3, max_episode_tokens=512)
TASK = {
    "task": "arithmetic",
    "task_kwargs": {"level": 1, "num_prompts": 12},
    "max_prompt_length": 320,
}


def test_masked_nll_is_the_token_mean_of_the_masked_negative_log_likelihoods():
    logp = torch.tensor([[-0.5, -2.0, -9.0], [-1.0, -7.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_nll(logp, mask).item() == pytest.approx((0.5 + 2.0 + 1.0 + 3.0) / 4)
    assert masked_nll(logp, torch.zeros_like(mask)).item() == 0.0  # nothing counts: 0, not NaN


def test_the_calculator_demonstrates_a_call_on_the_question_and_its_value():
    def demo(text):
        return CalculatorEnvironment().solution_turns(
            PromptRecord("u", [{"role": "user", "content": text}], "0")
        )

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "57 * 87"}}</tool_call>'
    assert demo("Solve the following multiplication: 57 * 87. Give only the result.") == [
        call,
        "The answer is 4959.",
    ]
    assert demo("What is (12 + 3) * 4?")[1] == "The answer is 60."
    assert demo("2+3=")[1] == "The answer is 5."
    assert demo("No arithmetic in 2025 here.") is None


def test_the_worked_example_sits_between_the_instructions_and_the_question(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    records = [PromptRecord("u", [{"role": "user", "content": "2+3="}], "5")]
    introduce_tools(records, CalculatorEnvironment(example=True), tokenizer, True, "user")
    roles = [m["role"] for m in records[0].prompt]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert records[0].prompt[1:5] == [
        {**m, "role": "user"} if m["role"] == "tool" else m for m in EXAMPLE
    ]
    assert records[0].prompt[-1]["content"] == "2+3="
    plain = [PromptRecord("u", "2+3=", "5")]
    introduce_tools(plain, CalculatorEnvironment(example=True), tokenizer, False)
    assert plain[0].prompt.endswith("tool: 413\nassistant: 12 * 34 + 5 = 413\n\n2+3=")


def test_fit_and_the_cold_start_prepare_the_same_prompts(tiny_checkpoint, tmp_path):
    """One preparation (data.loading.prepare_prompts): the data module's train records and the
    cold start's, for the same prompts, environment and seed, have the same uids and ids, and
    those ids are an independent encode of the task's question after the calculator's
    instructions as a system message (the tiny template renders no tools)."""
    dm = DAPODataModule(
        str(tiny_checkpoint), prompts=PromptConfig(**TASK), environment=CALCULATOR, seed=3,
        scoring=ScoringConfig(in_process=True), sampling=SamplingConfig(max_tokens=160),
        validation=ValidationConfig(fraction=0.25),
        dynamic_sampling=DynamicSamplingConfig(n=2, train_batch_size=4),
    )  # fmt: skip
    try:
        dm.setup("fit")
    finally:
        dm.teardown()
    config = SFTConfig(
        model_name_or_path=str(tiny_checkpoint), output_dir=str(tmp_path / "o"), prompts=TASK,
        environment=CALCULATOR, seed=3,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    records = load_demonstration_records(config, tokenizer)  # no held-out prompts
    assert len(dm.train_records) == 9 and len(dm.val_records) == 3 and len(records) == 12
    ours = {r.uid: r.prompt_ids for r in records}
    assert all(ours[r.uid] == r.prompt_ids for r in dm.train_records + dm.val_records)
    rows = get_task("arithmetic").make_rows(seed=3, level=1, num_prompts=12)
    system = {"role": "system", "content": CalculatorEnvironment().instructions()}
    assert [r.uid for r in records] == [row["uid"] for row in rows]
    for row, r in zip(rows, records):
        messages = [system, {"role": "user", "content": row["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert r.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_demonstrations_are_episodes_with_the_rl_layout_and_masks(tiny_checkpoint):
    """Each demonstration is the call + EOS, the chat template's observation of its value, the
    answer + EOS: an independent build of those tokens equals it, and only the two assistant
    turns are in the loss mask."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    questions = {"2+3=": "5", "7*6=": "42", "no sum": None}
    records = [PromptRecord(q, [{"role": "user", "content": q}], "0") for q in questions]
    for r in records:
        r.prompt_ids = encode_prompt(tokenizer, r.prompt, True)
    rollouts = training_demonstrations(
        records, CALCULATOR, tokenizer, max_tokens=160, max_episode_tokens=512
    )
    assert len(rollouts) == 2  # "no sum": no demonstration
    assert rollouts.prompt_ids == [r.prompt_ids for r in records[:2]]
    eos = tokenizer.eos_token_id
    observe = ObservationFormatter(tokenizer, "tool", True)
    for (question, value), ids, mask in zip(
        list(questions.items())[:2], rollouts.response_ids, rollouts.token_mask
    ):
        expression = question.rstrip("=")
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        first = tokenizer(f"<tool_call>{call}</tool_call>", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f"The answer is {value}.", add_special_tokens=False)["input_ids"]
        obs = observe(value)
        assert ids == [*first, eos, *obs, *answer, eos]
        assert mask == [1] * (len(first) + 1) + [0] * len(obs) + [1] * (len(answer) + 1)
    batch = pad_demonstrations(rollouts, pad_token_id=0)
    assert batch.response_mask.sum().item() == sum(map(sum, rollouts.token_mask))


def test_demonstrations_are_padded_in_the_rollout_batch_layout():
    """Prompts left-padded, episodes right-padded, the token mask on the episode columns: the
    pinned tensors of two rows, and those RolloutBatch builds from the same rows."""
    demos = Demonstrations(
        prompt_ids=[[5, 6], [7]], response_ids=[[8, 9, 10], [11]], token_mask=[[1, 0, 1], [1]]
    )
    batch = pad_demonstrations(demos, pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10], [0, 7, 11, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert batch.response_width == 3 and batch.batch_size == 2
    ones = torch.ones(2)
    rl = RolloutBatch.from_rollouts(
        ScoredRollouts(
            prompt_ids=demos.prompt_ids, response_ids=demos.response_ids,
            rollout_log_probs=[[0.0] * 3, [0.0]], finish_reason=["stop"] * 2,
            group_index=torch.arange(2), prompt_uid=["a", "b"], score=ones, acc=ones,
            reward=ones, loss_mask=torch.ones(2, dtype=torch.bool),
            sampling=SamplingConfig(max_tokens=3), token_mask=demos.token_mask,
        ),
        group_size=1, pad_token_id=0,
    )  # fmt: skip
    for name in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(batch, name), getattr(rl, name)), name
    assert demos.select([1, 0]).prompt_ids == [[7], [5, 6]]


def _demo_nll(model_dir, rollouts):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = pad_demonstrations(rollouts, pad_token_id=0)
    with torch.no_grad():
        logp, _ = response_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.response_width
        )
    return masked_nll(logp, batch.response_mask).item()


def test_the_warm_up_lowers_the_demonstrations_nll_and_writes_a_loadable_model(
    tmp_path, tiny_checkpoint
):
    out = tmp_path / "warm"
    config = SFTConfig(
        model_name_or_path=str(tiny_checkpoint), output_dir=str(out), prompts=TASK,
        environment=CALCULATOR, max_tokens=160,
        train=SFTSettings(steps=6, lr=3e-3, batch_size=4), accelerator="cpu", precision="32-true",
    )  # fmt: skip
    assert run_sft(config) == out
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    records = load_demonstration_records(config, tokenizer)
    assert len(records) == 12 and "calculator" in records[0].prompt[0]["content"]
    rollouts = training_demonstrations(
        records, CALCULATOR, tokenizer, max_tokens=160, max_episode_tokens=512
    )
    before, after = _demo_nll(tiny_checkpoint, rollouts), _demo_nll(out, rollouts)
    assert math.isfinite(after) and after < before - 1.0, (before, after)
    losses = [
        float(row.split(",")[1])
        for row in (tmp_path / "warm-logs" / "metrics.csv").read_text().splitlines()[1:]
    ]
    assert len(losses) == 6 and losses[-1] < losses[0]
    summary = json.loads((tmp_path / "warm-logs" / "sft_summary.json").read_text())
    assert summary["demonstrations"] == 12 and summary["steps"] == 6


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--train.steps", "0"], "train.steps"),
        (["--train.lr", "-1"], "train.lr"),
        (["--train.lr", "nan"], "train.lr"),
        (["--environment.max_turns", "0"], "environment.max_turns"),
        (["--train.stepz", "3"], "train.stepz is not an option. Did you mean train.steps?"),
        (["--train.step", "3"], "train.step is not an option"),  # no prefix taken for a key
        (["--torch_dtype", "float8"], "torch_dtype"),
        (["--max_tokens", "0"], "max_tokens"),
    ],
)
def test_bad_sft_settings_are_one_error_line_naming_the_field(
    tmp_path, tiny_checkpoint, args, field
):
    argv = [
        "--model_name_or_path",
        str(tiny_checkpoint),
        "--output_dir",
        str(tmp_path / "o"),
        *args,
    ]
    with pytest.raises(ConfigError, match=re.escape(field)):
        sft_main(argv, run=lambda config: tmp_path)


def test_a_taken_output_dir_and_an_environment_without_demonstrations_are_config_errors(
    tmp_path, tiny_checkpoint
):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    base = dict(model_name_or_path=str(tiny_checkpoint), prompts=TASK, environment=CALCULATOR)
    with pytest.raises(ConfigError, match="output_dir: .*already exists"):
        run_sft(SFTConfig(output_dir=str(tmp_path / "taken"), **base))
    with pytest.raises(ConfigError, match="task='nope' is not a built-in task"):
        run_sft(SFTConfig(output_dir=str(tmp_path / "o"), **{**base, "prompts": {"task": "nope"}}))
    shop = EnvironmentConfig(name="_episode_envs.Shop", max_turns=2, add_instructions=False)
    with pytest.raises(ConfigError, match="wrote no complete demonstration"):
        run_sft(SFTConfig(**{**base, "environment": shop}, output_dir=str(tmp_path / "o")))


def test_sft_then_fit_through_the_console_script(tmp_path, tiny_checkpoint):
    """``dapo-lightning sft`` writes a model folder; a 2-update calculator fit starts from it
    (its episodes read the environment's instructions, as the demonstrations did)."""
    out = tmp_path / "warm"
    config = tmp_path / "sft.yaml"
    config.write_text(json.dumps({
        "model_name_or_path": str(tiny_checkpoint), "output_dir": str(out), "prompts": TASK,
        "environment": {"name": "calculator", "max_turns": 2, "max_episode_tokens": 512},
        "max_tokens": 160,
        "train": {"steps": 2, "batch_size": 4}, "accelerator": "cpu", "precision": "32-true",
    }))  # fmt: skip
    done = run_cli("sft", "--config", str(config), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sft: wrote" in done.stdout and (out / "config.json").exists()
    bad = run_cli("sft", "--config", str(config), timeout=120)  # the folder exists now
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("dapo-lightning: error: output_dir:")
    typo = run_cli("sft", "--config", str(config), "--train.stepz", "3", timeout=120)
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.strip().splitlines()[-1] == (
        "dapo-lightning: error: train.stepz is not an option. Did you mean train.steps? Fix: "
        "correct the key (--print_config shows the valid ones)."
    )
    env = "{name: calculator, max_turns: 2, max_episode_tokens: 512}"
    (tmp_path / "fit").mkdir()
    run_dir, _ = fit(
        tmp_path / "fit", out, env, *HF_STOPS, "--data.init_args.prompts.max_prompt_length", "320"
    )
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]


@pytest.mark.parametrize("recipe", ["smollm2_tool_use", "smollm2_arithmetic"])
def test_the_recipes_cold_start_config_parses_and_matches_its_fit_config(recipe):
    """configs/sft/RECIPE.yaml: its episodes are the fit recipe's (environment but the RL-only
    demonstrations of unsolved groups, assistant tokens), its model is the fit's base, its
    output the fit's model."""
    import dataclasses

    import yaml

    from tests._harness import REPO

    seen = []
    sft_main(["--config", str(REPO / "configs" / "sft" / f"{recipe}.yaml")], run=seen.append)
    (config,) = seen
    fit = yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())
    data = fit["data"]["init_args"]
    environment = EnvironmentConfig(**data["environment"])
    assert config.environment == dataclasses.replace(environment, demonstrate_unsolved=False)
    assert config.max_tokens == data["sampling"]["max_tokens"]
    assert config.output_dir == fit["model"]["init_args"]["model_name_or_path"]
    assert config.prompts.task == data["prompts"]["task"] == "reasoning_gym"
    assert config.prompts.task_kwargs["dataset"] != data["prompts"]["task_kwargs"]["dataset"]
