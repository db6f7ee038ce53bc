"""Two real gloo ranks (spawned processes): disjoint prompts, lockstep rounds, no deadlock."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _dist_data_worker import run

from dapo_lightning.testing import free_port


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_ranks_disjoint_prompts_lockstep_and_shared_errors(tmp_path):
    mp.spawn(run, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))

    s0, s1 = r0["skewed"], r1["skewed"]
    assert s0["error"] is None and s1["error"] is None, (s0["error"], s1["error"])
    assert s0["sizes"] == s1["sizes"] == [16, 16, 16]  # full batches of 4 groups of 4
    # both ranks are in their first epoch (1000 prompts each): the prompts are disjoint
    assert len(s1["uids"]) < 1000
    assert not set(s0["uids"]) & set(s1["uids"])
    # rank 1 filtered far more and needed more rounds; rank 0 waited in the collectives
    assert sum(s1["rounds"]) > sum(s0["rounds"])

    h0, h1 = r0["hopeless"], r1["hopeless"]
    assert h1["error"] and "DynamicSamplingError" in h1["error"]
    # rank 0 was full, yet it stopped with the same error instead of hanging in a collective
    assert h0["error"] and "DynamicSamplingError" in h0["error"]
    assert "1 of 2 ranks short" in h0["error"]

    # on_exhausted="train_on_kept" (the default): the short rank trains on what it kept (nothing
    # here) and both ranks go on together, round for round
    k0, k1 = r0["short"], r1["short"]
    assert k0["error"] is None and k1["error"] is None, (k0["error"], k1["error"])
    assert k0["sizes"] == [16, 16, 16] and k1["sizes"] == [0, 0, 0]
    assert k0["rounds"] == [1.0, 1.0, 1.0] and k1["rounds"] == [5.0, 5.0, 5.0]

    # tensor_parallel_size 2: one engine group of both ranks draws one set of prompts; each
    # rank trains on its own half of the group's 8 groups
    t0, t1 = r0["tp"], r1["tp"]
    assert t0["uids"] == t1["uids"] and len(t0["uids"][0]) >= 8
    for b0, b1 in zip(t0["batches"], t1["batches"]):
        assert len(b0) == len(b1) == 4 * 4  # 4 groups of n=4 each
        assert not {tuple(r) for r in b0} & {tuple(r) for r in b1}

    # rounds sized from the kept fraction: one estimate and one prompt count per round on both
    # ranks (a full rank draws nothing, so its counts are a prefix of the short rank's)
    z0, z1 = r0["sized"], r1["sized"]
    assert z0["estimate"] == z1["estimate"] and z0["sizes"] == z1["sizes"] == [16] * 4
    for c0, c1 in zip(z0["counts"], z1["counts"]):
        short, full = (c0, c1) if len(c0) >= len(c1) else (c1, c0)
        assert full == short[: len(full)], (c0, c1)
    assert any(c0 != [4] for c0 in z0["counts"] + z1["counts"])  # sized, not gen_batch_size
