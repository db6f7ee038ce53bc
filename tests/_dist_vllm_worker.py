"""One rank of the 2-process gloo job in test_rollout_vllm.py, launched with RANK/WORLD_SIZE in
the environment (torch.distributed.run style) or with SLURM's variables only (srun style).

Each rank runs its own vLLM engine with ``external_launcher``, pushes a perturbed copy of the
weights (same on both ranks), samples, and records its seed, samples and parity gap.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.rollout import SamplingConfig, VLLMRolloutEngine, full_named_tensors


def main(checkpoint: str, out_path: str) -> None:
    import os

    if "RANK" in os.environ:  # torch.distributed.run style
        dist.init_process_group("gloo")
    else:  # SLURM style (srun, Lightning's SLURMEnvironment): no RANK in the environment
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        assert "RANK" not in os.environ
    tp = int(os.environ.get("TP_SIZE", "1"))  # 2: both ranks are one tensor-parallel engine
    engine = VLLMRolloutEngine(checkpoint, dtype="float32", seed=0, tensor_parallel_size=tp)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine.load_weights(full_named_tensors(model))
    prompt = [2, 60, 61, 62]
    out = engine.generate([prompt], 4, SamplingConfig(max_tokens=12))[0]
    gap = 0.0
    with torch.no_grad():
        for c in out:
            ids = torch.tensor([prompt + c.token_ids])
            logp, _ = response_log_probs(model, ids, torch.ones_like(ids), len(c.token_ids))
            gap = max(gap, (logp[0] - torch.tensor(c.log_probs)).abs().max().item())
    torch.save(
        {
            "seed": engine.seed,
            "distributed": engine.distributed,
            "tokens": [c.token_ids for c in out],
            "gap": gap,
        },
        out_path,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
