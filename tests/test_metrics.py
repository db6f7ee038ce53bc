"""MetricAccumulator: explicit reduce operations over micro-batches and real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from dapo_lightning.metrics import MetricAccumulator
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
