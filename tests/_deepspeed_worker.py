"""Raw DeepSpeed ZeRO-2 engine on CPU (gloo): one update over a mini-batch split into
micro-batches the way DAPOModule does it must equal the single-micro-batch update.

Lightning's DeepSpeedStrategy refuses CPU accelerators, so this drives the engine directly
with the module's own pieces (micro_batch_rows, compute_policy_loss, deepspeed_backward).
Usage: python tests/_deepspeed_worker.py CKPT OUT MICRO
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning.advantages import compute_advantages
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.policy_loss import compute_policy_loss
from dapo_lightning.strategy import deepspeed_backward
from dapo_lightning.update import micro_batch_rows
from tests._module_harness import fixed_batch


def main(ckpt: str, out: str, micro: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},  # torch SGD (no fused CPU kernel)
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
    )  # fmt: skip
    batch = fixed_batch()
    adv = compute_advantages(batch.reward, batch.group_index)
    n_tokens = float(batch.response_mask.sum())
    chunks = micro_batch_rows(batch.attention_mask.sum(-1), max_rows=micro)
    for i, rows in enumerate(chunks):
        mb = batch.select(rows).trim()
        logp, _ = response_log_probs(engine, mb.input_ids, mb.attention_mask, mb.response_width)
        loss, _ = compute_policy_loss(
            logp, logp.detach(), adv[rows], mb.response_mask, global_token_count=n_tokens
        )
        deepspeed_backward(engine, loss, last=i == len(chunks) - 1)
        engine.step()
    delta = {k: v.detach() - before[k] for k, v in engine.module.named_parameters()}
    torch.save(delta, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
