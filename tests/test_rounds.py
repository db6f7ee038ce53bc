"""dapo_lightning.data.sampling.rounds.demonstrate_unsolved and rollout_groups.replace_rows: a group
with no right episode gets the environment's demonstration as its first episode, scored by the
same reward, its finish reason ``demonstration``; solved groups and groups without a demonstration stay
as they were."""

from __future__ import annotations

import functools

import torch
from transformers import AutoTokenizer

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.data.sampling.groups import group_max, replace_rows
from dapo_lightning.data.sampling.rounds import demonstrate_unsolved
from dapo_lightning.data.sampling.scoring import RolloutScorer
from dapo_lightning.data.sampling.step_stats import StepStats
from dapo_lightning.envs import EnvironmentConfig, EpisodeSession, environment_factory
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import Completion, SamplingConfig
from dapo_lightning.sft import training_demonstrations
from dapo_lightning.tasks.arithmetic import ArithmeticReward


def rollouts(rows: int, seed: int) -> ScoredRollouts:
    """``rows`` responses in groups of 2, each field distinct per row and seed."""
    return ScoredRollouts(
        prompt_ids=[[seed, r // 2] for r in range(rows)],
        response_ids=[[seed, r, 7] for r in range(rows)],
        rollout_log_probs=[[-0.1 * r - seed] * 3 for r in range(rows)],
        finish_reason=["stop" if r % 2 else "length" for r in range(rows)],
        group_index=torch.arange(rows) // 2,
        prompt_uid=[f"s{seed}p{r // 2}" for r in range(rows)],
        score=torch.arange(rows, dtype=torch.float32) + 10 * seed,
        acc=torch.tensor([float(r % 2) for r in range(rows)]),
        sampling=SamplingConfig(max_tokens=3),
        token_mask=[[1, 0, 1]] * rows,
    )


def test_replace_rows_swaps_every_per_row_field_but_the_group():
    base = rollouts(4, seed=0)
    other = rollouts(1, seed=1)
    other.extra = {"note": ["x"]}
    other.tool_calls = [2]
    out = replace_rows(base, [2], other)
    assert out.group_index.tolist() == base.group_index.tolist()
    for name in ("prompt_ids", "response_ids", "rollout_log_probs", "finish_reason", "prompt_uid"):
        assert getattr(out, name)[2] == getattr(other, name)[0]
        assert [getattr(out, name)[i] for i in (0, 1, 3)] == [
            getattr(base, name)[i] for i in (0, 1, 3)
        ]
    for name in ("score", "acc", "reward"):
        assert getattr(out, name)[2] == getattr(other, name)[0]
    assert out.extra["note"] == [None, None, "x", None] and out.tool_calls == [0, 0, 2, 0]
    assert out.token_masks()[2] == other.token_masks()[0]
    assert base.response_ids[2] != other.response_ids[0]  # the input is not changed


def test_unsolved_groups_get_the_demonstration_as_their_first_episode(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    records = [PromptRecord("a", "2*3*4=", "24"), PromptRecord("b", "5+6=", "11"),
               PromptRecord("c", "Say hi.", "1")]  # fmt: skip
    for r in records:
        r.prompt_ids = encode_prompt(tok, r.prompt, True)
    env = EnvironmentConfig(name="arithmetic", max_turns=4, demonstrate_unsolved=True)
    session = EpisodeSession(
        "hf", environment=env, make_env=environment_factory(env), records=records,
        max_episode_tokens=512, use_chat_template=True, tokenizer=tok,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True), model_path=str(tiny_checkpoint),
    )  # fmt: skip
    scorer = RolloutScorer(
        session, RewardRunner(ArithmeticReward(strict=False), in_process=True), tok.decode
    )
    sampling = SamplingConfig(max_tokens=200, temperature=1.0)

    def said(text):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return Completion(ids, [-0.5] * len(ids), "stop", text)

    # group a: both wrong (demonstrated); b: one right (kept as is); c: no expression
    texts = [["7", "25"], ["11", "12"], ["no", "nope"]]
    scored = scorer.score_completions(
        records, [[said(t) for t in ts] for ts in texts], sampling, 3, StepStats()
    )
    assert scored.acc.tolist() == [0, 0, 1, 0, 0, 0]
    stats = StepStats()
    demos = functools.partial(session.demonstrations, max_tokens=200)
    out = demonstrate_unsolved(records, scored, demos, scorer, sampling, stats)

    assert stats.demonstrations == 1.0
    assert out.acc.tolist() == [1, 0, 1, 0, 0, 0] and out.score.tolist()[:2] == [1.0, -1.0]
    assert out.group_index.tolist() == [0, 0, 1, 1, 2, 2] and out.policy_version == 3
    played = training_demonstrations(
        records[:1], env, tok, max_tokens=200, max_episode_tokens=512
    )  # the same episode, played on its own
    assert out.response_ids[0] == played.response_ids[0]
    assert out.token_mask[0] == played.token_mask[0] and out.tool_calls[0] == 2
    assert out.finish_reason == ["demonstration", "stop", "stop", "stop", "stop", "stop"]
    assert out.rollout_log_probs[0] == [0.0] * len(played.response_ids[0])  # the replay's, unused
    assert out.response_ids[1:] == scored.response_ids[1:]
    assert torch.equal(out.reward[1:], scored.reward[1:])
    # nothing unsolved that the environment can demonstrate: the same rollouts back
    solved = demonstrate_unsolved(records[1:], scored.select([2, 3, 4, 5]), demos, scorer,
                                  sampling, StepStats())  # fmt: skip
    assert solved.response_ids == scored.response_ids[2:]


def test_group_max_is_each_groups_best_value():
    values = torch.tensor([0.0, 1.0, -1.0, -3.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 3])
    assert group_max(values, groups, 4).tolist() == [1.0, -1.0, 0.0, 2.0]  # group 2: no rows
