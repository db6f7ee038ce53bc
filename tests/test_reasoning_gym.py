"""The reasoning-gym task: rows (train then held-out, never the same question), the reward
against each dataset's own ``score_answer`` on generated answers (right, wrong, malformed), the
scorer's entry travelling from the row to the reward (through the producer and the reward
worker processes), and bad names failing when the data module is built."""

from __future__ import annotations

import pytest

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="the tasks extra: pip install reasoning-gym"
)

from dapo_lightning.data.datamodule import DAPODataModule  # noqa: E402
from dapo_lightning.data.prompts.config import PromptConfig, ValidationConfig  # noqa: E402
from dapo_lightning.data.prompts.loading import load_prompt_sets  # noqa: E402
from dapo_lightning.data.prompts.sources import FieldMap, records_from_rows, tokenize_records  # noqa: E402
from dapo_lightning.data.sampling.producer import DynamicSamplingConfig, RolloutProducer  # noqa: E402
from dapo_lightning.data.selection.difficulty import PromptSelectionConfig  # noqa: E402
from dapo_lightning.rewards import RewardRunner, get_reward  # noqa: E402
from dapo_lightning.rollout.base import Completion, RolloutEngine, SamplingConfig  # noqa: E402
from dapo_lightning.rollout.session import EngineSession  # noqa: E402
from dapo_lightning.tasks import get_task  # noqa: E402
from dapo_lightning.tasks.reasoning_gym import (  # noqa: E402
    EXTRACTORS,
    INSTRUCTION,
    VAL_SEED_OFFSET,
    ReasoningGymReward,
    make_reasoning_gym_rows,
    split_counts,
)
from dapo_lightning.testing import make_tiny_tokenizer  # noqa: E402

TOK = make_tiny_tokenizer()
FIELDS = FieldMap("prompt", "answer", "uid", None)
ADD_SUB = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}
#: Datasets with different scorers: exact string with partial credit (basic_arithmetic), decimal
#: tolerance (chain_sum), an expression checked against the metadata's numbers (countdown).
DATASETS = {
    "basic_arithmetic": ADD_SUB,
    "chain_sum": {"max_terms": 3, "max_digits": 2},
    "countdown": {"min_numbers": 3, "max_numbers": 3},
}


def generated_responses(answer: str) -> list[str]:
    """Right, wrong and malformed responses for one oracle answer."""
    return [
        f"Answer: {answer}",  # right
        f"3 + 4 is easy.\nanswer: {answer}.",  # right, lower case, trailing period
        f"Answer: {answer}7",  # wrong (and contains the oracle: partial credit somewhere)
        "Answer: 12345",  # wrong
        f"The result is {answer}",  # malformed: no Answer line
        "Answer:",  # malformed: empty answer line
        "",  # empty response
        f"Answer: <answer>{answer}</answer>",  # wrapped
    ]


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_reward_is_the_datasets_own_score_answer(name):
    """On every generated response the reward's score and acc follow from the dataset's own
    ``score_answer`` on the extracted answer (the dataset built here independently), with the
    absolute values pinned for the right and the answer-less responses."""
    rows = make_reasoning_gym_rows(seed=2, dataset=name, config=DATASETS[name], size=6, val_size=0)
    own = reasoning_gym.create_dataset(name, seed=2, size=300, **DATASETS[name])
    reward = get_reward("reasoning_gym")
    assert isinstance(reward, ReasoningGymReward)
    for row in rows:
        entry = row["reward_kwargs"]["rg_entry"]
        index = int(row["uid"].rsplit("-", 1)[1])
        assert own[index]["question"] == entry["question"]  # the row is that dataset's entry
        assert row["answer"] == str(own[index]["answer"])
        responses = generated_responses(row["answer"])
        results = reward(
            responses, [row["answer"]] * len(responses), rg_entry=[entry] * len(responses)
        )
        for text, got in zip(responses, results):
            extracted = EXTRACTORS["answer_line"](text)
            value = own.score_answer(extracted, own[index])
            assert got.score == pytest.approx(-1.0 + 2.0 * value), (name, text)
            assert got.acc == (value == 1.0), (name, text)
            assert got.extra["has_answer"] == (extracted is not None)
        by_number = ReasoningGymReward(answer_format="last_number")
        got = by_number(
            responses, [row["answer"]] * len(responses), rg_entry=[entry] * len(responses)
        )
        for text, result in zip(responses, got):
            value = own.score_answer(EXTRACTORS["last_number"](text), own[index])
            assert result.score == pytest.approx(-1.0 + 2.0 * value), (name, text)
            assert result.acc == (value == 1.0), (name, text)
        if name == "basic_arithmetic":  # integers: the last number is the answer
            assert [r.acc for r in got] == [True, True, False, False, True, False, False, True]
        assert (results[0].score, results[0].acc) == (1.0, True)
        assert (results[1].score, results[1].acc) == (1.0, True)  # "answer: X." is read as X
        if name != "countdown":  # countdown gives 0.01 for no answer
            assert results[4].score == -1.0 and not results[4].acc


def test_other_answer_formats_and_scores():
    (row,) = make_reasoning_gym_rows(
        seed=0, dataset="chain_sum", config={"max_terms": 2}, size=1, val_size=0
    )
    entry, answer = row["reward_kwargs"]["rg_entry"], row["answer"]
    tag = ReasoningGymReward(answer_format="answer_tag", correct_score=2.0, wrong_score=0.0)
    boxed = ReasoningGymReward(answer_format="boxed")
    texts = [f"so <answer> {answer} </answer>", f"\\boxed{{{answer}}}", "Answer: 99999"]
    assert [r.score for r in tag(texts, [answer] * 3, rg_entry=[entry] * 3)] == [2.0, 0.0, 0.0]
    assert [r.acc for r in boxed(texts, [answer] * 3, rg_entry=[entry] * 3)] == [False, True, False]
    with pytest.raises(ValueError, match="answer_format='xml'.*answer_line"):
        ReasoningGymReward(answer_format="xml")
    with pytest.raises(ValueError, match="needs each response's rg_entry"):
        ReasoningGymReward()(["Answer: 1"], ["1"])


def test_rows_train_then_held_out_from_another_seed_never_equal():
    rows = make_reasoning_gym_rows(
        seed=0, dataset="basic_arithmetic", config=ADD_SUB, size=200, val_size=60
    )
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["split"] for r in rows] == ["train"] * 200 + ["val"] * 60
    questions = [r["reward_kwargs"]["rg_entry"]["question"] for r in rows]
    assert len(set(questions)) == 260  # distinct within and across the splits
    assert all(r["uid"].startswith("rg-basic_arithmetic-0-") for r in train)
    assert all(r["uid"].startswith(f"rg-basic_arithmetic-{VAL_SEED_OFFSET}-") for r in val)
    first = train[0]["prompt"][0]["content"]
    assert first == f"{train[0]['reward_kwargs']['rg_entry']['question']}\n{INSTRUCTION}"
    assert rows == make_reasoning_gym_rows(
        seed=0, dataset="basic_arithmetic", config=ADD_SUB, size=200, val_size=60
    )
    # a held-out seed equal to the training seed still gives no training question
    same = make_reasoning_gym_rows(
        seed=0, dataset="basic_arithmetic", config=ADD_SUB, size=50, val_size=20, val_seed=0
    )
    held = [r["reward_kwargs"]["rg_entry"]["question"] for r in same if r["split"] == "val"]
    assert len(held) == 20 and not set(held) & set(questions[:50])


def test_a_weighted_mix_splits_by_weight_and_interleaves():
    assert split_counts(10, [2.0, 1.0]) == [7, 3] and split_counts(9, [1, 1, 1]) == [3, 3, 3]
    rows = make_reasoning_gym_rows(
        seed=1,
        datasets=[
            {"name": "chain_sum", "weight": 3, "config": {"max_terms": 2, "max_digits": 1}},
            {"name": "basic_arithmetic", "weight": 1, "config": ADD_SUB},
        ],
        size=40,
        val_size=8,
    )
    names = [r["reward_kwargs"]["rg_entry"]["dataset"] for r in rows]
    assert names[:40].count("chain_sum") == 30 and names[40:].count("chain_sum") == 6
    # row i of n_k at (i + 0.5) / n_k: chain_sum at 1, 3, 5, ... / 60, basic_arithmetic at 3, 9
    c, b = "chain_sum", "basic_arithmetic"
    assert names[:7] == [c, c, b, c, c, c, b]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dataset": "basic_arithmetik"},
            r"'basic_arithmetik' is not a reasoning-gym dataset: use one of .*basic_arithmetic, .*chain_sum",
        ),
        (
            {"dataset": "chain_sum", "config": {"terms": 2}},
            r"unknown field\(s\) \['terms'\]: its fields are min_terms, max_terms",
        ),
        (
            {"dataset": "chain_sum", "config": {"min_terms": 4, "max_terms": 2}},
            r"invalid: max_terms must be >= min_terms",
        ),
        ({"dataset": "chain_sum", "datasets": []}, r"one of dataset .* not both"),
        ({"datasets": [{"name": "chain_sum", "weight": -1}]}, r"weight of 'chain_sum' must be > 0"),
        ({"dataset": "chain_sum", "sizes": 3}, r"unknown key\(s\) \['sizes'\]"),
        ({"dataset": "chain_sum", "size": 0}, r"size must be an integer >= 1"),
    ],
)
def test_bad_names_fail_when_the_data_module_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DAPODataModule("unused", prompts=PromptConfig(task="reasoning_gym", task_kwargs=kwargs))


def test_too_few_distinct_questions_says_so():
    tiny = {
        "min_terms": 2,
        "max_terms": 2,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    }
    with pytest.raises(ValueError, match=r"only \d+ distinct new questions"):
        make_reasoning_gym_rows(
            seed=0, dataset="basic_arithmetic", config=tiny, size=500, val_size=0
        )


def _records(dm):
    """The data module's train and held-out records, loaded as its setup loads them."""
    return load_prompt_sets(
        dm.task, dm.task_kwargs, dm.train_files, dm.fields, dm.prompts, dm.validation, dm.seed
    )


def test_data_module_holds_out_the_tasks_val_rows():
    dm = DAPODataModule(
        "unused",
        prompts=PromptConfig(
            task="reasoning_gym", task_kwargs={"dataset": "chain_sum", "size": 24, "val_size": 8}
        ),
        seed=3,
    )
    train, val = _records(dm)
    assert (len(train), len(val)) == (24, 8)
    assert {r.meta["split"] for r in train} == {"train"} and {r.meta["split"] for r in val} == {
        "val"
    }
    assert not {r.prompt[0]["content"] for r in train} & {r.prompt[0]["content"] for r in val}
    dm = DAPODataModule(
        "unused",
        prompts=PromptConfig(task="reasoning_gym", task_kwargs={"dataset": "chain_sum"}),
        validation=ValidationConfig(fraction=0.2),
    )
    with pytest.raises(ValueError, match="own held-out problems.*validation.fraction: 0"):
        _records(dm)


class AnswerEngine(RolloutEngine):
    """Answers the first ``right`` samples of each prompt with its answer line, the rest wrong."""

    def __init__(self, answers: dict[tuple[int, ...], str], right: int) -> None:
        self.answers, self.right = answers, right

    def generate(self, prompts, n, sampling):
        out = []
        for p in prompts:
            truth = self.answers[tuple(p)]
            group = []
            for j in range(n):
                text = f"Answer: {truth if j < self.right else truth + '1'}"
                ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                group.append(Completion(ids, [-0.5] * len(ids), "stop"))
            out.append(group)
        return out

    def load_weights(self, named_tensors):
        pass


@pytest.mark.parametrize(
    "in_process", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["in_process", "worker"]
)
def test_the_entry_travels_from_the_row_to_the_reward(in_process):
    """Through the producer (the rows' reward_kwargs) and, with ``in_process=False``, pickled
    into a reward worker process with its timeout: countdown's scorer reads the metadata.
    The worker case is slow (a fresh process imports torch and the package: ~10 s on idle
    cores): ``pytest tests/test_reasoning_gym.py -m slow``."""
    rows = make_reasoning_gym_rows(
        seed=0, dataset="countdown", config=DATASETS["countdown"], size=3, val_size=0
    )
    records = records_from_rows(rows, FIELDS)
    records, _ = tokenize_records(records, TOK, apply_chat_template=True)
    engine = AnswerEngine({tuple(r.prompt_ids): r.answer for r in records}, right=3)
    runner = RewardRunner(get_reward("reasoning_gym"), in_process=in_process, timeout_s=60)
    producer = RolloutProducer(
        EngineSession(engine),
        runner,
        records,
        DynamicSamplingConfig(
            n=4,
            train_batch_size=2,
            gen_batch_size=3,
            selection=PromptSelectionConfig(retire_after=0),
        ),
        decode=lambda ids: TOK.decode(ids, skip_special_tokens=True),
        pad_token_id=TOK.pad_token_id,
        sampling=SamplingConfig(max_tokens=8),
    )
    try:
        scored = producer.score(records, [4] * 3, SamplingConfig(max_tokens=8), 0)
    finally:
        runner.close()
    assert scored.acc.tolist() == [1.0, 1.0, 1.0, 0.0] * 3
    assert scored.score.tolist()[:3] == [1.0, 1.0, 1.0]
    assert runner.last_failures == 0


def test_the_reward_pickles_without_its_scorers():
    """What the reward workers receive: the cached dataset objects stay behind, and the copy
    rebuilds them from the row's entry."""
    import pickle

    (row,) = make_reasoning_gym_rows(seed=0, dataset="chain_sum", size=1, val_size=0)
    entry = row["reward_kwargs"]["rg_entry"]
    reward = ReasoningGymReward(answer_format="answer_tag")
    assert reward([f"<answer>{row['answer']}</answer>"], [row["answer"]], rg_entry=[entry])[0].acc
    assert reward._scorers  # one dataset cached
    copy = pickle.loads(pickle.dumps(reward))
    assert copy._scorers == {} and copy.answer_format == "answer_tag" and copy.failure_score == -1.0
    got = copy(
        [f"<answer>{row['answer']}</answer>", "<answer>x</answer>"],
        [row["answer"]] * 2,
        rg_entry=[entry] * 2,
    )
    assert [r.score for r in got] == [1.0, -1.0]


def test_the_task_is_registered():
    task = get_task("reasoning_gym")
    assert task.reward == "reasoning_gym" and task.make_rows is make_reasoning_gym_rows
    assert len(task.make_rows(seed=0)) == 256 + 64  # default: the recipe's setting and sizes
