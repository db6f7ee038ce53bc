"""Worker of tests/test_data_distributed.py: one gloo rank running RolloutProducers."""

from __future__ import annotations

import os
import sys
import zlib

import torch
import torch.distributed as dist


def _scenario(rank: int, world: int, mode: str) -> dict:
    from test_producer import ScriptedEngine, make_producer

    if rank == 0:
        engine = ScriptedEngine(rate=lambda p: 0.5)
    elif mode in ("hopeless", "short"):
        engine = ScriptedEngine(rate=lambda p: 1.0)
    else:  # rank 1 filters far more: about 7 of 8 of its groups have zero variance
        engine = ScriptedEngine(rate=lambda p: 0.5 if zlib.crc32(p.encode()) % 8 == 0 else 1.0)
    producer = make_producer(
        engine,
        num_prompts=2000,
        level=2,
        train_batch_size=8,
        gen_batch_size=8,
        world_size=world,
        rank=rank,
        max_num_gen_batches=0 if mode == "skewed" else 5,
        on_exhausted="error" if mode == "hopeless" else "train_on_kept",
    )
    result: dict = {"uids": [], "rounds": [], "sizes": [], "error": None}
    try:
        for step in range(3):
            batch = producer.next_batch(policy_version=step)
            result["sizes"].append(batch.batch_size)
            result["uids"].extend(producer.drawn_uids)
            result["rounds"].append(batch.stats["data/gen_rounds"])
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def _tensor_parallel(rank: int, world: int) -> dict:
    """Both ranks form one engine group (tensor_parallel_size 2): same prompts, same engine
    output (the scripted engine is deterministic), each rank trains on half of the groups."""
    from test_producer import ScriptedEngine, make_producer

    producer = make_producer(
        ScriptedEngine(), num_prompts=64, train_batch_size=8, gen_batch_size=8, world_size=world,
        rank=rank, tp_size=2, max_num_gen_batches=0,
    )  # fmt: skip
    out: dict = {"uids": [], "batches": []}
    for step in range(2):
        batch = producer.next_batch(policy_version=step)
        out["uids"].append(list(producer.drawn_uids))
        out["batches"].append(batch.input_ids.tolist())
    return out


def _sized(rank: int, world: int) -> dict:
    """Predictive selection and rounds sized from the kept fraction (the default) with ranks
    that filter differently: every round's prompt count is agreed over ranks."""
    from test_producer import ScriptedEngine, make_producer

    rate = (lambda p: 0.5) if rank == 0 else (lambda p: 0.5 if zlib.crc32(p.encode()) % 4 else 1.0)
    engine = ScriptedEngine(rate=rate)
    producer = make_producer(
        engine, num_prompts=400, level=2, train_batch_size=8, gen_batch_size=8,
        world_size=world, rank=rank, max_num_gen_batches=0, strategy="predictive",
        round_sizing="kept_frac",
    )  # fmt: skip
    out: dict = {"counts": [], "sizes": []}
    for step in range(4):
        before = len(engine.calls)
        batch = producer.next_batch(policy_version=step)
        out["counts"].append([p for p, _ in engine.calls[before:]])
        out["sizes"].append(batch.batch_size)
    out["estimate"] = list(producer.kept_estimate)
    return out


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {mode: _scenario(rank, world, mode) for mode in ("skewed", "hopeless", "short")}
        out["tp"] = _tensor_parallel(rank, world)
        out["sized"] = _sized(rank, world)
        dist.barrier()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
