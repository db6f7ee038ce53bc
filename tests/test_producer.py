"""RolloutProducer (dynamic sampling) without Lightning, on a scripted arithmetic task.

``ScriptedEngine`` is a real implementation of the RolloutEngine protocol: it returns pre-written
completions (the right answer or a wrong one) following a fixed per-prompt pattern, so which
groups have variance is known exactly and reproducible (no hidden RNG state)."""

from __future__ import annotations

import zlib

import pytest
import torch

from dapo_lightning.data.difficulty import subsample_keep_variance
from dapo_lightning.data.producer import (
    STAT_OPS,
    DynamicSamplingConfig,
    DynamicSamplingError,
    RolloutProducer,
    TrainingComplete,
)
from dapo_lightning.data.sources import FieldMap, records_from_rows, tokenize_records
from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop
from dapo_lightning.rewards import RewardRunner
from dapo_lightning.rollout.base import Completion, SamplingConfig
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.tasks.arithmetic import ArithmeticReward, make_arithmetic_rows
from dapo_lightning.testing import make_tiny_tokenizer

TOK = make_tiny_tokenizer()
FIELDS = FieldMap(prompt_key="prompt", answer_key="answer", uid_key="uid")


def pass_rate_of(prompt: str) -> float:
    """The scripted pass rate of a prompt: one of 0, 0.25, 0.5, 1 by a hash of its text."""
    return (0.0, 0.25, 0.5, 1.0)[zlib.crc32(prompt.encode()) % 4]


class ScriptedEngine:
    """Answers prompt ``a+b=`` correctly on sample j iff ``j < round(rate * n)`` (rate per prompt)."""

    def __init__(self, rate=pass_rate_of):
        self.rate = rate
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call
        self.loaded = 0

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n))
        out = []
        for p in prompts:
            text = TOK.decode(p, skip_special_tokens=True)
            expr = text.split("\n")[-3] if "\n" in text else text
            a, _, b = expr.rstrip("=").partition("+")
            truth = int(a) + int(b)
            k = round(self.rate(expr) * n)
            group = []
            for j in range(n):
                resp = str(truth if j < k else truth + 1)
                ids = TOK(resp, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                group.append(Completion(ids, [-0.5] * len(ids), "stop"))
            out.append(group)
        return out

    def load_weights(self, named_tensors):
        self.loaded += 1


def make_producer(
    engine=None,
    *,
    num_prompts=64,
    seed=0,
    level=1,
    rank=0,
    world_size=1,
    sync=None,
    on_scored=None,
    reward=None,
    tp_size=1,
    **config,
):
    records = records_from_rows(make_arithmetic_rows(num_prompts, level=level, seed=seed), FIELDS)
    records, _ = tokenize_records(records, TOK, apply_chat_template=True, max_prompt_length=64)
    runner = RewardRunner(reward or ArithmeticReward(), in_process=True)
    settings = dict(
        n=4, train_batch_size=8, gen_batch_size=8, max_num_gen_batches=20, retire_after=0
    )
    settings.update(config)
    return RolloutProducer(
        EngineSession(engine or ScriptedEngine()),
        runner,
        records,
        DynamicSamplingConfig(**settings),
        decode=lambda ids: TOK.decode(ids, skip_special_tokens=True),
        pad_token_id=TOK.pad_token_id,
        sampling=SamplingConfig(max_tokens=8),
        seed=seed,
        rank=rank,
        world_size=world_size,
        tp_size=tp_size,
        sync=sync,
        on_scored=on_scored,
    )


def group_accs(batch):
    return batch.acc.view(-1, batch.group_size)


def test_batches_are_full_and_never_zero_variance():
    producer = make_producer()
    for step in range(4):
        batch = producer.next_batch(policy_version=step)
        assert batch.batch_size == 8 * 4 and batch.group_size == 4 and batch.num_groups == 8
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()
        assert (batch.sample_version == step).all() and batch.policy_version == step
        assert batch.sampling == SamplingConfig(max_tokens=8)  # what the module reads
        assert set(STAT_OPS) <= set(batch.stats)
        s = batch.stats
        assert s["data/kept_groups"] >= 8
        assert s["data/generated_groups"] == 8 * s["data/gen_rounds"]
        assert s["data/zero_variance_frac"] == pytest.approx(
            1 - s["data/kept_groups"] / s["data/generated_groups"]
        )
        assert s["data/generated_tokens"] > 0 and s["data/short_batch"] == 0
        # contiguous groups 0..7 of 4
        assert batch.group_index.tolist() == [g for g in range(8) for _ in range(4)]


class ConstantShaping:
    """Sets every shaped reward to 0 and records what it saw (a shaping hook)."""

    def __init__(self):
        self.seen_groups = 0

    def __call__(self, rollouts):
        self.seen_groups += rollouts.num_groups
        rollouts.reward.zero_()


def test_shaping_runs_before_filter_and_does_not_decide_it():
    shaping = ConstantShaping()
    producer = make_producer(on_scored=shaping)
    generated = 0
    for _ in range(3):
        batch = producer.next_batch()
        generated += batch.stats["data/generated_groups"]
        assert (batch.reward == 0).all()  # shaping reached the batch
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()  # filter used acc, not the reward
    # The hook saw every generated group, including the ones the filter then dropped.
    assert shaping.seen_groups == generated > 3 * 8
    # With filter_metric="reward" the same shaping leaves no group with variance.
    with pytest.raises(DynamicSamplingError):
        make_producer(
            on_scored=shaping, filter_metric="reward", max_num_gen_batches=3, on_exhausted="error"
        ).next_batch()


def test_out_of_rounds_error_explains():
    producer = make_producer(
        ScriptedEngine(rate=lambda p: 1.0), max_num_gen_batches=3, on_exhausted="error"
    )
    with pytest.raises(DynamicSamplingError) as e:
        producer.next_batch()
    msg = str(e.value)
    assert "max_num_gen_batches=3" in msg and "100% had zero variance" in msg
    assert "Raise n" in msg and "on_exhausted: train_on_kept" in msg


def test_out_of_rounds_trains_on_what_was_kept_by_default():
    # a quarter of the prompts have variance: 3 rounds of 8 keep about 6, fewer than 8
    rate = {0: 0.5, 1: 1.0, 2: 1.0, 3: 1.0}
    engine = ScriptedEngine(rate=lambda p: rate[zlib.crc32(p.encode()) % 4])
    producer = make_producer(engine, max_num_gen_batches=3)
    assert producer.config.on_exhausted == "train_on_kept"
    batch = producer.next_batch()
    assert batch.stats["data/short_batch"] == 1.0 and batch.stats["data/gen_rounds"] == 3
    assert 0 < batch.num_groups < 8 == producer.local_train
    assert batch.stats["data/batch_groups"] == batch.num_groups
    acc = group_accs(batch)
    assert (acc.max(1).values > acc.min(1).values).all()  # still no zero-variance group


def test_out_of_rounds_with_nothing_kept_gives_an_empty_batch_and_stop_ends_the_run():
    solved = ScriptedEngine(rate=lambda p: 1.0)
    batch = make_producer(solved, max_num_gen_batches=2).next_batch()
    assert batch.batch_size == 0 and batch.stats["data/short_batch"] == 1.0
    with pytest.raises(TrainingComplete, match="on_exhausted: stop"):
        make_producer(solved, max_num_gen_batches=2, on_exhausted="stop").next_batch()


def test_solved_training_set_ends_cleanly():
    producer = make_producer(
        ScriptedEngine(rate=lambda p: 1.0),
        num_prompts=16,
        retire_after=1,
        max_num_gen_batches=0,
        filter_metric=None,
    )
    with pytest.raises(TrainingComplete) as done:
        for _ in range(10):
            producer.next_batch()
    assert "16 of 16 are retired" in str(done.value) and "solved" in str(done.value)
    assert producer.tracker.num_retired == 16


def test_retire_after_is_on_by_default():
    assert DynamicSamplingConfig().retire_after == 3


def test_no_filter_keeps_everything():
    producer = make_producer(ScriptedEngine(rate=lambda p: 1.0), filter_metric=None)
    batch = producer.next_batch()
    assert batch.stats["data/gen_rounds"] == 1 and batch.stats["data/zero_variance_frac"] == 0
    acc = group_accs(batch)
    assert (acc == 1).all() and batch.num_groups == 8


def test_carry_over_stamps_the_version_the_groups_were_sampled_with():
    producer = make_producer(gen_batch_size=12, carry_over=True)
    b0 = producer.next_batch(policy_version=0)
    carried = b0.stats["data/carried_groups"]
    assert 0 < carried < 8
    # 16 updates happened in between (the paper's 512 / 32 per step): stale by 16, exactly
    b1 = producer.next_batch(policy_version=16)
    stale = int((b1.sample_version[::4] == 0).sum())
    assert stale == min(carried, 8)
    staleness = (16 - b1.sample_version).tolist()
    assert staleness[: stale * 4] == [16] * (stale * 4) and set(staleness[stale * 4 :]) == {0}
    dropped = make_producer(gen_batch_size=32).next_batch(policy_version=0)
    assert dropped.stats["data/carried_groups"] == 0


def test_groups_beyond_max_staleness_never_reach_the_batch():
    producer = make_producer(gen_batch_size=12, carry_over=True, max_staleness=8)
    b0 = producer.next_batch(policy_version=0)
    carried = int(b0.stats["data/carried_groups"])
    assert carried > 0
    b1 = producer.next_batch(policy_version=16)  # 16 > 8: every carried group is dropped
    assert (b1.sample_version == 16).all()
    assert b1.stats["data/dropped_stale_groups"] == carried
    # within the bound they are kept
    kept = make_producer(gen_batch_size=12, carry_over=True, max_staleness=16)
    kept.next_batch(policy_version=0)
    assert (kept.next_batch(policy_version=16).sample_version == 0).any()


def test_every_batch_brings_the_engine_to_the_policy_version():
    engine = ScriptedEngine()
    producer = make_producer(engine, gen_batch_size=12, carry_over=True)
    producer.session.attach(lambda: torch.nn.Linear(2, 2))
    producer.next_batch(policy_version=0)
    assert engine.loaded == 0  # the engine already holds version 0
    producer.next_batch(policy_version=3)
    producer.next_batch(policy_version=3)
    assert engine.loaded == 1 and producer.session.version == 3


class CountingReward(ArithmeticReward):
    """The arithmetic reward plus numeric extras (as a user's reward might add)."""

    def __call__(self, responses, ground_truths, **kwargs):
        results = super().__call__(responses, ground_truths, **kwargs)
        for r, text in zip(results, responses):
            r.extra["long"] = float(len(text) > 1)
            r.extra["label"] = "not a number: not logged"
        return results


def test_numeric_reward_extras_become_reward_metrics():
    batch = make_producer(reward=CountingReward()).next_batch()
    assert 0.0 <= batch.stats["reward/long"] <= 1.0
    assert "reward/label" not in batch.stats


def test_a_stop_request_stops_between_rounds():
    producer = make_producer(ScriptedEngine(rate=lambda p: 1.0), max_num_gen_batches=0)
    calls = []
    producer.on_scored = lambda r: calls.append(1) or (len(calls) == 2 and request_stop("SIGTERM"))
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            producer.next_batch()
    finally:
        clear_stop_request()
    assert len(calls) == 2  # the round in progress finished, no new one started


def test_settings_errors_name_the_field():
    with pytest.raises(ValueError, match="multiple of world_size"):
        make_producer(train_batch_size=7, world_size=2)
    with pytest.raises(ValueError, match="n >= 2"):
        make_producer(n=1)
    with pytest.raises(ValueError, match="gen_batch_size"):
        make_producer(gen_batch_size=0)
    with pytest.raises(ValueError, match="more than the 16 training prompts"):
        make_producer(num_prompts=16, train_batch_size=32, gen_batch_size=None)
    with pytest.raises(ValueError, match="on_exhausted"):
        DynamicSamplingConfig(on_exhausted="retry")


def test_retire_and_park():
    producer = make_producer(
        num_prompts=16,
        retire_after=1,
        park_after=1,
        revisit_every=2,
        train_batch_size=2,
        gen_batch_size=4,
    )
    tracker = producer.tracker
    rate = {r.uid: pass_rate_of(r.prompt) for r in producer.records}
    visits: list[tuple[int, str]] = []
    for _ in range(12):
        producer.next_batch()
        visits.extend((producer.sampler.epoch, u) for u in producer.drawn_uids)
    solved = {u for u, p in rate.items() if p == 1.0}
    hopeless = {u for u, p in rate.items() if p == 0.0}
    assert solved and hopeless
    for u in solved:  # retired after its first (all-correct) visit
        assert sum(1 for _, v in visits if v == u) <= 1
        if any(v == u for _, v in visits):
            assert tracker.stats[u].retired
    # a parked prompt is visited again only after revisit_every epochs
    for u in hopeless:
        epochs = [e for e, v in visits if v == u]
        assert all(b - a >= 2 for a, b in zip(epochs, epochs[1:])), epochs
    assert producer.next_batch().stats["data/retired"] == tracker.num_retired > 0
    assert tracker.num_parked > 0


def test_adaptive_group_size_budget_and_subsampling():
    engine = ScriptedEngine()
    producer = make_producer(engine, adaptive_n=True, max_n=12, gen_batch_size=8)
    tracker = producer.tracker
    for _ in range(4):
        batch = producer.next_batch()
        assert batch.batch_size == 32 and batch.group_size == 4
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()
    # every round stays within its budget of gen_batch_size * n samples
    assert max(n for _, n in engine.calls) > 4
    assert all(p * n <= 32 for p, n in engine.calls)
    # harder prompts get more samples
    hard = [r.uid for r in producer.records if pass_rate_of(r.prompt) == 0.25]
    easy = [r.uid for r in producer.records if pass_rate_of(r.prompt) == 1.0]
    seen_hard = [u for u in hard if u in tracker.stats]
    seen_easy = [u for u in easy if u in tracker.stats]
    assert tracker.group_size(seen_hard[0], 4, 12) > tracker.group_size(seen_easy[0], 4, 12) == 4


def test_subsample_keep_variance():
    import random

    rng = random.Random(0)
    acc = [1.0] + [0.0] * 11
    for _ in range(20):
        idx = subsample_keep_variance(acc, 4, rng)
        assert len(idx) == 4 and 0 in idx and idx == sorted(idx)
    assert subsample_keep_variance([1.0] * 5, 4, rng).__len__() == 4


def test_resume_draws_the_same_prompts(tmp_path):
    def run(producer, steps, start=0):
        seq = []
        for s in range(start, start + steps):
            batch = producer.next_batch(policy_version=s)
            seq.append(
                (list(producer.drawn_uids), batch.input_ids.tolist(), batch.sample_version.tolist())
            )
        return seq

    kw = dict(retire_after=2, park_after=2, carry_over=True, gen_batch_size=12, num_prompts=24)
    full = run(make_producer(**kw), 6)
    producer = make_producer(**kw)
    first = run(producer, 2)
    torch.save(producer.state_dict(), tmp_path / "producer.pt")
    resumed = make_producer(**kw)
    resumed.load_state_dict(torch.load(tmp_path / "producer.pt", weights_only=True))
    rest = run(resumed, 4, start=2)
    assert first + rest == full


def test_a_stopped_batch_leaves_the_producer_as_it_was():
    """A stop between rounds saves a checkpoint; resuming must draw this step's prompts again,
    so the producer hands back its start-of-step state (cursor, RNG, statistics)."""
    producer = make_producer(retire_after=2, gen_batch_size=4)
    before = producer.state_dict()
    producer.on_scored = lambda r: request_stop("SIGTERM")
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            producer.next_batch()
    finally:
        clear_stop_request()
        producer.on_scored = None
    assert producer.state_dict() == before
    reference = make_producer(retire_after=2, gen_batch_size=4)
    assert producer.next_batch().input_ids.tolist() == reference.next_batch().input_ids.tolist()
