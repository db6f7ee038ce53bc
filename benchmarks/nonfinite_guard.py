"""Cost of the non-finite update guard (:mod:`dapo_lightning.step_guard`) per optimizer step.

    .venv/bin/python -m benchmarks.nonfinite_guard            # quickstart + SmolLM2-135M shapes

For each model shape (random weights, float32, every weight trainable) it times, side by side in
one process (medians of repeats): the AdamW step itself, the guard's pre-step snapshot
(``StepSnapshot.take``: a copy of the parameters and of AdamW's two moments into reused buffers),
its after-check (``all_finite``: the extremes of every parameter; on a CPU ``aminmax`` per
tensor) beside the fused ``_foreach_norm(ord=inf)`` check it replaced on a CPU (the baseline,
timed in the same process) and, for scale, one forward + backward of 8 x 128 tokens. The
guard's memory is one more copy of the trainable parameters and their optimizer state
(printed). Writes ``benchmarks/out/nonfinite_guard.png``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from benchmarks._common import bar_chart, median_time, out_dir, print_table
from benchmarks._shared.checkpoints import SMOL_SHAPE
from dapo_lightning.step_guard import StepSnapshot, all_finite
from dapo_lightning.testing import TINY_CONFIG

#: The quickstart's model (0.3M parameters; dapo_lightning.testing's tiny Qwen2).
TINY_SHAPE: dict[str, Any] = {**TINY_CONFIG, "vocab_size": 259}


def _model(shape: dict[str, Any]) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = {"tie_word_embeddings": True, **shape}
    return Qwen2ForCausalLM(Qwen2Config(**config)).float()


def _inf_norm_check(params: list[torch.Tensor]) -> bool:
    """The baseline: ``max_i ||p_i||_inf`` in one ``_foreach_norm`` call (the check before
    2026-12-07; a fused kernel on CUDA, a loop of slow per-tensor norms on a CPU)."""
    norms = torch._foreach_norm([p.detach() for p in params], math.inf)
    return bool(torch.isfinite(torch.stack(norms)).all())


def measure(shape: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds per step of each part (see the module docstring) and the guard's bytes."""
    model = _model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, shape["vocab_size"], (8, 128))

    def fwd_bwd() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    fwd_bwd()
    opt.step()  # creates the moments, so the snapshot copies them too
    snap = StepSnapshot()
    params = [p for p in model.parameters() if p.requires_grad]
    out = {
        "params_M": sum(p.numel() for p in params) / 1e6,
        "fwd_bwd_s": median_time(fwd_bwd, repeats=repeats)[0],
        "adamw_step_s": median_time(opt.step, repeats=repeats)[0],
        "snapshot_s": median_time(lambda: snap.take(opt), repeats=repeats)[0],
        "check_s": median_time(lambda: all_finite(params), repeats=repeats)[0],
        "inf_norm_check_s": median_time(lambda: _inf_norm_check(params), repeats=repeats)[0],
    }
    out["guard_MiB"] = 3 * sum(p.numel() * p.element_size() for p in params) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny-only", action="store_true", help="skip the SmolLM2 shape")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = {"quickstart (0.3M)": TINY_SHAPE}
    if not args.tiny_only:
        shapes["SmolLM2-135M shape"] = SMOL_SHAPE
    results = {name: measure(shape, args.repeats) for name, shape in shapes.items()}
    rows = []
    for name, r in results.items():
        guard = r["snapshot_s"] + r["check_s"]
        rows.append(
            [
                name,
                r["params_M"],
                r["fwd_bwd_s"] * 1e3,
                r["adamw_step_s"] * 1e3,
                r["snapshot_s"] * 1e3,
                r["check_s"] * 1e3,
                r["inf_norm_check_s"] * 1e3,
                r["inf_norm_check_s"] / r["check_s"],
                guard / r["adamw_step_s"],
                r["guard_MiB"],
            ]
        )
    print_table(
        "Non-finite update guard, per optimizer step (float32, CPU, medians)",
        [
            "model",
            "params (M)",
            "fwd+bwd 8x128 (ms)",
            "AdamW step (ms)",
            "snapshot (ms)",
            "check (ms)",
            "inf-norm check (ms)",
            "inf-norm / check",
            "guard / step",
            "guard memory (MiB)",
        ],
        rows,
    )
    path = bar_chart(
        out_dir() / "nonfinite_guard.png",
        "Non-finite guard cost per step",
        list(results),
        {
            "AdamW step": [r["adamw_step_s"] * 1e3 for r in results.values()],
            "snapshot": [r["snapshot_s"] * 1e3 for r in results.values()],
            "check": [r["check_s"] * 1e3 for r in results.values()],
            "inf-norm check (before)": [r["inf_norm_check_s"] * 1e3 for r in results.values()],
        },
        ylabel="ms",
        log_y=True,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
