"""MetricAccumulator: explicit reduce operations over micro-batches and real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from dapo_lightning.metrics import (
    MetricAccumulator,
    MetricNamesMismatch,
    describe_mismatch,
    names_digest,
)
from dapo_lightning.testing import free_port


def test_token_weighted_mean_max_min_sum_in_one_process():
    acc = MetricAccumulator()
    acc.add("entropy", 0.0, weight=1000)
    acc.add("entropy", 1.0, weight=10)
    acc.add("ratio_max", 1.2, op="max")
    acc.add("ratio_max", 1.5, op="max")
    acc.add("tis_min", 0.7, op="min")
    acc.add("tis_min", 0.4, op="min")
    acc.add("loss", 0.25, op="sum")
    acc.add("loss", 0.5, op="sum")
    out = acc.reduce()
    assert out["entropy"] == pytest.approx(10 / 1010)  # 0.0099, not 0.5
    assert out == pytest.approx(
        {"entropy": 10 / 1010, "ratio_max": 1.5, "tis_min": 0.4, "loss": 0.75}
    )
    assert list(out) == ["entropy", "ratio_max", "tis_min", "loss"]  # order of first add


def test_zero_weight_mean_is_zero_and_ops_are_checked():
    acc = MetricAccumulator()
    acc.add("entropy", 5.0, weight=0.0)
    assert acc.reduce() == {"entropy": 0.0}
    with pytest.raises(ValueError, match="was added with op 'mean'"):
        acc.add("entropy", 1.0, op="max")
    with pytest.raises(ValueError, match="unknown reduce op"):
        acc.add("x", 1.0, op="median")


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:

        def rank_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
            return t

        acc = MetricAccumulator()
        # rank 0: 1000 tokens of entropy 0.0; rank 1: 10 tokens of entropy 1.0
        acc.add("entropy", float(rank), weight=1000.0 if rank == 0 else 10.0)
        acc.add("ratio_max", 1.0 + rank, op="max")
        acc.add("tis_min", 1.0 - 0.5 * rank, op="min")
        acc.add("tokens", 1000.0 if rank == 0 else 10.0, op="sum")
        torch.save(acc.reduce(rank_reduce), os.path.join(out_dir, f"rank{rank}.pt"))
        errors = []
        # rank 0 alone adds two correction metrics (issue 53's crash); then the same names in
        # two orders. Each reduce must fail on both ranks, then the next one works again.
        for extra in (["tis_weight_mean", "tis_masked_frac"], "swap"):
            bad = MetricAccumulator()
            names = ["entropy", "loss"] if extra == "swap" and rank == 0 else ["loss", "entropy"]
            for name in names + (extra if rank == 0 and extra != "swap" else []):
                bad.add(name, 1.0)
            try:
                bad.reduce(rank_reduce)
                errors.append(None)
            except MetricNamesMismatch as error:
                errors.append(str(error))
        torch.save(errors, os.path.join(out_dir, f"errors{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank_mean_is_token_weighted(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["entropy"] == pytest.approx(0.0099, abs=1e-4)  # 10 / 1010
        assert out == pytest.approx(
            {"entropy": 10 / 1010, "ratio_max": 2.0, "tis_min": 0.5, "tokens": 1010.0}
        )
        missing, order = torch.load(tmp_path / f"errors{rank}.pt")
        assert missing.startswith(
            "metric 'tis_weight_mean' (op mean) was added on rank(s) [0] but not on rank(s) [1] "
            "(1 more differ)"
        )
        assert "in different orders" in order and "'entropy:mean'" in order


def test_names_digest_and_the_mismatch_message_in_one_process():
    """The digest tells lists apart by content and order; the message names the first entry
    some ranks lack, and a reduce over one process always passes the check."""
    assert names_digest(["a:mean", "b:max"]) != names_digest(["b:max", "a:mean"])
    assert names_digest(["a:mean"]) == names_digest(["a:mean"]) < 2**48
    message = describe_mismatch([["a:mean"], ["a:mean", "x/y:max"], ["a:mean", "x/y:max"]])
    assert message.startswith("metric 'x/y' (op max) was added on rank(s) [1, 2] but not on ")
    acc = MetricAccumulator()
    acc.add("a", 2.0, op="max")
    assert acc.reduce(lambda t, op: t.clone()) == {"a": 2.0}


# ------------------------------------------------------------------ validation (torchmetrics)
def _rollouts(accs: list[float], k: int, lengths: list[int]):
    from dapo_lightning.batch import ScoredRollouts
    from dapo_lightning.rollout.base import SamplingConfig

    n = len(accs)
    return ScoredRollouts(
        prompt_ids=[[1]] * n,
        response_ids=[[5] * lengths[i % len(lengths)] for i in range(n)],
        rollout_log_probs=[[0.0] * lengths[i % len(lengths)] for i in range(n)],
        finish_reason=["stop"] * n,
        group_index=torch.arange(n // k).repeat_interleave(k),
        prompt_uid=[f"p{i // k}" for i in range(n)],
        score=torch.tensor(accs) * 2 - 1,
        acc=torch.tensor(accs),
        sampling=SamplingConfig(max_tokens=8),
    )


#: Three validation chunks of groups of 3 with means that float32 does not hold exactly.
VAL_BATCHES = [
    ([1, 0, 0, 1, 1, 0, 0, 0, 0], [1, 2, 7]),
    ([0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0], [3, 1]),
    ([1, 1, 1], [5]),
]


def test_validation_metrics_as_torchmetrics_equal_the_formula():
    from dapo_lightning.data.sampling.metrics import ValidationMetrics, validation_metrics

    metrics = ValidationMetrics()
    batches = [_rollouts([float(a) for a in accs], 3, lengths) for accs, lengths in VAL_BATCHES]
    for i, batch in enumerate(batches):
        logged = metrics.update(batch, i)
        assert set(logged) == {"val/acc", "val/pass@3", "val/response_length"}
    # one validation = the formula on all its rollouts (val/acc over 27 responses, 12 right;
    # pass@3 over 9 groups, 7 with a right answer)
    all_rollouts = _rollouts(
        [float(a) for accs, _ in VAL_BATCHES for a in accs], 3, [1]
    )  # lengths differ: response_length checked against the batches below
    expected = validation_metrics(all_rollouts)
    assert float(logged["val/acc"].compute()) == pytest.approx(12 / 27, rel=1e-6)
    assert float(logged["val/acc"].compute()) == pytest.approx(expected["val/acc"], rel=1e-6)
    assert float(logged["val/pass@3"].compute()) == pytest.approx(7 / 9, rel=1e-6)
    assert float(logged["val/pass@3"].compute()) == pytest.approx(expected["val/pass@3"], rel=1e-6)
    lengths = [len(r) for b in batches for r in b.response_ids]
    assert float(logged["val/response_length"].compute()) == pytest.approx(
        sum(lengths) / len(lengths), rel=1e-6
    )
    # one batch alone: exactly the formula's floats
    single = metrics.update(batches[0], 0)  # batch 0 starts a new validation
    for name, value in validation_metrics(batches[0]).items():
        assert float(single[name].compute()) == value


@pytest.mark.timeout(120)
def test_validation_logged_through_lightning_is_bitwise_the_old_log_dict(tmp_path):
    """The same validation logged two ways through a real Trainer: the per-batch floats with
    log_dict(batch_size=len(batch)) (before) and the torchmetrics metrics (now): every
    ``val/*`` value in callback_metrics is the same float32, over two validations."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from dapo_lightning.data.sampling.metrics import ValidationMetrics, validation_metrics

    batches = [_rollouts([float(a) for a in accs], 3, lengths) for accs, lengths in VAL_BATCHES]

    class Validator(pl.LightningModule):
        def __init__(self, use_metrics: bool) -> None:
            super().__init__()
            self.use_metrics = use_metrics
            self.val_metrics = ValidationMetrics()
            self.results: list[dict[str, torch.Tensor]] = []

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

        def validation_step(self, batch, batch_idx):
            if self.use_metrics:
                metrics = self.val_metrics.update(batch, batch_idx)
            else:
                metrics = validation_metrics(batch)
            self.log_dict(metrics, on_epoch=True, batch_size=len(batch))

        def on_validation_epoch_end(self):
            self.results.append(dict(self.trainer.callback_metrics))

    out = {}
    for use_metrics in (False, True):
        module = Validator(use_metrics)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        for _ in range(2):
            trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
        out[use_metrics] = trainer.callback_metrics
    assert set(out[True]) == set(out[False]) == {"val/acc", "val/pass@3", "val/response_length"}
    for name in out[False]:
        assert out[True][name].dtype == out[False][name].dtype == torch.float32
        assert out[True][name].item() == out[False][name].item(), name
    assert out[True]["val/acc"].item() == pytest.approx(12 / 27, rel=1e-6)
