"""DynamicSamplingBuffer without Lightning, on a scripted arithmetic task.

``ScriptedEngine`` is a real implementation of the RolloutEngine protocol: it returns pre-written
completions (the right answer or a wrong one) following a fixed per-prompt pattern, so which
groups have variance is known exactly and reproducible (no hidden RNG state)."""

from __future__ import annotations

import zlib

import pytest
import torch

from dapo_lightning.data.buffer import STAT_KEYS, DynamicSamplingBuffer, DynamicSamplingError
from dapo_lightning.data.difficulty import DifficultyTracker, subsample_keep_variance
from dapo_lightning.data.sources import FieldMap, records_from_rows, tokenize_records
from dapo_lightning.rewards import RewardRunner
from dapo_lightning.rollout.base import Completion, SamplingConfig
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


def make_buffer(engine=None, *, num_prompts=64, seed=0, level=1, **kw):
    records = records_from_rows(make_arithmetic_rows(num_prompts, level=level, seed=seed), FIELDS)
    records, _ = tokenize_records(records, TOK, apply_chat_template=True, max_prompt_length=64)
    runner = RewardRunner(ArithmeticReward(), in_process=True)
    args = dict(n=4, train_batch_size=8, gen_batch_size=8, max_num_gen_batches=20)
    args.update(kw)
    return DynamicSamplingBuffer(
        engine or ScriptedEngine(),
        runner,
        records,
        decode=lambda ids: TOK.decode(ids, skip_special_tokens=True),
        pad_token_id=TOK.pad_token_id,
        sampling=SamplingConfig(max_tokens=8),
        seed=seed,
        **args,
    )


def group_accs(batch):
    return batch.acc.view(-1, batch.group_size)


def test_batches_are_full_and_never_zero_variance():
    buf = make_buffer()
    for step in range(4):
        batch = buf.next_batch(policy_version=step)
        assert batch.batch_size == 8 * 4 and batch.group_size == 4 and batch.num_groups == 8
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()
        assert (batch.sample_version == step).all() and batch.policy_version == step
        assert set(STAT_KEYS) <= set(batch.stats)
        s = batch.stats
        assert s["kept_groups"] >= 8 and s["generated_groups"] == 8 * s["gen_rounds"]
        assert s["zero_variance_frac"] == pytest.approx(
            1 - s["kept_groups"] / s["generated_groups"]
        )
        assert s["generated_tokens"] > 0 and s["stale_groups"] == 0
        # contiguous groups 0..7 of 4
        assert batch.group_index.tolist() == [g for g in range(8) for _ in range(4)]


class ConstantShaping:
    """Sets every shaped reward to 0 and records what it saw (a shaping callback)."""

    def __init__(self):
        self.seen_groups = 0

    def on_rollouts_scored(self, trainer, pl_module, rollouts):
        self.seen_groups += int(rollouts.group_index.max()) + 1
        rollouts.reward.zero_()


def test_shaping_runs_before_filter_and_does_not_decide_it():
    cb = ConstantShaping()
    buf = make_buffer()
    generated = 0
    for _ in range(3):
        batch = buf.next_batch(callbacks=[cb, object()])
        generated += batch.stats["generated_groups"]
        assert (batch.reward == 0).all()  # shaping reached the batch
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()  # filter used acc, not the reward
    # The callback saw every generated group, including the ones the filter then dropped.
    assert cb.seen_groups == generated > 3 * 8
    # With filter_metric="reward" the same shaping leaves no group with variance.
    with pytest.raises(DynamicSamplingError):
        make_buffer(filter_metric="reward", max_num_gen_batches=3).next_batch(callbacks=[cb])


def test_max_num_gen_batches_explains():
    buf = make_buffer(ScriptedEngine(rate=lambda p: 1.0), max_num_gen_batches=3)
    with pytest.raises(DynamicSamplingError) as e:
        buf.next_batch()
    msg = str(e.value)
    assert "max_num_gen_batches=3" in msg and "100% were filtered" in msg
    assert "Raise n" in msg and "filter_metric=None" in msg


def test_no_filter_keeps_everything():
    buf = make_buffer(ScriptedEngine(rate=lambda p: 1.0), filter_metric=None)
    batch = buf.next_batch()
    assert batch.stats["gen_rounds"] == 1 and batch.stats["zero_variance_frac"] == 0
    acc = group_accs(batch)
    assert (acc == 1).all() and batch.num_groups == 8


def test_carry_over_marks_stale_groups():
    buf = make_buffer(gen_batch_size=12, carry_over=True)
    b0 = buf.next_batch(policy_version=0)
    carried = b0.stats["carried_groups"]
    assert 0 < carried < 8
    b1 = buf.next_batch(policy_version=1)
    stale = int((b1.sample_version[::4] == 0).sum())
    assert stale == min(carried, 8) == b1.stats["stale_groups"]
    assert b1.policy_version == 1 and (b1.sample_version[stale * 4 :] == 1).all()
    dropped = make_buffer(gen_batch_size=32).next_batch(policy_version=0)
    assert dropped.stats["carried_groups"] == 0


def test_validation_errors():
    with pytest.raises(ValueError, match="multiple of world_size"):
        make_buffer(train_batch_size=7, world_size=2)
    with pytest.raises(ValueError, match="n >= 2"):
        make_buffer(n=1)


def test_retire_and_park():
    tracker = DifficultyTracker(retire_after=1, park_after=1, revisit_every=2)
    buf = make_buffer(num_prompts=16, tracker=tracker, train_batch_size=2, gen_batch_size=4)
    rate = {r.uid: pass_rate_of(r.prompt) for r in buf.records}
    visits: list[tuple[int, str]] = []
    for _ in range(12):
        buf.next_batch()
        visits.extend((buf.sampler.epoch, u) for u in buf.drawn_uids)
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
    assert buf.next_batch().stats["retired"] == tracker.num_retired > 0
    assert tracker.num_parked > 0


def test_adaptive_group_size_budget_and_subsampling():
    tracker = DifficultyTracker()
    engine = ScriptedEngine()
    buf = make_buffer(engine, tracker=tracker, adaptive_n=True, max_n=12, gen_batch_size=8)
    for _ in range(4):
        batch = buf.next_batch()
        assert batch.batch_size == 32 and batch.group_size == 4
        acc = group_accs(batch)
        assert (acc.max(1).values > acc.min(1).values).all()
    # every round stays within its budget of gen_batch_size * n samples
    # (calls of one round are consecutive; sizes above n happen for seen hard prompts)
    assert max(n for _, n in engine.calls) > 4
    assert all(p * n <= 32 for p, n in engine.calls)
    # harder prompts get more samples
    hard = [r.uid for r in buf.records if pass_rate_of(r.prompt) == 0.25]
    easy = [r.uid for r in buf.records if pass_rate_of(r.prompt) == 1.0]
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
    def run(buf, steps, start=0):
        seq = []
        for s in range(start, start + steps):
            batch = buf.next_batch(policy_version=s)
            seq.append(
                (list(buf.drawn_uids), batch.input_ids.tolist(), batch.sample_version.tolist())
            )
        return seq

    kw = dict(
        tracker=DifficultyTracker(retire_after=2, park_after=2),
        carry_over=True,
        gen_batch_size=12,
        num_prompts=24,
    )
    full = run(make_buffer(**kw), 6)
    buf = make_buffer(**{**kw, "tracker": DifficultyTracker(retire_after=2, park_after=2)})
    first = run(buf, 2)
    torch.save(buf.state_dict(), tmp_path / "buf.pt")
    resumed = make_buffer(**{**kw, "tracker": DifficultyTracker(retire_after=2, park_after=2)})
    resumed.load_state_dict(torch.load(tmp_path / "buf.pt", weights_only=True))
    rest = run(resumed, 4, start=2)
    assert first + rest == full
