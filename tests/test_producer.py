"""RolloutProducer (dynamic sampling) without Lightning, on a scripted arithmetic task.

``ScriptedEngine`` is a real implementation of the RolloutEngine protocol: it returns pre-written
completions (the right answer or a wrong one) following a fixed per-prompt pattern, so which
groups have variance is known exactly and reproducible (no hidden RNG state)."""

from __future__ import annotations

import copyreg
import dataclasses
import math
import zlib

import pytest
import torch

from dapo_lightning.data.prompts.sources import FieldMap, records_from_rows, tokenize_records
from dapo_lightning.data.sampling.producer import (
    STAT_OPS,
    DynamicSamplingConfig,
    DynamicSamplingError,
    RolloutProducer,
    TrainingComplete,
)
from dapo_lightning.data.sampling.rank_layout import RankLayout
from dapo_lightning.data.sampling.rounds import RoundHooks
from dapo_lightning.data.selection.difficulty import (
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
    PromptStats,
)
from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop
from dapo_lightning.rewards import RewardRunner
from dapo_lightning.rollout.base import (
    DRAIN,
    Completion,
    EngineCapabilities,
    RolloutEngine,
    SamplingConfig,
)
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.tasks.arithmetic import ArithmeticReward, make_arithmetic_rows
from dapo_lightning.testing import make_tiny_tokenizer

TOK = make_tiny_tokenizer()
FIELDS = FieldMap(prompt_key="prompt", answer_key="answer", uid_key="uid")


def pass_rate_of(prompt: str) -> float:
    """The scripted pass rate of a prompt: one of 0, 0.25, 0.5, 1 by a hash of its text."""
    return (0.0, 0.25, 0.5, 1.0)[zlib.crc32(prompt.encode()) % 4]


class ScriptedEngine(RolloutEngine):
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


#: PromptSelectionConfig's fields: make_producer / scripted data modules take them as keywords.
SELECTION_FIELDS = {f.name for f in dataclasses.fields(PromptSelectionConfig)}


def config_with_selection(settings: dict) -> DynamicSamplingConfig:
    """``DynamicSamplingConfig(**settings)`` with the prompt-selection keys grouped."""
    settings = dict(settings)
    selection = {k: settings.pop(k) for k in list(settings) if k in SELECTION_FIELDS}
    return DynamicSamplingConfig(**settings, selection=PromptSelectionConfig(**selection))


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
    on_discarded=None,
    reward=None,
    tp_size=1,
    **config,
):
    records = records_from_rows(make_arithmetic_rows(num_prompts, level=level, seed=seed), FIELDS)
    records, _ = tokenize_records(records, TOK, apply_chat_template=True, max_prompt_length=64)
    runner = RewardRunner(reward or ArithmeticReward(), in_process=True)
    settings = dict(  # the paper's uniform draw and fixed rounds (new defaults: own tests)
        n=4,
        train_batch_size=8,
        gen_batch_size=8,
        max_num_gen_batches=20,
        retire_after=0,
        strategy="uniform",
        round_sizing="fixed",
        carry_over=False,
    )
    settings.update(config)
    return RolloutProducer(
        EngineSession(engine or ScriptedEngine()),
        runner,
        records,
        config_with_selection(settings),
        decode=lambda ids: TOK.decode(ids, skip_special_tokens=True),
        pad_token_id=TOK.pad_token_id,
        sampling=SamplingConfig(max_tokens=8),
        seed=seed,
        layout=RankLayout(rank, world_size, tp_size),
        sync=sync,
        hooks=RoundHooks(scored=on_scored, discarded=on_discarded),
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
    assert DynamicSamplingConfig().selection.retire_after == 3


def test_a_checkpoint_with_the_flat_selection_keys_loads_them_grouped(tmp_path, monkeypatch):
    """Checkpoints written before the prompt-selection settings were grouped hold a
    DynamicSamplingConfig with flat ``selection`` (a string), ``max_skip``, ... attributes; it
    loads (weights_only) with them under ``selection`` (LEGACY_SELECTION_KEYS)."""
    flat = {
        **{f.name: getattr(DynamicSamplingConfig(n=4), f.name) for f in dataclasses.fields(
            DynamicSamplingConfig) if f.name != "selection"},
        "selection": "uniform", "max_skip": 0.5, "revisit_within": 4, "retire_after": 0,
        "park_after": 2, "revisit_every": 3,
    }  # fmt: skip
    old_pickle = lambda self, protocol: (copyreg.__newobj__, (DynamicSamplingConfig,), flat)  # noqa: E731
    monkeypatch.setattr(DynamicSamplingConfig, "__reduce_ex__", old_pickle)
    torch.save({"datamodule_hyper_parameters": {"ds": DynamicSamplingConfig()}}, tmp_path / "old")
    monkeypatch.undo()
    loaded = torch.load(tmp_path / "old", weights_only=True)["datamodule_hyper_parameters"]["ds"]
    expected = PromptSelectionConfig("uniform", 0.5, 4, 0, 2, 3)
    assert loaded == DynamicSamplingConfig(n=4, selection=expected)
    assert not hasattr(loaded, "max_skip")
    torch.save(DynamicSamplingConfig(selection=expected), tmp_path / "new")  # today's round trip
    assert torch.load(tmp_path / "new", weights_only=True).selection == expected


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
    producer.rounds.on_scored = lambda r: (
        calls.append(1) or (len(calls) == 2 and request_stop("SIGTERM"))
    )
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            producer.next_batch()
    finally:
        clear_stop_request()
    assert len(calls) == 2  # the round in progress finished, no new one started


def test_going_back_before_a_batch_discards_the_rounds_scored_for_it():
    """``on_discarded`` gets the index of the batch the producer went back to before: after a
    rewind (a stop undid its step) and after a stop inside its generation (the round that
    finished was scored, then thrown away)."""
    discarded: list[int] = []
    producer = make_producer(on_discarded=discarded.append)
    producer.next_batch()
    producer.next_batch()
    assert producer.rewind() and discarded == [1]
    assert not producer.rewind() and discarded == [1]  # nothing made since: nothing void
    scored = []
    producer.rounds.on_scored = lambda r: scored.append(r.batch_index) or request_stop("SIGTERM")
    try:
        with pytest.raises(StopRequested):
            producer.next_batch()
    finally:
        clear_stop_request()
    assert scored == [1] and discarded == [1, 1] and producer.batches_made == 1


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
        review_weight=0.0,  # retired for good (reviews: the tests below)
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
    producer.rounds.on_scored = lambda r: request_stop("SIGTERM")
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            producer.next_batch()
    finally:
        clear_stop_request()
        producer.rounds.on_scored = None
    assert producer.state_dict() == before
    reference = make_producer(retire_after=2, gen_batch_size=4)
    assert producer.next_batch().input_ids.tolist() == reference.next_batch().input_ids.tolist()


# --------------------------------------------------------------- issue 27: fewer wasted samples
class ScriptedStreamingEngine(ScriptedEngine):
    """ScriptedEngine with the streaming API: ``stream_groups`` yields one finished group per
    engine step, in submission order; closing it early records which keys were left (aborted)."""

    capabilities = EngineCapabilities(streaming=True)

    def __init__(self, rate=pass_rate_of):
        super().__init__(rate)
        self.aborted: list[int] = []

    def stream_groups(self, prompts, n, sampling):
        groups = self.generate(prompts, n, sampling)
        k = 0
        try:
            for k, group in enumerate(groups):
                if (yield [(k, group)]) == DRAIN:  # only this group was started: stop
                    break
            else:
                k = len(groups)
        finally:
            self.aborted.extend(range(k + 1, len(groups)) if k < len(groups) else [])


class StartedStreamingEngine(ScriptedEngine):
    """Streams one group per step while ``started`` more groups run: sent DRAIN, it finishes
    those ``started`` groups (yielded one by one) and drops the rest, never started."""

    capabilities = EngineCapabilities(streaming=True)

    def __init__(self, started, rate=pass_rate_of):
        super().__init__(rate)
        self.started = started
        self.dropped: list[int] = []

    def stream_groups(self, prompts, n, sampling):
        groups = self.generate(prompts, n, sampling)
        end = len(groups)
        k = 0
        while k < end:
            if (yield [(k, groups[k])]) == DRAIN:
                end = min(end, k + 1 + self.started)
                self.dropped = list(range(end, len(groups)))
            k += 1


def test_zero_variance_prob_pins_hand_made_histories():
    from fractions import Fraction

    from dapo_lightning.data.selection.difficulty import (
        PRIOR,
        DifficultyTracker,
        zero_variance_prob,
    )

    def exact(a, b, n):  # the Beta moments as products, in exact rational arithmetic
        a, b = Fraction(a), Fraction(b)
        pa = pb = Fraction(1)
        for k in range(n):
            pa *= (a + k) / (a + b + k)
            pb *= (b + k) / (a + b + k)
        return float(pa + pb)

    assert zero_variance_prob(0, 0, 1) == pytest.approx(1.0)  # one sample never varies
    # Beta(3, 7): 3*4/(10*11) + 7*8/(10*11) = 68/110
    assert zero_variance_prob(2, 6, 2, prior=(1, 1)) == pytest.approx(68 / 110, rel=1e-12)
    assert zero_variance_prob(2, 6, 3, prior=(1, 1)) == pytest.approx(564 / 1320, rel=1e-12)
    assert PRIOR == (0.05, 0.05)
    assert zero_variance_prob(0, 8, 8) == pytest.approx(exact(0.05, 8.05, 8), rel=1e-12)
    # a visit history: [1,0,0,0] then [0,0,0,0]; the older visit weighs history_decay (1/2):
    # correct 1/2 * 1 + 0, wrong 1/2 * 3 + 4
    assert PromptSelectionConfig().history_decay == 0.5
    tracker = DifficultyTracker()
    tracker.update("u", [1.0, 0.0, 0.0, 0.0], epoch=0)
    tracker.update("u", [0.0] * 4, epoch=1)
    s = tracker.stats["u"]
    assert (s.recent_correct, s.recent_wrong, s.last_epoch) == (0.5, 5.5, 1)
    assert zero_variance_prob(s.recent_correct, s.recent_wrong, 4) == pytest.approx(
        exact(Fraction(55, 100), Fraction(555, 100), 4), rel=1e-12
    )
    # history_decay 0.9: correct 0.9, wrong 0.9 * 3 + 4 = 6.7
    tracker = DifficultyTracker(PromptSelectionConfig(history_decay=0.9))
    tracker.update("u", [1.0, 0.0, 0.0, 0.0], epoch=0)
    tracker.update("u", [0.0] * 4, epoch=1)
    s = tracker.stats["u"]
    assert (s.recent_correct, s.recent_wrong) == pytest.approx((0.9, 6.7), rel=1e-12)
    with pytest.raises(ValueError, match="n >= 1"):
        zero_variance_prob(0, 0, 0)


def test_skip_threshold_pins_hand_made_histories():
    """A prompt is skipped (with probability max_skip) only when P0 > skip_threshold (1/2):
    after one visit of n = 8, 8 of 8 right gives P0 0.965 (skipped), 7 of 8 gives 0.452
    (taken: a kept group is likelier); with history_decay 1/2 the history [8/8, 7/8] is
    (4 + 7, 0 + 1) = (11, 1): 0.565 (skipped) and [7/8, 6/8] is (3.5 + 6, 0.5 + 2) = (9.5,
    2.5): 0.231 (taken)."""
    from dapo_lightning.data.selection.difficulty import (
        DifficultyTracker,
        PredictiveSelector,
        PromptSelectionConfig,
        zero_variance_prob,
    )

    assert PromptSelectionConfig().skip_threshold == 0.5
    assert zero_variance_prob(8, 0, 8) == pytest.approx(0.9646286458575313, rel=1e-12)
    assert zero_variance_prob(7, 1, 8) == pytest.approx(0.4520340645148221, rel=1e-12)
    config = PromptSelectionConfig(max_skip=0.9, revisit_within=3)
    sel = PredictiveSelector(8, config, seed=1)
    histories = {  # P0 by the Beta products in exact fractions (a = 0.05 + correct, ...)
        "8/8": ([[1.0] * 8], 0.9646286458575313, 0.9),
        "7/8": ([[1.0] * 7 + [0.0]], 0.4520340645148221, 0.0),
        "8/8, 7/8": ([[1.0] * 8, [1.0] * 7 + [0.0]], 0.5650328071907219, 0.9),
        "7/8, 6/8": ([[1.0] * 7 + [0.0], [1.0] * 6 + [0.0] * 2], 0.23097567073469832, 0.0),
    }
    for name, (visits, p0, skip) in histories.items():
        tracker = DifficultyTracker()
        for epoch, accs in enumerate(visits):
            tracker.update("u", accs, epoch)
        s = tracker.stats["u"]
        assert zero_variance_prob(s.recent_correct, s.recent_wrong, 8) == pytest.approx(
            p0, rel=1e-9
        ), name
        assert sel.skip_prob(s, len(visits)) == skip, name
        assert (sel.decide(s, len(visits)) == "predicted") == (skip == 0.0), name
    # a threshold of 0.6 takes the 0.565 history too; 0.4 skips the 0.452 one
    tracker = DifficultyTracker()
    tracker.update("u", [1.0] * 8, 0)
    tracker.update("u", [1.0] * 7 + [0.0], 1)
    at = dataclasses.replace
    assert PredictiveSelector(8, at(config, skip_threshold=0.6)).skip_prob(tracker.get("u"), 2) == 0
    tracker = DifficultyTracker()
    tracker.update("u", [1.0] * 7 + [0.0], 0)
    assert (
        PredictiveSelector(8, at(config, skip_threshold=0.4)).skip_prob(tracker.get("u"), 1) == 0.9
    )


def test_predictive_selector_floor_revisit_and_state():
    from dapo_lightning.data.selection.difficulty import PredictiveSelector, PromptStats

    sel = PredictiveSelector(8, PromptSelectionConfig(max_skip=0.9, revisit_within=3), seed=1)
    assert sel.skip_prob(None, 5) == 0.0  # never visited: never skipped
    assert sel.decide(None, 5) == "new"
    hopeless = PromptStats(visits=4, samples=32, recent_wrong=30.0, last_epoch=2)
    assert sel.skip_prob(hopeless, 3) == 0.9  # P0 > 1/2: skipped with max_skip
    assert sel.skip_prob(hopeless, 5) == 0.0  # 3 epochs since its last visit: due
    assert sel.decide(hopeless, 5) == "due"
    mixed = PromptStats(visits=1, samples=8, recent_correct=4.0, recent_wrong=4.0, last_epoch=2)
    assert sel.skip_prob(mixed, 3) == 0.0 and sel.decide(mixed, 3) == "predicted"  # P0 0.05
    state = sel.state_dict()
    decisions = [sel.decide(hopeless, 3) for _ in range(50)]
    assert set(decisions) == {"skip", "floor"}  # over the threshold: skipped or a floor draw
    sel.load_state_dict(state)
    first = [sel.take(hopeless, 3) for _ in range(200)]
    assert 0 < sum(first) < 60 and sel.skipped == 200 - sum(first)  # ~10% taken
    sel.load_state_dict(state)
    assert [sel.take(hopeless, 3) for _ in range(200)] == first


def test_revisit_interval_backs_off_to_revisit_within_and_resets_on_a_new_outcome():
    """revisit_after 2, revisit_within 8: a prompt all wrong at 1, 2, 3, 4, 9 visits in a row is
    due 2, 4, 8, 8, 8 epochs after its last visit (2 * 2^(k - 1), capped); an all-right visit
    starts over at 2 (a new outcome), then 4; a group with variance: 2. The defaults: 16, 32."""
    config = PromptSelectionConfig(max_skip=0.9, revisit_after=2, revisit_within=8)
    sel, tracker = PredictiveSelector(8, config, seed=0), DifficultyTracker(config)
    intervals = []
    for epoch in range(9):
        tracker.update("u", [0.0] * 8, epoch)
        intervals.append(sel.revisit_interval(tracker.get("u")))
    assert intervals == [2, 4, 8, 8, 8, 8, 8, 8, 8]
    s = tracker.get("u")
    assert (s.wrong_streak, s.solved_streak, s.still_streak) == (9, 0, 9)
    # due exactly revisit_interval epochs after the last visit (epoch 8), skippable before
    assert sel.decide(s, 8 + 8) == "due" and sel.skip_prob(s, 8 + 7) == 0.9
    tracker.update("u", [1.0] * 8, 9)
    assert sel.revisit_interval(s) == 2 and (s.wrong_streak, s.solved_streak) == (0, 1)
    tracker.update("u", [1.0] * 8, 10)
    assert sel.revisit_interval(s) == 4
    tracker.update("u", [1.0] * 4 + [0.0] * 4, 11)
    assert sel.revisit_interval(s) == 2 and s.still_streak == 0
    # revisit_after at or over revisit_within: no back-off
    flat = PredictiveSelector(8, PromptSelectionConfig(revisit_after=16, revisit_within=3))
    assert flat.revisit_interval(tracker.get("v")) == 3
    tracker.update("v", [0.0] * 8, 0)
    tracker.update("v", [0.0] * 8, 3)
    assert flat.revisit_interval(tracker.get("v")) == 3
    default = PromptSelectionConfig()
    assert (default.revisit_after, default.revisit_within) == (16, 32)
    sel = PredictiveSelector(8, default)
    streaks = [PromptStats(wrong_streak=k) for k in (0, 1, 2, 3)]
    assert [sel.revisit_interval(s) for s in streaks] == [16, 16, 32, 32]


def test_sampler_gives_back_prompts_first_with_their_epochs():
    from dapo_lightning.data.selection.sampler import PromptSampler

    s = PromptSampler(10, seed=0)
    first = s.take(4)
    s.give_back(first[2:], s.last_epochs[2:])
    state = s.state_dict()
    again = s.take(3)
    assert again[:2] == first[2:] and again[2] not in first and s.last_epochs == [0, 0, 0]
    s.load_state_dict(state)
    assert s.take(3) == again


def test_predictive_selection_skips_zero_variance_prompts_and_starves_none():
    """Half of the scripted prompts never vary (pass rate 0 or 1). Predictive selection skips
    them after their first visit, yet every prompt is drawn again within revisit_within epochs."""
    kw = dict(num_prompts=32, train_batch_size=4, gen_batch_size=4, max_num_gen_batches=0)
    uniform, predictive = (
        make_producer(**kw),
        make_producer(**kw, strategy="predictive", max_skip=0.9, revisit_within=3),
    )
    visits: dict[str, list[int]] = {}
    update = predictive.tracker.update

    def record(uid, accs, epoch):  # every visit, with the epoch it was drawn in
        visits.setdefault(uid, []).append(epoch)
        update(uid, accs, epoch)

    predictive.tracker.update = record
    for producer in (uniform, predictive):
        gen = kept = samples = skipped = 0.0
        for step in range(40):
            batch = producer.next_batch(policy_version=step)
            s = batch.stats
            gen, kept = gen + s["data/generated_groups"], kept + s["data/kept_groups"]
            samples, skipped = (
                samples + s["data/generated_samples"],
                skipped + s["data/skipped_predicted"],
            )
            assert s["data/samples_per_kept_group"] == pytest.approx(
                s["data/generated_samples"] / s["data/kept_groups"]
            )
        producer.result = (kept / gen, samples / kept, skipped)
    assert uniform.result[2] == 0 and predictive.result[2] > 0
    assert predictive.result[0] > uniform.result[0] + 0.12  # kept fraction: 0.5 -> 0.67
    assert predictive.result[1] < uniform.result[1] * 0.8
    end = predictive.sampler.epoch
    assert end >= 6 and len(visits) == 32  # every prompt visited
    for uid, epochs in visits.items():
        seen = [0, *epochs, end]
        assert max(b - a for a, b in zip(seen, seen[1:])) <= 3, (uid, epochs)


def test_revisits_back_off_for_prompts_that_never_vary_and_stay_within_the_bound():
    """Scripted pass rates 0 or 1 never vary. With revisit_after 2 and revisit_within 8 the
    j-th gap between visits of such a prompt is at most min(2 * 2^(j - 1), 8) epochs (equal
    when due, shorter after a 1 - max_skip floor draw), and the cap 8 is reached; they are
    visited less often than with a fixed 2-epoch interval; the mixed prompts every epoch."""
    kw = dict(num_prompts=32, train_batch_size=4, gen_batch_size=4, max_num_gen_batches=0)
    runs = {}
    for within in (8, 2):
        producer = make_producer(
            **kw, strategy="predictive", max_skip=0.9, revisit_after=2, revisit_within=within
        )
        visits: dict[str, list[int]] = {}
        update = producer.tracker.update

        def record(uid, accs, epoch, update=update, visits=visits):
            visits.setdefault(uid, []).append(epoch)
            update(uid, accs, epoch)

        producer.tracker.update = record
        for step in range(120):
            producer.next_batch(policy_version=step)
        runs[within] = (visits, producer.sampler.epoch, producer.records)
    visits, end, records = runs[8]
    assert end >= 30
    still = [r.uid for r in records if pass_rate_of(r.prompt) in (0.0, 1.0)]
    assert len(still) >= 8
    reached_cap = 0
    for uid in still:
        seen = [*visits[uid], end]
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        assert all(g <= min(2 << j, 8) for j, g in enumerate(gaps)), (uid, seen)
        reached_cap += 8 in gaps
    assert reached_cap >= len(still) // 2
    for r in records:  # 1 or 2 right of 4: P0 <= 1/2, taken every epoch
        if r.uid not in still:
            seen = [*visits[r.uid], end]
            assert max(b - a for a, b in zip(seen, seen[1:])) <= 1, (r.uid, seen)
    fixed_visits, fixed_end, _ = runs[2]
    per_epoch = sum(len(visits[u]) for u in still) / end
    # per epoch and prompt: 1/2 + 0.1 floor draws fixed; 1/8 + 0.1 at the cap (0.40 of that)
    assert per_epoch < 0.6 * sum(len(fixed_visits[u]) for u in still) / fixed_end


@pytest.mark.parametrize("revisit_after", [16, 1])
def test_a_prompt_whose_skill_changed_is_seen_again_and_kept(revisit_after):
    """Prompts ``1+b`` are hopeless for 10 steps (predictive selection learns to skip them),
    then half right: each is drawn again within revisit_within epochs and found mixed, with a
    fixed revisit interval (revisit_after 16 >= revisit_within 4) and with the back-off 1, 2,
    4 (the cap is the bound)."""
    step = {"now": 0}

    def rate(expr):
        if expr.startswith("1+"):
            return 0.5 if step["now"] >= 10 else 0.0
        return pass_rate_of(expr)

    producer = make_producer(
        ScriptedEngine(rate=rate), num_prompts=32, train_batch_size=2, gen_batch_size=2,
        max_num_gen_batches=0, strategy="predictive", max_skip=0.95, revisit_within=4,
        revisit_after=revisit_after,
    )  # fmt: skip
    changed = [r.uid for r in producer.records if r.prompt.startswith("1+")]
    assert changed
    found: dict[str, int] = {}  # epoch in which each changed prompt was first found solvable
    for now in range(80):
        step["now"] = now
        producer.next_batch(policy_version=now)
        if now == 9:
            epoch_at_change = producer.sampler.epoch
            assert not any(producer.tracker.get(u).ever_solved for u in changed)
        for u in changed:
            st = producer.tracker.stats.get(u)
            if u not in found and st is not None and st.ever_solved:
                found[u] = producer.tracker.stats[u].last_epoch
    assert set(found) == set(changed)
    assert all(e - epoch_at_change <= 4 for e in found.values()), (epoch_at_change, found)


def test_sized_rounds_follow_the_kept_fraction_and_overshoot_is_never_silent():
    engine = ScriptedEngine()
    producer = make_producer(
        engine, num_prompts=64, train_batch_size=8, gen_batch_size=8, round_sizing="kept_frac",
        max_gen_batch_size=24, max_num_gen_batches=0,
    )  # fmt: skip
    expected_sizes, dropped = [], 0.0
    for step in range(5):
        before = len(engine.calls)
        k, g = producer.kept_estimate
        batch = producer.next_batch(policy_version=step)
        s = batch.stats
        assert batch.num_groups == 8
        sizes = [p for p, _ in engine.calls[before:]]
        if g == 0:
            assert sizes[0] == 8  # no history yet: gen_batch_size
        else:  # the first round of the step: enough for 8 groups at (k + 1) / (g + 2)
            assert sizes[0] == min(math.ceil(8 / ((k + 1) / (g + 2))), 24)
        expected_sizes.append(sizes)
        surplus = s["data/kept_groups"] - 8
        assert s["data/dropped_surplus_groups"] == surplus  # counted, not silent
        dropped += surplus
    assert dropped > 0
    # with carry_over the surplus goes to the next step, stamped with its sample version
    carry = make_producer(
        ScriptedEngine(), num_prompts=64, train_batch_size=8, gen_batch_size=8,
        round_sizing="kept_frac", carry_over=True, max_num_gen_batches=0,
    )  # fmt: skip
    carried = stale = 0
    for step in range(6):
        b = carry.next_batch(policy_version=step)
        assert b.stats["data/dropped_surplus_groups"] == 0 and b.num_groups == 8
        carried += b.stats["data/carried_groups"]
        stale += int((b.sample_version < step).sum())  # rows carried from an earlier step
    assert carried > 0 and stale > 0


def test_sized_rounds_without_a_filter_draw_exactly_what_is_missing():
    """filter_metric None keeps every group: a sized round is the missing groups, not the
    (k + 1) / (g + 2) estimate's overdraw (which gave 5 prompts a step for 4, dropped one and
    retired prompts a step early: the end game's 6 steps became 5)."""
    engine = ScriptedEngine(rate=lambda p: 1.0)
    producer = make_producer(
        engine, num_prompts=8, n=2, train_batch_size=4, gen_batch_size=None, filter_metric=None,
        round_sizing="kept_frac", retire_after=3,
    )  # fmt: skip
    for step in range(4):
        before = len(engine.calls)
        batch = producer.next_batch(policy_version=step)
        assert [p for p, _ in engine.calls[before:]] == [4]  # one round of the 4 missing
        assert batch.stats["data/dropped_surplus_groups"] == 0 and batch.num_groups == 4
    assert producer.kept_estimate[0] == producer.kept_estimate[1] > 0  # history was there


def test_in_flight_round_stops_when_full_and_gives_prompts_back():
    engine = ScriptedStreamingEngine()
    producer = make_producer(engine, num_prompts=64, gen_batch_size=16, in_flight=True)
    batch = producer.next_batch(policy_version=0)
    assert batch.num_groups == 8 and batch.batch_size == 32
    acc = group_accs(batch)
    assert (acc.max(1).values > acc.min(1).values).all()
    s = batch.stats
    assert s["data/aborted_groups"] == len(engine.aborted) > 0
    assert s["data/generated_groups"] + s["data/aborted_groups"] == 16
    assert s["data/kept_groups"] == 8 and s["data/dropped_surplus_groups"] == 0
    given_back = [i for i, _ in producer.sampler.pending]
    assert len(given_back) == s["data/aborted_groups"]
    drawn_first = producer.drawn_uids
    producer.next_batch(policy_version=1)
    assert producer.drawn_uids[: len(given_back)] == [producer.records[i].uid for i in given_back]
    assert not set(drawn_first) & set(producer.drawn_uids[: len(given_back)])
    # the HF-style engine (no stream_groups) keeps whole rounds
    whole = make_producer(ScriptedEngine(), num_prompts=64, gen_batch_size=16, in_flight=True)
    assert whole.next_batch().stats["data/aborted_groups"] == 0


def test_in_flight_round_finishes_started_groups_and_carries_their_surplus():
    """Once the batch is full the stream is sent DRAIN: the 3 groups already started finish
    and are scored (their kept surplus carried, stamped with its version), the groups never
    started are aborted and given back, and the batch is exactly train_batch_size groups."""
    engine = StartedStreamingEngine(started=3)
    producer = make_producer(
        engine, num_prompts=64, gen_batch_size=16, in_flight=True, carry_over=True
    )
    batch = producer.next_batch(policy_version=0)
    s = batch.stats
    assert batch.num_groups == 8 and batch.batch_size == 32 and (batch.sample_version == 0).all()
    generated = s["data/generated_groups"]
    assert s["data/aborted_groups"] == len(engine.dropped) == 16 - generated > 0
    assert [i for i, _ in producer.sampler.pending] == [
        producer.sampler.shard(0)[k] for k in engine.dropped
    ]
    carried = s["data/carried_groups"]
    assert carried == s["data/kept_groups"] - 8 and 0 < carried <= 3
    nxt = producer.next_batch(policy_version=1)
    assert nxt.num_groups == 8 and int((nxt.sample_version == 0).sum()) == carried * 4


def test_carry_over_is_bounded_by_one_batch():
    """A round that keeps more than two batches' worth: one batch is trained on, one carried
    (train_batch_size groups), the rest dropped and counted."""
    producer = make_producer(num_prompts=64, train_batch_size=4, gen_batch_size=24, carry_over=True)
    batch = producer.next_batch(policy_version=0)
    s = batch.stats
    assert s["data/kept_groups"] > 8  # 24 prompts, half of them vary
    assert batch.num_groups == 4 and s["data/carried_groups"] == 4
    assert s["data/dropped_surplus_groups"] == s["data/kept_groups"] - 8
    assert producer.carried[0][0].num_groups == 4 and producer.carried[0][1] == [0] * 16


def test_vllm_drain_keeps_the_requests_the_scheduler_runs():
    from dapo_lightning.rollout.vllm import not_started

    rids = [f"r{i}" for i in range(10)]
    assert not_started(rids, 4, 16) == rids[4:]  # 16 sequences: 4 requests of 4 run
    assert not_started(rids, 3, 16) == rids[6:]  # ceil(16 / 3): the 6th runs in part
    assert not_started(rids[:2], 4, 16) == []


def test_resume_with_the_new_defaults_gives_the_same_selections(tmp_path):
    def run(producer, steps, start=0):
        out = []
        for s in range(start, start + steps):
            batch = producer.next_batch(policy_version=s)
            out.append((list(producer.drawn_uids), batch.input_ids.tolist()))
        return out

    kw = dict(
        engine=None, num_prompts=16, strategy="predictive", round_sizing="kept_frac",
        retire_after=3, max_skip=0.9, revisit_after=1, revisit_within=4,
    )  # fmt: skip

    def fresh():
        return make_producer(
            ScriptedStreamingEngine(), **{k: v for k, v in kw.items() if k != "engine"}
        )

    full = run(fresh(), 20)
    producer = fresh()
    first = run(producer, 8)
    torch.save(producer.state_dict(), tmp_path / "producer.pt")
    resumed = fresh()
    resumed.load_state_dict(torch.load(tmp_path / "producer.pt", weights_only=True))
    assert first + run(resumed, 12, start=8) == full
    assert producer.selector.skipped > 0
    # the back-off's state (streaks of 2 and more: intervals 2, 4) is in the checkpoint
    assert max(s.wrong_streak for s in producer.tracker.stats.values()) >= 2


# ------------------------------------------------ issue 40: no wrap-around, reviews, round floor
class RecordingEngine(ScriptedEngine):
    """ScriptedEngine that keeps each generate call's prompts (their ``a+b=`` text)."""

    def __init__(self, rate=pass_rate_of):
        super().__init__(rate)
        self.rounds: list[list[str]] = []
        self.probe = None  # called at each generate call (the test reads the producer there)
        self.probed: list = []

    def generate(self, prompts, n, sampling):
        if self.probe is not None:
            self.probed.append(self.probe())
        texts = [TOK.decode(p, skip_special_tokens=True) for p in prompts]
        self.rounds.append([t.split("\n")[-3] if "\n" in t else t for t in texts])
        return super().generate(prompts, n, sampling)


def test_a_sized_round_draws_each_of_two_eligible_prompts_at_most_once():
    """14 of 16 prompts are always solved (retired after one visit), 2 are half right. Once
    the pool is down to those 2, the kept fraction is low and a sized round asks for many
    prompts: it holds each of the 2 once (before: the draw wrapped around the epochs and
    held each many times, all generated before either's history changed)."""
    live: set[str] = set()
    engine = RecordingEngine(rate=lambda expr: 0.5 if expr in live else 1.0)
    producer = make_producer(
        engine, num_prompts=16, train_batch_size=2, gen_batch_size=2, retire_after=1,
        round_sizing="kept_frac", max_num_gen_batches=0, review_weight=0.0,
    )  # fmt: skip
    live.update(r.prompt for r in producer.records[:2])
    for step in range(8):
        producer.next_batch(policy_version=step)
    assert producer.tracker.num_retired == 14
    late = engine.rounds[-6:]
    assert all(sorted(r) == sorted(live) for r in late), late
    assert all(len(r) == len(set(r)) for r in engine.rounds), engine.rounds
    assert max(len(r) for r in engine.rounds) > 2  # sized rounds asked for more than 2


def test_uniform_draws_without_filters_are_the_epoch_stream():
    """The quickstart's selection (uniform, nothing retired): sized rounds with carry-over
    draw exactly the next prompts of the seeded epoch order, epoch boundaries included, and
    the statistics of every run are logged (all 0 with nothing retired or reviewed)."""
    import random

    producer = make_producer(
        num_prompts=24, seed=3, train_batch_size=4, gen_batch_size=8, round_sizing="kept_frac",
        carry_over=True, max_num_gen_batches=0,
    )  # fmt: skip
    drawn: list[str] = []
    for step in range(12):
        stats = producer.next_batch(policy_version=step).stats
        drawn.extend(producer.drawn_uids)
        assert stats["data/review_frac"] == 0.0 and "data/regressed_frac" in stats
    order = []
    for epoch in range(producer.sampler.epoch + 1):
        perm = list(range(24))
        random.Random(f"3-{epoch}").shuffle(perm)
        order.extend(producer.records[i].uid for i in perm)
    assert producer.sampler.epoch >= 3
    assert drawn == order[: len(drawn)]


def test_sized_rounds_never_fall_below_the_floor_nor_exceed_the_eligible_prompts():
    floor = 6
    engine = RecordingEngine()
    producer = make_producer(
        engine, num_prompts=64, train_batch_size=8, gen_batch_size=8, round_sizing="kept_frac",
        max_num_gen_batches=0, min_gen_batch_size=floor,
    )  # fmt: skip
    for step in range(10):
        producer.next_batch(policy_version=step)
    sizes = [len(r) for r in engine.rounds]
    assert min(sizes[1:]) == floor  # second rounds of a step lifted to the floor
    unfloored = make_producer(
        RecordingEngine(), num_prompts=64, train_batch_size=8, gen_batch_size=8,
        round_sizing="kept_frac", max_num_gen_batches=0,
    )  # fmt: skip
    for step in range(10):
        unfloored.next_batch(policy_version=step)
    assert min(len(r) for r in unfloored.session.engine.rounds) < floor
    # 2 eligible prompts (the rest solved and retired): rounds of 2, the floor gives way
    live: set[str] = set()
    engine = RecordingEngine(rate=lambda expr: 0.5 if expr in live else 1.0)
    small = make_producer(
        engine, num_prompts=16, train_batch_size=2, gen_batch_size=2, retire_after=1,
        round_sizing="kept_frac", max_num_gen_batches=0, min_gen_batch_size=floor,
        review_weight=0.0,
    )  # fmt: skip
    live.update(r.prompt for r in small.records[:2])
    engine.probe = lambda: sum(small.tracker.eligible(r.uid, 0) for r in small.records)
    for step in range(8):
        small.next_batch(policy_version=step)
    sized = list(zip([len(r) for r in engine.rounds], engine.probed))[1:]  # the 1st: no history
    assert all(min(floor, eligible) <= size <= eligible for size, eligible in sized), sized
    assert sized[-1] == (2, 2) and any(e > floor for _, e in sized)


def regressing_producer(review_weight, *, engine_cls=ScriptedEngine, **kw):
    """Prompts ``1+b`` are solved for 12 steps (retired after 2 all-correct visits), then half
    right: a regression only a review can see."""
    step = {"now": 0}

    def rate(expr):
        if expr.startswith("1+"):
            return 1.0 if step["now"] < 12 else 0.5
        return 0.5 if zlib.crc32(expr.encode()) % 2 else 0.0

    settings = dict(
        num_prompts=32, train_batch_size=2, gen_batch_size=4, max_num_gen_batches=0,
        strategy="predictive", max_skip=0.9, retire_after=2, revisit_after=1, revisit_within=2,
        review_weight=review_weight,
    )  # fmt: skip
    settings.update(kw)
    producer = make_producer(engine_cls(rate=rate), **settings)
    return producer, step, [r.uid for r in producer.records if r.prompt.startswith("1+")]


@pytest.mark.parametrize("strategy", ["predictive", "uniform"])
def test_retired_prompts_are_reviewed_and_a_regression_is_seen_and_repaired(strategy):
    """With review_weight 0.5 the solved ``1+b`` prompts come back after retiring, under
    either strategy; once they regress a review finds it, puts them back in the draw (kept
    groups again) and counts it in data/regressed_frac; data/review_frac is the share of
    reviews among the drawn prompts. With review_weight 0 (the former retiring) they are never
    drawn again."""
    for weight in (0.5, 0.0):
        producer, step, solved = regressing_producer(weight, strategy=strategy)

        def reviewed(producer=producer) -> int:
            return producer.selector.reviewed if producer.selector is not None else 0

        assert len(solved) >= 2
        visits_after: dict[str, int] = {u: 0 for u in solved}
        reviews = drawn = 0.0
        for now in range(60):
            step["now"] = now
            reviewed_before = reviewed()
            stats = producer.next_batch(policy_version=now).stats
            new_reviews = reviewed() - reviewed_before
            # the step's share of reviews among the prompts it drew
            assert stats["data/review_frac"] == pytest.approx(
                new_reviews / max(len(producer.drawn_uids), 1)
            )
            reviews, drawn = reviews + new_reviews, drawn + len(producer.drawn_uids)
            tr = producer.tracker
            assert stats["data/regressed_frac"] == pytest.approx(
                sum(s.regressed for s in tr.stats.values()) / len(tr.stats)
            )
            if now >= 12:
                for u in producer.drawn_uids:
                    if u in visits_after:
                        visits_after[u] += 1
        if weight == 0.0:
            assert reviews == 0 and all(v == 0 for v in visits_after.values())
            assert all(producer.tracker.stats[u].retired for u in solved)
            assert not any(producer.tracker.stats[u].regressed for u in solved)
        else:
            assert reviews > 0
            assert all(producer.tracker.stats[u].regressed for u in solved)
            assert all(not producer.tracker.stats[u].retired for u in solved)
            assert all(v >= 2 for v in visits_after.values()), visits_after


def test_resume_with_reviews_and_deferred_repeats_gives_the_same_selections(tmp_path):
    """The review counter and RNG, the regression flags and the deferred repeats are in the
    producer's state: a resume gives the selections of an uninterrupted run."""

    def run(producer, step, steps, start=0):
        out = []
        for s in range(start, start + steps):
            step["now"] = s
            batch = producer.next_batch(policy_version=s)
            picked = {k: batch.stats[k] for k in ("data/review_frac", "data/regressed_frac")}
            out.append((list(producer.drawn_uids), batch.input_ids.tolist(), picked))
        return out

    kw = dict(engine_cls=ScriptedStreamingEngine, round_sizing="kept_frac", carry_over=True)
    full_producer, full_step, _ = regressing_producer(0.5, **kw)
    full = run(full_producer, full_step, 30)
    producer, step, _ = regressing_producer(0.5, **kw)
    first = run(producer, step, 7)
    assert producer.sampler.deferred  # a repeat waits for the next draw at the save
    torch.save(producer.state_dict(), tmp_path / "producer.pt")
    resumed, rstep, _ = regressing_producer(0.5, **kw)
    resumed.load_state_dict(torch.load(tmp_path / "producer.pt", weights_only=True))
    assert first + run(resumed, rstep, 23, start=7) == full
    assert full_producer.selector.reviewed > 0
    assert any(s.regressed for s in full_producer.tracker.stats.values())


def test_rounds_and_batches_carry_the_index_of_the_batch_they_were_generated_for():
    """Every scored round (what on_rollouts_scored sees) carries the index of the batch being
    produced, the batch too, carried groups included; a rewind gives the same index again and
    a resumed producer goes on counting (RoundCounts keys a callback's counts by it)."""
    seen: list[int] = []
    producer = make_producer(
        gen_batch_size=12, carry_over=True, on_scored=lambda r: seen.append(r.batch_index)
    )
    indices = []
    for version in (0, 0, 1):  # two batches at one version, as the first two of one-step-off
        seen.clear()
        batch = producer.next_batch(policy_version=version)
        indices.append(batch.batch_index)
        assert seen and set(seen) == {batch.batch_index}
    assert indices == [0, 1, 2] and producer.batches_made == 3
    assert producer.rewind()
    assert producer.next_batch(policy_version=1).batch_index == 2  # the same batch again
    resumed = make_producer(gen_batch_size=12, carry_over=True)
    resumed.load_state_dict(producer.state_dict())
    assert resumed.next_batch(policy_version=2).batch_index == 3
