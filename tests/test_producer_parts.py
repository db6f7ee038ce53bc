"""The pieces split out of the rollout producer, each on its own: the round report summed over
two real gloo ranks field by field (and the stop they agree on), the step statistics and the
op each declares over ranks, the rank layout, and a DynamicSamplingConfig pickled under the
module path it had before the split."""

from __future__ import annotations

import copyreg
import os

import pytest
import torch
import torch.multiprocessing as mp

from dapo_lightning.data.sampling.metrics import rollout_step_metrics
from dapo_lightning.data.sampling.rank_layout import RankLayout, member_rows
from dapo_lightning.data.sampling.round_report import RoundReport, Shortfall
from dapo_lightning.data.sampling.settings import LEGACY_CLASS_PATH, DynamicSamplingConfig
from dapo_lightning.data.sampling.step_stats import STAT_OPS, StepStats, rank_op
from dapo_lightning.interrupt import clear_stop_request, request_stop, stop_requested
from dapo_lightning.ranks import sum_over_ranks
from dapo_lightning.testing import free_port, make_random_rollout_batch

#: The table the producer declared by name before StepStats (names and ops must not change:
#: dashboards and the callbacks read these names).
OLD_STAT_OPS = {
    "data/generated_groups": "sum", "data/kept_groups": "sum", "data/batch_groups": "sum",
    "data/carried_groups": "sum", "data/dropped_stale_groups": "sum",
    "data/generated_tokens": "sum", "data/reward_failures": "sum", "data/retired": "sum",
    "data/parked": "sum", "data/dropped_prompts": "sum", "data/generated_samples": "sum",
    "data/skipped_predicted": "sum", "data/aborted_groups": "sum",
    "data/dropped_surplus_groups": "sum", "data/gen_rounds": "max", "data/gen_seconds": "max",
    "data/score_seconds": "max", "data/short_batch": "max", "env/failures": "sum",
    "env/observation_tokens": "sum", "env/timeouts": "sum",
}  # fmt: skip


def test_step_stats_declare_the_same_names_and_ops_as_before():
    assert STAT_OPS == OLD_STAT_OPS | {"env/demonstrations": "sum"}  # issue 39's, added
    assert rank_op("data/kept_frac") == "mean" and rank_op("reward/anything") == "mean"
    stats = StepStats()
    assert set(stats.as_metrics()) == set(OLD_STAT_OPS) | {"env/demonstrations"} | {
        "data/samples_per_kept_group", "data/kept_frac", "data/zero_variance_frac", "data/epoch",
        "data/regressed_frac", "data/review_frac",  # issue 40's selection statistics
    }  # fmt: skip
    stats.generated_groups += 8.0
    stats.kept_groups += 6.0
    stats.generated_samples += 32.0
    stats.add_reward_extras({"long": [1.0, 0.0, 1.0]})
    stats.add_reward_extras({"long": [1.0]})
    stats.finish(epoch=3)
    m = stats.as_metrics()
    assert m["data/kept_frac"] == 0.75 and m["data/zero_variance_frac"] == 0.25
    assert m["data/samples_per_kept_group"] == 32 / 6 and m["data/epoch"] == 3.0
    assert m["reward/long"] == 0.75  # this rank's mean over its 4 responses
    stats.zero_sums()  # a tensor-parallel member: counts are reported by the group's first rank
    m = stats.as_metrics()
    assert m["data/kept_groups"] == 0.0 and m["data/kept_frac"] == 0.75


def test_rank_layout_and_member_rows():
    layout = RankLayout(rank=3, world_size=4, tp_size=2)
    assert (layout.member, layout.group, layout.groups) == (1, 1, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the number of ranks"):
        RankLayout(0, 4, 3)
    group_index = torch.tensor([0, 0, 1, 1, 2, 2])
    assert member_rows(group_index, 0, 2) == [0, 1, 2, 3]  # 3 groups over 2 members: 2 + 1
    assert member_rows(group_index, 1, 2) == [4, 5]
    assert member_rows(group_index, 0, 1) == list(range(6))


@pytest.mark.parametrize(
    "old_module",
    ["dapo_lightning.data.producer", "dapo_lightning.data.dynamic_sampling"],
)
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_config_pickled_under_an_old_module_path_loads(
    tmp_path, monkeypatch, old_module, weights_only
):
    """Checkpoints name the class where it lived then: ``dapo_lightning.data.producer`` (before
    the settings got their own module), ``dapo_lightning.data.dynamic_sampling`` (before the
    data package's sub-packages: MOVED_MODULES); both load, with and without ``weights_only``."""
    config = DynamicSamplingConfig(n=4, train_batch_size=8)
    monkeypatch.setattr(DynamicSamplingConfig, "__module__", old_module)
    state = {f: getattr(config, f) for f in config.__dataclass_fields__}
    monkeypatch.setattr(
        DynamicSamplingConfig,
        "__reduce_ex__",
        lambda self, protocol: (copyreg.__newobj__, (DynamicSamplingConfig,), state),
    )
    torch.save({"hparams": {"dynamic_sampling": config}}, tmp_path / "old.ckpt")
    monkeypatch.undo()
    assert old_module.encode() in (tmp_path / "old.ckpt").read_bytes()
    assert LEGACY_CLASS_PATH == "dapo_lightning.data.producer.DynamicSamplingConfig"
    loaded = torch.load(tmp_path / "old.ckpt", weights_only=weights_only)
    assert loaded["hparams"]["dynamic_sampling"] == config


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        need = Shortfall(missing=3 + rank, short=1).summed(sum_over_ranks)
        if rank == 1:
            request_stop("SIGTERM")  # a signal seen by rank 1 only
        reason = stop_requested()
        report = RoundReport(
            short=rank, failed=0, out_of_prompts=0, missing=5 * rank, kept=2 + rank,
            generated=8, **RoundReport.stop_fields(reason),
        ).summed(sum_over_ranks)  # fmt: skip
        agreed = report.agreed_stop(reason)
        seen = stop_requested()
        clear_stop_request()
        # statistics: rank 0 generated 8 groups in 2 s, rank 1 4 groups in 5 s; a reward
        # extra with mean 2/3 on rank 0 (3 responses) and 0 on rank 1 (1 response)
        stats = StepStats()
        stats.generated_groups += 8.0 if rank == 0 else 4.0
        stats.gen_seconds += 2.0 if rank == 0 else 5.0
        stats.add_reward_extras({"long": [1.0, 1.0, 0.0] if rank == 0 else [0.0]})
        stats.finish(epoch=rank)
        batch = make_random_rollout_batch(num_groups=2, group_size=2, seed=rank)
        batch.stats = stats.as_metrics()

        def rank_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
            return t

        logged = rollout_step_metrics(batch, 0, 0.1).reduce(rank_reduce)
        torch.save((need, report, agreed, seen, logged), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_reports_and_stats_over_two_gloo_ranks(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        need, report, agreed, seen, logged = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert need == Shortfall(missing=7, short=2)
        assert report == RoundReport(
            1, 0, 0, 5, 5, 16, signalled=1, signal_sum=15, signal_squares=225
        )
        assert report.stopped and agreed == "SIGTERM" == seen  # rank 0 takes rank 1's signal
        assert logged["data/generated_groups"] == 12.0  # summed
        assert logged["data/gen_seconds"] == 5.0  # the slowest rank
        assert logged["reward/long"] == pytest.approx((2 / 3 + 0.0) / 2)  # ranks weigh 1
        assert logged["data/epoch"] == 0.5


@pytest.mark.parametrize(
    ("reasons", "agreed"),
    [
        (["SIGHUP"], "SIGHUP"),  # issue 63: a SIGHUP on one rank of several
        (["SIGUSR1", "SIGUSR1"], "SIGUSR1"),
        (["SIGQUIT", None], "SIGQUIT"),
        (["SIGHUP", "SIGQUIT"], "a stop was requested on another rank"),  # mean 2 = SIGINT
        (["stop requested on another rank"], "a stop was requested on another rank"),
    ],
)
def test_a_rank_without_a_stop_takes_the_signal_the_others_saw(reasons, agreed):
    """The summed report of the ranks that saw ``reasons``: a rank with no stop of its own
    stops as they did (so every rank exits 128 + that signal), and signals that differ are
    never averaged into a third one."""
    fields = [RoundReport.stop_fields(r) for r in reasons]
    summed = {k: sum(f[k] for f in fields) for k in fields[0]}
    report = RoundReport(short=0, failed=0, out_of_prompts=0, missing=0, kept=0, generated=0,
                         **summed)  # fmt: skip
    try:
        assert report.stopped
        assert report.agreed_stop(None) == agreed
        assert stop_requested() == (agreed if agreed.startswith("SIG") else None)
    finally:
        clear_stop_request()
