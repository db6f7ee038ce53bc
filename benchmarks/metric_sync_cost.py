"""What reducing one rollout step's metrics over ranks costs: MetricAccumulator vs torchmetrics.

A rollout step logs about 45 metrics (rollout/*, data/*, reward/*, parity/*, time/*), each with
its own reduce op over ranks. ``MetricAccumulator.reduce`` packs them into three tensors and
makes three collectives (sum, max, min) whatever their number; the same metrics as
``torchmetrics`` objects (``MeanMetric``, ``SumMetric``, ``MaxMetric``) are synced one state
at a time when computed (a mean has two states: about 80 collectives). Two real gloo ranks on
this machine, the median of ``--repeats`` reductions, side by side in one run.

    python -m benchmarks.metric_sync_cost            # ~20 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics import MaxMetric, MeanMetric, SumMetric

from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.testing import free_port

#: A rollout step's metrics by reduce op (the counts of a real step's log).
OPS = ["mean"] * 25 + ["sum"] * 14 + ["max"] * 6


def _rank_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
    return t


def _accumulator() -> float:
    acc = MetricAccumulator()
    for i, op in enumerate(OPS):
        acc.add(f"m{i}", float(i), op=op, weight=2.0)
    t0 = time.perf_counter()
    acc.reduce(_rank_reduce)
    return time.perf_counter() - t0


def _torchmetrics() -> float:
    kinds = {"mean": MeanMetric, "sum": SumMetric, "max": MaxMetric}
    metrics = [kinds[op]() for op in OPS]
    for i, (op, m) in enumerate(zip(OPS, metrics)):
        m.update(float(i), 2.0) if op == "mean" else m.update(float(i))
    t0 = time.perf_counter()
    for m in metrics:
        m.compute()
    return time.perf_counter() - t0


def _worker(rank: int, port: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        times = {"MetricAccumulator": [], "torchmetrics": []}
        for _ in range(repeats):
            dist.barrier()
            times["MetricAccumulator"].append(_accumulator())
            dist.barrier()
            times["torchmetrics"].append(_torchmetrics())
        if rank == 0:
            torch.save({k: statistics.median(v) for k, v in times.items()}, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"metric_sync_cost_{os.getpid()}.pt"
    mp.spawn(_worker, args=(free_port(), args.repeats, str(out)), nprocs=2, join=True)
    medians = torch.load(out)
    out.unlink()
    base = medians["MetricAccumulator"]
    print(f"{len(OPS)} metrics over 2 gloo ranks, median of {args.repeats}:")
    for name, seconds in medians.items():
        print(f"  {name:18s} {seconds * 1e3:8.2f} ms  ({seconds / base:5.1f}x)")


if __name__ == "__main__":
    main()
