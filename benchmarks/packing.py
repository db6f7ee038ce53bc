"""Padding-free micro-batches: is packing worth it against today's sorted padding?

Today (``dapo_lightning.update.micro_batch_rows`` + ``micro_batch``) rows are sorted by length
and cut into micro-batches of ``micro`` rows, each trimmed to its longest row (left-padded
prompts, right-padded responses). Packing concatenates the same rows of a micro-batch into one
row of their real tokens; ``position_ids`` restart at 0 for each sequence and no attention
mask is passed, so Hugging Face models build the block-diagonal causal mask themselves
(``masking_utils.find_packed_sequence_indices``; SDPA on CPU). The response log-probs come from
the same fused head (:func:`dapo_lightning.linear_log_probs.fused_linear_log_probs`) on the hidden
states before each response token.

Run::

    .venv/bin/python -m benchmarks.packing            # tiny var-len + SmolLM2-shape recipe lengths
    .venv/bin/python -m benchmarks.packing --quick

For each case: tokens computed (padded / real), median seconds of forward + backward of the
whole batch (sum of the response log-probs, every micro-batch), interleaved A B A B in one
process so load changes hit both, the ratio, and the largest difference of the log-probs
between the layouts (exactness). Writes ``benchmarks/out/packing[_quick].png``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._common import bar_chart, bf16_autocast, out_dir, print_table


def recipe_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and response lengths shaped like the SmolLM2 word-problem recipe: prompts 74-85
    tokens; responses long-tailed in 20..128 (a few hit the 128-token cap)."""
    rng = random.Random(seed)
    prompts = [rng.randint(74, 85) for _ in range(n)]
    responses = [
        min(128, int(20 + 108 * rng.random() ** 2.5) + (rng.random() < 0.08) * 128)
        for _ in range(n)
    ]
    return prompts, responses


def long_tail_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``update_throughput.variable_lengths``: most short, a few near ``hi``."""
    rng = random.Random(seed)
    return [min(hi, max(lo, int(lo + (hi - lo) * rng.random() ** 3))) for _ in range(n)]


def padded_log_probs(model: nn.Module, batch: Any, rows: list[int]) -> tuple[Tensor, Tensor]:
    """Today's path: the trimmed micro-batch through ``response_log_probs``; returns the
    response log-probs ``[B, T]`` and the response mask."""
    from dapo_lightning.logprobs import response_log_probs
    from dapo_lightning.update import micro_batch

    micro = micro_batch(batch, rows)
    logp, _ = response_log_probs(model, micro.input_ids, micro.attention_mask, micro.response_width)
    return logp, micro.response_mask


def pack_rows(batch: Any, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """One packed row of the real tokens of ``rows``: ``input_ids [1, L]``, ``position_ids
    [1, L]`` (restarting at 0 per sequence), the index in the row of the position *before* each
    response token (where its logits come from), and the response length of each row.

    With ``P`` the padded prompt width, sequence ``r`` contributes its prompt tokens
    ``input_ids[r, P - p_r : P]`` and its response ``input_ids[r, P : P + t_r]``.
    """
    P = batch.prompt_width
    ids, pos, where, lens = [], [], [], []
    offset = 0
    for r in rows:
        p = int(batch.attention_mask[r, :P].sum())
        t = int(batch.response_mask[r].sum())
        seq = batch.input_ids[r, P - p : P + t]
        ids.append(seq)
        pos.append(torch.arange(p + t))
        where.append(torch.arange(offset + p - 1, offset + p + t - 1))
        lens.append(t)
        offset += p + t
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(where), lens


def packed_log_probs(model: nn.Module, batch: Any, rows: list[int]) -> Tensor:
    """Response log-probs of ``rows`` from one packed row (flat, rows in order)."""
    from dapo_lightning.linear_log_probs import fused_linear_log_probs
    from dapo_lightning.logprobs import output_head

    ids, pos, where, _ = pack_rows(batch, rows)
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    targets = ids[0, where + 1]
    logp, _ = fused_linear_log_probs(hidden[0, where], output_head(model).weight, targets)
    return logp


def run_case(name: str, model: nn.Module, batch: Any, micro: int, repeats: int) -> dict[str, Any]:
    """Time forward + backward of every micro-batch in both layouts, interleaved."""
    from dapo_lightning.update import micro_batch, micro_batch_rows

    lengths = batch.attention_mask.sum(-1)
    chunks = micro_batch_rows(lengths, micro)
    real = int(lengths.sum())
    # trimmed micro-batch = rows x (longest prompt + longest response)
    padded = sum(micro_batch(batch, c).input_ids.numel() for c in chunks)

    def padded_pass() -> list[Tensor]:
        out = []
        for rows in chunks:
            logp, mask = padded_log_probs(model, batch, rows)
            (logp * mask).sum().backward()
            out.append(logp.detach()[mask.bool()])
        return out

    def packed_pass() -> list[Tensor]:
        out = []
        for rows in chunks:
            logp = packed_log_probs(model, batch, rows)
            logp.sum().backward()
            out.append(logp.detach())
        return out

    # exactness first (also the warm-up): the same numbers row by row
    a, b = padded_pass(), packed_pass()
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for _ in range(repeats):
        for label, fn in (("padded", padded_pass), ("packed", packed_pass)):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "name": name,
        "rows": batch.batch_size,
        "micro": micro,
        "padded_over_real": padded / real,
        "padded_s": med["padded"],
        "packed_s": med["packed"],
        "packed_over_padded": med["packed"] / med["padded"],
        "max_abs_diff": diff,
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for CI")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--skip-smol", action="store_true", help="tiny model only")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from benchmarks._shared.checkpoints import checkpoint_for
    from dapo_lightning.testing import make_random_rollout_batch

    repeats = args.repeats or (1 if args.quick else 3)
    torch.manual_seed(0)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    cases = []
    n = 16 if args.quick else 64
    cases.append(
        (
            f"tiny fp32, {n} x (32 + 4..224 long tail), micro 8",
            "tiny",
            make_random_rollout_batch(
                num_groups=n // 8,
                group_size=8,
                response_lengths=long_tail_lengths(n, 4, 224),
                prompt_lengths=[32],
                seed=0,
            ),
            8,
            torch.float32,
        )
    )
    if not (args.quick or args.skip_smol):
        prompts, responses = recipe_lengths(32)
        cases.append(
            (
                "SmolLM2 shape bf16 + grad ckpt, 32 x (74..85 + 20..128), micro 16 (recipe)",
                "smol",
                make_random_rollout_batch(
                    num_groups=4,
                    group_size=8,
                    response_lengths=responses,
                    prompt_lengths=prompts,
                    seed=0,
                ),
                16,
                torch.bfloat16,
            )
        )
    results = []
    for name, kind, batch, micro, dtype in cases:
        model = AutoModelForCausalLM.from_pretrained(checkpoint_for(kind), dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        if kind == "smol":  # as the recipe's lowmem settings; packed rows' masks are L x L
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        with bf16_autocast(dtype == torch.bfloat16):
            results.append(run_case(name, model, batch, micro, repeats))
        r = results[-1]
        print(
            f"  {name}: padded {r['padded_s']:.3f} s, packed {r['packed_s']:.3f} s "
            f"(load {r['load']:.1f})",
            flush=True,
        )
    print_table(
        "Sorted padding (today) vs packing (position ids, block-diagonal SDPA), fwd + bwd",
        [
            "case",
            "padded / real tokens",
            "padded s",
            "packed s",
            "packed / padded time",
            "max |logp diff|",
            "load",
        ],
        [
            [
                r["name"],
                r["padded_over_real"],
                r["padded_s"],
                r["packed_s"],
                r["packed_over_padded"],
                r["max_abs_diff"],
                r["load"],
            ]
            for r in results
        ],
        caption="median of interleaved repeats in one process; logp diff: the same response "
        "tokens in both layouts",
    )
    png = bar_chart(
        out_dir() / ("packing_quick.png" if args.quick else "packing.png"),
        "fwd + bwd of one batch: sorted padding vs packing (seconds, lower is better)",
        [r["name"].split(",")[0] for r in results],
        {
            "sorted padding": [r["padded_s"] for r in results],
            "packed": [r["packed_s"] for r in results],
        },
        ylabel="seconds (median)",
    )
    print(f"load average at end: {os.getloadavg()}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
