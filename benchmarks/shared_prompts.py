"""A rollout step's updates with each shared prompt run once, against every row run whole.

``BatchingConfig.share_prompts`` (default on) keeps a group's rows in one micro-batch and runs
each distinct prompt once; its responses then run against the prompt's keys and values
(:func:`dapo_lightning.shared_prompts.shared_prompt_log_probs`). This measures what that buys on the
update side of one rollout step, as :class:`~dapo_lightning.update_loop.UpdateLoop` runs it
(the old-log-prob forward, then one optimizer update per mini-batch: forward, backward, clip,
fused AdamW), with no Trainer.

Run::

    .venv/bin/python -m benchmarks.shared_prompts           # SmolLM2-135M, two shapes (~5 min)
    .venv/bin/python -m benchmarks.shared_prompts --quick   # the tiny model (CI smoke)

Per case: tokens through the model per step (whole rows: ``B * (P + T)`` padded per
micro-batch; shared: ``G * P + B * T``), the median seconds of a rollout step in each layout
(repeats interleaved A B A B in one process, so load changes hit both; the policy keeps
training, the same work either way), their ratio, and the largest difference of the old
log-probs of the same weights in the two layouts. Precision as ``trainer.precision: auto``
picks it on this machine (bf16 autocast where the CPU has bf16, else float32); threads from
``OMP_NUM_THREADS`` (the peer race runs one). Writes ``benchmarks/out/shared_prompts[_quick].png``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import bar_chart, bf16_autocast, out_dir, print_table

#: SmolLM2-135M-Instruct as `make-model` writes it (the recipes' model).
SMOLLM2 = Path("runs/smollm2/model")


@dataclass
class Case:
    """One rollout step's shape: ``groups`` prompts x ``group_size`` responses."""

    name: str
    groups: int
    group_size: int
    prompt_lengths: list[int]
    response_lengths: list[int]
    groups_per_update: int
    micro_batch_size: int


def cases(quick: bool) -> list[Case]:
    rng = random.Random(0)
    if quick:
        return [
            Case("tiny 4 x 4", 4, 4, [9, 5, 12, 7], [rng.randint(2, 12) for _ in range(16)], 2, 8)
        ]
    return [
        # the reasoning-gym recipe: 8 groups x 8, chat prompts of 54-56 tokens (measured on
        # its rows), responses up to its 32-token cap, most short (mean ~13)
        Case(
            "reasoning-gym recipe: 8 x 8, prompts 54..56, responses 3..32",
            8, 8, [rng.randint(54, 56) for _ in range(8)],
            [min(32, 3 + int(29 * rng.random() ** 2)) for _ in range(64)], 2, 16,
        ),
        # responses longer than the prompts (the word-problem recipe's 128-token cap)
        Case(
            "long responses: 4 x 8, prompts 74..85, responses 20..128",
            4, 8, [rng.randint(74, 85) for _ in range(4)],
            [min(128, 20 + int(108 * rng.random() ** 2.5)) for _ in range(32)], 2, 16,
        ),
    ]  # fmt: skip


def make_batch(case: Case, vocab: int) -> Any:
    from dapo_lightning.testing import make_random_rollout_batch

    prompts = [case.prompt_lengths[g] for g in range(case.groups) for _ in range(case.group_size)]
    return make_random_rollout_batch(
        num_groups=case.groups,
        group_size=case.group_size,
        response_lengths=case.response_lengths,
        prompt_lengths=prompts,
        vocab_size=vocab,
        seed=0,
    )


def tokens(batch: Any, micro_batch_size: int, share: bool) -> int:
    """Tokens through the model in one pass over ``batch`` as the loop cuts it."""
    from dapo_lightning.update import micro_batch, micro_batch_rows

    lengths = batch.attention_mask.sum(-1)
    groups = batch.group_index if share else None
    total = 0
    for rows in micro_batch_rows(lengths, micro_batch_size, groups=groups):
        micro = micro_batch(batch, rows)
        if not share:
            total += micro.input_ids.numel()
            continue
        prompts = torch.unique(micro.input_ids[:, : micro.prompt_width], dim=0).shape[0]
        total += prompts * micro.prompt_width + micro.batch_size * micro.response_width
    return total


def make_loop(policy: torch.nn.Module, case: Case, share: bool) -> Any:
    from dapo_lightning.loss import PolicyLossConfig
    from dapo_lightning.schedules import WarmupConstantLR
    from dapo_lightning.strategy import StrategyAdapter
    from dapo_lightning.update import BatchingConfig, OptimizerStepConfig
    from dapo_lightning.update_loop import UpdateLoop

    loop = UpdateLoop(
        PolicyLossConfig(),
        BatchingConfig(case.groups_per_update, case.micro_batch_size, share_prompts=share),
        StrategyAdapter(None),
        OptimizerStepConfig(gradient_clip_val=1.0),
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-5, weight_decay=0.0, fused=True)
    loop.bind(policy, optimizer, WarmupConstantLR(optimizer))
    return loop


def run_case(case: Case, model_dir: str, repeats: int, bf16: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from dapo_lightning.update_loop import StepContext

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    batch = make_batch(case, min(policy.config.vocab_size, 40_000)).trim()
    loops = {share: make_loop(policy, case, share) for share in (False, True)}
    autocast = bf16_autocast(bf16)
    with autocast:  # the same weights, both layouts: the old log-probs (exactness)
        old = {share: loop.old_log_probs(batch) for share, loop in loops.items()}
    mask = batch.response_mask.bool()
    diff = float((old[True] - old[False])[mask].abs().max())
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats + 1):  # the first round warms up
        for share, loop in loops.items():
            t = time.perf_counter()
            with autocast:
                loop.run(batch, StepContext())
            if i:
                times[share].append(time.perf_counter() - t)
    whole, shared = (statistics.median(times[s]) for s in (False, True))
    return {
        "name": case.name,
        "tokens_whole": tokens(batch, case.micro_batch_size, False),
        "tokens_shared": tokens(batch, case.micro_batch_size, True),
        "whole_s": whole,
        "shared_s": shared,
        "ratio": shared / whole,
        "max_abs_diff": diff,
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model (CI smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per layout")
    args = parser.parse_args(argv)
    from benchmarks._shared.checkpoints import checkpoint_for
    from dapo_lightning.precision import decide_bf16, device_caps

    if args.quick:
        model_dir, bf16 = checkpoint_for("tiny"), False
    else:
        if not (SMOLLM2 / "config.json").exists():
            print(f"error: {SMOLLM2} missing: run `make-model smollm2-135m-instruct` first")
            return 2
        model_dir, bf16 = str(SMOLLM2), decide_bf16(device_caps("cpu")).bf16
    repeats = args.repeats or (1 if args.quick else 3)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, bf16 autocast {bf16}, load {os.getloadavg()}")
    results = []
    for case in cases(args.quick):
        results.append(run_case(case, model_dir, repeats, bf16))
        r = results[-1]
        print(
            f"  {r['name']}: whole {r['whole_s']:.2f} s, shared {r['shared_s']:.2f} s", flush=True
        )
    print_table(
        "One rollout step's updates: every row whole vs each shared prompt once",
        ["case", "tokens whole", "tokens shared", "whole s", "shared s", "shared / whole",
         "max |old logp diff|", "load"],
        [[r["name"], r["tokens_whole"], r["tokens_shared"], r["whole_s"], r["shared_s"],
          r["ratio"], r["max_abs_diff"], r["load"]] for r in results],
        caption="median of interleaved rollout steps in one process (old log-probs + the "
        "mini-batch updates, fused AdamW, clip 1.0); logp diff: the same weights, both layouts",
    )  # fmt: skip
    png = bar_chart(
        out_dir() / ("shared_prompts_quick.png" if args.quick else "shared_prompts.png"),
        "A rollout step's updates: whole rows vs shared prompts (seconds, lower is better)",
        [r["name"].split(":")[0] for r in results],
        {"whole rows": [r["whole_s"] for r in results],
         "shared prompts": [r["shared_s"] for r in results]},
        ylabel="seconds (median)",
    )  # fmt: skip
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
