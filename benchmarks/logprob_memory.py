"""Peak memory of one forward + backward of ``response_log_probs``: the naive float32-logits path
(``chunk_size=None``) against the fused chunked head (``chunk_size="auto"``), side by side.

Run::

    .venv/bin/python -m benchmarks.logprob_memory            # SmolLM2-135M shape, 4 x 512 tokens
    .venv/bin/python -m benchmarks.logprob_memory --quick    # tiny model (CI smoke, < 60 s)

What is measured: a randomly initialised Qwen2 causal LM of SmolLM2-135M's shape (hidden 576,
30 layers, vocab 49152, tied embeddings; built from the config, no checkpoint on disk), 4 rows of
64 prompt + 448 response tokens, ``loss = -mean(logp) - 0.01 * mean(entropy)`` (the entropy term
only where its gradient is asked), one ``backward``. Each configuration runs in a **fresh
process**; the numbers are its peak RSS (``ru_maxrss``: weights, gradients and activations all
included) and the peak minus the RSS just before the forward (what the forward + backward add).
The gradient norm is printed as an equal-work check (both paths must agree). Seconds are printed
for information only: the cores are shared, so no speed claim is made from them.

Outputs a rich table and ``benchmarks/out/logprob_memory[_quick].png``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks._common import (
    GIB,
    bar_chart,
    bf16_autocast,
    current_rss_bytes,
    emit_result,
    out_dir,
    peak_rss_bytes,
    print_table,
    run_worker,
)
from benchmarks._shared.checkpoints import SMOL_SHAPE

#: The two paths compared: label -> ``response_log_probs(chunk_size=...)``.
PATHS: dict[str, str | None] = {"naive (old)": None, "fused (new)": "auto"}


@dataclass
class Case:
    """One configuration: model shape, tokens, precision and whether the entropy has a gradient."""

    name: str
    shape: str  # "smol" or "tiny"
    rows: int = 4
    prompt_len: int = 64
    response_len: int = 448
    bf16_autocast: bool = False
    gradient_checkpointing: bool = False
    entropy_grad: bool = False


def build_cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("tiny fp32, entropy grad", "tiny", 2, 8, 24, entropy_grad=True)]
    return [
        Case("smol fp32, entropy grad", "smol", entropy_grad=True),
        Case("smol fp32, entropy metric", "smol"),
        Case(
            "smol bf16-mixed gc, entropy metric",
            "smol",
            bf16_autocast=True,
            gradient_checkpointing=True,
        ),
    ]


# ============================================================================ worker side
def _model(shape: str) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_lightning.testing import TINY_CONFIG

    cfg = dict(TINY_CONFIG, vocab_size=1024)
    if shape == "smol":
        cfg.update(SMOL_SHAPE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))  # tied (TINY_CONFIG)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.train()


def worker(case: Case, chunk_size: str | None) -> dict[str, Any]:
    import torch

    from dapo_lightning.logprobs import response_log_probs

    model = _model(case.shape)
    if case.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (case.rows, case.prompt_len + case.response_len), generator=gen)
    mask = torch.ones_like(ids)
    autocast = bf16_autocast(case.bf16_autocast)
    rss_before = current_rss_bytes()
    t = time.perf_counter()
    with autocast:
        logp, ent = response_log_probs(
            model,
            ids,
            mask,
            case.response_len,
            with_entropy=True,
            entropy_grad=case.entropy_grad,
            chunk_size=chunk_size,
        )
        loss = -logp.mean() - (0.01 * ent.mean() if case.entropy_grad else 0.0)
    loss.backward()
    seconds = time.perf_counter() - t
    grad_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )
    return dict(
        peak_rss=peak_rss_bytes(),
        rss_before=rss_before,
        seconds=seconds,
        grad_norm=float(grad_norm),
        mean_logp=float(logp.mean()),
        mean_entropy=float(ent.mean()),
    )


# ============================================================================ parent side
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model for CI (< 60 s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        payload = json.loads(args.worker)
        emit_result(worker(Case(**payload["case"]), payload["chunk_size"]))
        return 0

    rows, labels = [], []
    series: dict[str, list[float]] = {k: [] for k in PATHS}
    for case in build_cases(args.quick):
        results = {}
        for label, chunk_size in PATHS.items():
            results[label] = r = run_worker(
                "benchmarks.logprob_memory",
                {"case": asdict(case), "chunk_size": chunk_size},
                timeout=120 if args.quick else 1800,
                log_name=f"logprob_memory_{case.shape}_{chunk_size or 'naive'}",
            )
            delta = r["peak_rss"] - r["rss_before"]
            rows.append(
                [
                    case.name,
                    label,
                    f"{case.rows}x{case.prompt_len}+{case.response_len}",
                    r["peak_rss"] / GIB,
                    delta / GIB,
                    r["seconds"],
                    r["grad_norm"],
                    r["mean_logp"],
                    r["mean_entropy"],
                ]
            )
            series[label].append(r["peak_rss"] / GIB)
            print(f"  {case.name} [{label}]: peak RSS {r['peak_rss'] / GIB:.2f} GiB", flush=True)
        naive, fused = (results[k] for k in PATHS)
        rows.append(
            [case.name, "fused / naive", "", fused["peak_rss"] / naive["peak_rss"]]
            + [float("nan")] * 5
        )
        labels.append(case.name)
    print_table(
        "One forward + backward of response_log_probs: naive float32 logits vs fused chunked head",
        [
            "case",
            "path",
            "rows x prompt+resp",
            "peak RSS GiB",
            "fwd+bwd RSS delta GiB",
            "s (shared cores)",
            "grad norm",
            "mean logp",
            "mean entropy",
        ],
        rows,
        caption="peak RSS = fresh-process ru_maxrss (imports+weights+grads+activations); delta = "
        "peak minus RSS just before the forward; grad norm / mean logp = equal-work check",
    )
    png = bar_chart(
        out_dir() / ("logprob_memory_quick.png" if args.quick else "logprob_memory.png"),
        "response_log_probs forward+backward: peak RSS (lower is better)",
        labels,
        series,
        ylabel="peak RSS (GiB)",
    )
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
