"""Throughput and peak memory of ONE DAPO optimizer update: our ``DAPOModule`` (driven by a real
``lightning.Trainer``) against TRL's ``GRPOTrainer`` (``loss_type="dapo"``), side by side.

Run::

    .venv/bin/python -m benchmarks.update_throughput            # default run (< 10 min, 2 cores)
    .venv/bin/python -m benchmarks.update_throughput --quick    # CI smoke sizes (< 60 s)
    .venv/bin/python -m benchmarks.update_throughput --full     # + 64 x 512-token SmolLM2-135M-shaped
                                                                #   update, ours only (~10+ min)

What is compared (equal work, no generation):

* The same checkpoint, the same RolloutBatch of completions (token ids, lengths), the same
  group-relative advantages, the same micro-batch size (TRL: ``per_device_train_batch_size`` x
  ``gradient_accumulation_steps`` = sequences), one AdamW step (lr 1e-6, wd 0.01, non-fused, clip
  1.0), the same precision (``32-true`` or bf16 autocast with float32 weights on both) and the same
  gradient checkpointing (non-reentrant). Both skip the separate old-log-prob forward (one update
  per batch: the old log-probs are the detached current ones).
* Ours: ``Trainer.fit`` on a data module that serves the fixed batch; each ``training_step`` is one
  update; a callback times ``on_train_batch_start`` -> ``on_train_batch_end``.
* TRL: ``GRPOTrainer`` with ``_prepare_inputs`` overridden to return our pre-built inputs
  (``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask``,
  ``advantages``, ``num_items_in_batch``; no ``old_per_token_logps`` since TRL itself skips it in
  this setting) and the Trainer's inner loop written out: ``training_step`` per micro-batch, then
  ``clip_grad_norm_``, ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``.
* Differences that are the frameworks' own behaviour and are kept: TRL pads every micro-batch to
  the longest sequence of the whole batch and takes rows in order; ours sorts rows by length and
  trims each micro-batch. TRL's fused LM head scores every position in chunks (never
  materialising ``[B, T, V]`` logits); ours materialises float32 logits for the response positions.

Numbers: median of repeats (seconds per update), response tokens / s, peak RSS of a *fresh
process per configuration* (imports, weights, AdamW state and activations all included: what the
OS must provide), and MFU against this run's measured GEMM peak (see ``roofline.py``). Each
configuration also reports the first update's gradient norm (before clipping) as an equal-work
check. Outputs a rich table and ``benchmarks/out/update_throughput[_quick].png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import (
    GIB,
    bar_chart,
    current_rss_bytes,
    emit_result,
    out_dir,
    peak_rss_bytes,
    print_table,
    run_worker,
)
from benchmarks._shared.checkpoints import checkpoint_for


@dataclass
class Case:
    """One benchmark configuration (run in a fresh process per implementation).

    Attributes:
        name: Label in the table.
        model: ``"tiny"`` (the test checkpoint) or ``"smol"`` (SmolLM2-135M shape, random weights).
        num_groups / group_size: Prompts and responses per prompt; sequences = their product.
        prompt_len: Prompt tokens of every sequence (equal, so no position-id ambiguity).
        response_lengths: Response tokens per sequence (cycled).
        micro_batch_size: Sequences per forward/backward (TRL: per_device_train_batch_size).
        precision: ``"32-true"`` or ``"bf16-mixed"`` (autocast, float32 weights) on both sides.
        gradient_checkpointing: Recompute activations in backward (both sides).
        warmup / repeats: Untimed and timed updates.
        impls: Which implementations run (``"dapo"`` ours, ``"trl"``).
        profile: Profile one extra (untimed) update after the timed ones, on both sides (top ops
            by self CPU time; peak RSS is read before it, so the profiler's memory is not counted).
        extras: Ours only: also measure the rollout-step shares, profile one update and count
            policy forwards (single update vs two mini-batches).
    """

    name: str
    model: str
    num_groups: int
    group_size: int
    prompt_len: int
    response_lengths: list[int]
    micro_batch_size: int
    precision: str = "32-true"
    gradient_checkpointing: bool = False
    warmup: int = 1
    repeats: int = 3
    impls: tuple[str, ...] = ("dapo", "trl")
    extras: bool = False
    profile: bool = False
    timeout: float = 600.0
    ckpt: str = field(default="", repr=False)

    @property
    def num_sequences(self) -> int:
        return self.num_groups * self.group_size

    def lengths(self) -> list[int]:
        r = self.response_lengths
        return [r[i % len(r)] for i in range(self.num_sequences)]


def variable_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Long-tailed response lengths in ``[lo, hi]`` (most short, a few near ``hi``), fixed seed."""
    rng = random.Random(seed)
    return [min(hi, max(lo, int(lo + (hi - lo) * rng.random() ** 3))) for _ in range(n)]


def build_cases(quick: bool, full: bool, full_sequences: int = 64) -> list[Case]:
    if quick:
        return [
            Case(
                "tiny fp32 var-len",
                "tiny",
                2,
                4,
                8,
                variable_lengths(8, 2, 12),
                4,
                warmup=0,
                repeats=1,
                extras=True,
                timeout=120,
            ),
        ]
    cases = [
        Case("tiny fp32 uniform", "tiny", 8, 8, 32, [96], 8, extras=True),
        Case("tiny fp32 var-len", "tiny", 8, 8, 32, variable_lengths(64, 4, 224), 8),
        Case(
            "smol bf16 gc 2x512",
            "smol",
            1,
            2,
            64,
            [448],
            1,
            precision="bf16-mixed",
            gradient_checkpointing=True,
            warmup=0,
            repeats=2,
            profile=True,
        ),
    ]
    if full:
        cases.append(
            Case(
                f"smol bf16 gc {full_sequences}x512",
                "smol",
                max(1, full_sequences // 8),
                min(8, full_sequences),
                64,
                [448],
                4,
                precision="bf16-mixed",
                gradient_checkpointing=True,
                warmup=0,
                repeats=1,
                timeout=7200,
            )
        )
    return cases


# ============================================================================ worker side
def _make_batch(case: Case) -> Any:
    from dapo_lightning.testing import make_random_rollout_batch

    vocab = 259  # token ids the tiny tokenizer knows; valid for the larger vocab too
    return make_random_rollout_batch(
        num_groups=case.num_groups,
        group_size=case.group_size,
        response_lengths=case.lengths(),
        prompt_lengths=[case.prompt_len],
        vocab_size=vocab,
        seed=0,
    )


def _cpu_profiler() -> Any:
    """The profiler of one update, ours and TRL's alike: CPU ops with their input shapes."""
    import torch

    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    )


def _profile_summary(prof: Any, path: Path) -> dict[str, Any]:
    """Top ops by self CPU time and the share spent in GEMMs."""
    events = prof.key_averages()
    path.write_text(events.table(sort_by="self_cpu_time_total", row_limit=30))
    by_shape = prof.key_averages(group_by_input_shape=True)  # which tensors the top ops touch
    path.with_name(path.stem + "_shapes.txt").write_text(
        by_shape.table(sort_by="self_cpu_time_total", row_limit=40)
    )
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    gemm_ops = (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::linear",
        "aten::matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    gemm = sum(e.self_cpu_time_total for e in events if e.key in gemm_ops)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "gemm_share": gemm / total,
        "top": [(e.key, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / total) for e in top],
        "table": str(path),
    }


def print_profile(name: str, prof: dict[str, Any]) -> None:
    """The top ops of one profiled update (:func:`_profile_summary`) as a table."""
    print_table(
        f"Profile of one update ({name}): top ops by self CPU time "
        f"(GEMM/attention share {prof['gemm_share']:.0%})",
        ["op", "self CPU ms", "share"],
        [list(t) for t in prof["top"]],
        caption=f"full table: {prof['table']}",
    )


def worker_dapo(case: Case) -> dict[str, Any]:
    import torch
    from dapo_lightning.callbacks import DAPOCallback
    from lightning.pytorch import LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from dapo_lightning.module import DAPOModule
    from dapo_lightning.update import BatchingConfig
    from dapo_lightning.weights import full_named_tensors

    torch.manual_seed(0)
    batch = _make_batch(case)
    rss_start = current_rss_bytes()
    profile = case.extras or case.profile
    steps = case.warmup + case.repeats + (1 if profile else 0)

    class Fixed(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader([batch] * steps, batch_size=None)

    class Timer(DAPOCallback):  # DAPO hooks (on_dapo_update) reach DAPOCallback subclasses
        def __init__(self, profile_step: int | None = None) -> None:
            self.profile_step = profile_step
            self.times: list[float] = []
            self.forwards: list[int] = []
            self.grad_norms: list[float] = []
            self.rss_before_update = 0
            self.peak_before_profile = 0
            self.prof: Any = None
            self._n = 0

        def on_train_batch_start(self, trainer, pl_module, b, i) -> None:  # noqa: ANN001
            if i == 0:
                self.rss_before_update = current_rss_bytes()
            self._n = 0
            if i == self.profile_step:  # the profiler's own memory stays out of peak_rss
                self.peak_before_profile = peak_rss_bytes()
                self.prof = _cpu_profiler()
                self.prof.__enter__()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, out, b, i) -> None:  # noqa: ANN001
            dt = time.perf_counter() - self._t
            if i == self.profile_step:
                self.prof.__exit__(None, None, None)
            else:
                self.times.append(dt)
            self.forwards.append(self._n)

        def on_dapo_update(self, trainer, pl_module, metrics) -> None:  # noqa: ANN001
            self.grad_norms.append(float(metrics["grad_norm"]))

        def count(self, *_: Any) -> None:
            self._n += 1

    module = DAPOModule(
        case.ckpt,
        batching=BatchingConfig(mini_batch_size=None, micro_batch_size=case.micro_batch_size),
        gradient_checkpointing=case.gradient_checkpointing,
        torch_dtype="float32",
        parity_check_every=0,
    )
    module.configure_model()
    timer = Timer(steps - 1 if profile else None)
    module.policy.register_forward_pre_hook(timer.count)
    result: dict[str, Any] = {}
    _start_progress_thread(lambda: f"forwards in current update {timer._n}")

    if case.extras:
        # Shares of a rollout step: generate responses of this batch's shape with the HF engine
        # (which shares the policy), push weights to it (a no-op by design for the HF engine).
        from transformers import AutoTokenizer

        from dapo_lightning.rollout import HFRolloutEngine, SamplingConfig

        tok = AutoTokenizer.from_pretrained(case.ckpt)
        engine = HFRolloutEngine(module.policy, tok, seed=0)
        prompts = [
            batch.input_ids[
                g * case.group_size, batch.prompt_width - case.prompt_len : batch.prompt_width
            ].tolist()
            for g in range(case.num_groups)
        ]
        max_tokens = max(case.lengths())
        t = time.perf_counter()
        completions = engine.generate(
            prompts, n=case.group_size, sampling=SamplingConfig(max_tokens=max_tokens)
        )
        result["gen_seconds"] = time.perf_counter() - t
        result["gen_tokens"] = sum(len(c.token_ids) for g in completions for c in g)
        t = time.perf_counter()
        engine.load_weights(full_named_tensors(module.policy))  # what EngineSession pushes
        result["push_seconds"] = time.perf_counter() - t
        module.policy.train()
        timer._n = 0

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        precision=case.precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=Fixed())
    timed = timer.times[case.warmup :]
    result.update(
        seconds=statistics.median(timed),
        times=timed,
        peak_rss=timer.peak_before_profile or peak_rss_bytes(),
        rss_start=rss_start,
        rss_before_update=timer.rss_before_update,
        grad_norm=timer.grad_norms[0],
        forwards_per_update=timer.forwards[0],
    )
    if profile and timer.prof is not None:
        result["profile"] = _profile_summary(
            timer.prof, out_dir() / f"profile_{_slug(case.name)}.txt"
        )
    if case.extras:
        # Redundant-forward check: the same batch in two mini-batches (two updates) needs the
        # separate old-log-prob pass; a single update must not do it.
        from dapo_lightning.update import micro_batch_rows

        lengths = batch.attention_mask.sum(-1)
        result["micro_batches"] = len(micro_batch_rows(lengths, case.micro_batch_size))
        module2 = DAPOModule(
            case.ckpt,
            batching=BatchingConfig(max(1, case.num_groups // 2), case.micro_batch_size),
            parity_check_every=0,
        )
        module2.configure_model()
        counter = Timer()
        module2.policy.register_forward_pre_hook(counter.count)
        steps_saved = steps
        steps = 1
        Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[counter],
        ).fit(module2, datamodule=Fixed())
        steps = steps_saved
        result["forwards_two_minibatches"] = counter.forwards[0]
    return result


def _start_progress_thread(status: Any, every: float = 30.0) -> None:
    """Print elapsed time, peak RSS and ``status()`` every ``every`` seconds (long runs)."""
    import threading

    start = time.perf_counter()

    def loop() -> None:
        while True:
            time.sleep(every)
            print(
                f"[progress] {time.perf_counter() - start:.0f} s, peak RSS "
                f"{peak_rss_bytes() / GIB:.2f} GiB, {status()}",
                flush=True,
            )

    threading.Thread(target=loop, daemon=True).start()


def worker_trl(case: Case) -> dict[str, Any]:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from dapo_lightning.advantages import compute_advantages

    torch.manual_seed(0)
    batch = _make_batch(case)
    rss_start = current_rss_bytes()
    B, micro = case.num_sequences, case.micro_batch_size
    if B % micro:
        raise ValueError(f"micro_batch_size={micro} must divide {B} sequences for TRL.")
    accum = B // micro
    model = AutoModelForCausalLM.from_pretrained(case.ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(case.ckpt)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"),
        use_cpu=True,
        report_to=[],
        bf16=case.precision == "bf16-mixed",
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        num_generations=case.group_size,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_iterations=1,
        max_completion_length=max(case.lengths()),
        gradient_checkpointing=case.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        learning_rate=1e-6,
        weight_decay=0.01,
        optim="adamw_torch",
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )

    class FixedInputs(GRPOTrainer):
        # No generation: the inputs are already the prepared completions of one micro-batch.
        def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
            return inputs

    trainer = FixedInputs(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * B}),
        processing_class=tok,
    )
    model = trainer.model
    if case.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    trainer.current_gradient_accumulation_steps = accum
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler

    P = batch.prompt_width
    advantages = compute_advantages(batch.reward, batch.group_index, "grpo")
    completion_mask = batch.attention_mask[:, P:]
    num_items = completion_mask.sum()
    micro_inputs = [
        {
            "prompt_ids": batch.input_ids[s, :P],
            "prompt_mask": batch.attention_mask[s, :P],
            "completion_ids": batch.input_ids[s, P:],
            "completion_mask": completion_mask[s],
            "advantages": advantages[s],
            "num_items_in_batch": num_items,
        }
        for s in (slice(i, i + micro) for i in range(0, B, micro))
    ]
    grad_norms: list[float] = []
    _start_progress_thread(lambda: f"updates done {len(grad_norms)}")

    def update() -> None:
        for inputs in micro_inputs:
            trainer.training_step(model, inputs, num_items)
        norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norms.append(float(norm))
        optimizer.step()
        scheduler.step()
        model.zero_grad(set_to_none=True)

    rss_before = current_rss_bytes()
    times = []
    for k in range(case.warmup + case.repeats):
        t = time.perf_counter()
        update()
        if k >= case.warmup:
            times.append(time.perf_counter() - t)
    result = dict(
        seconds=statistics.median(times),
        times=times,
        peak_rss=peak_rss_bytes(),
        rss_start=rss_start,
        rss_before_update=rss_before,
        grad_norm=grad_norms[0],
    )
    if case.profile:  # one more update, after the peak was read
        with _cpu_profiler() as prof:
            update()
        result["profile"] = _profile_summary(
            prof, out_dir() / f"profile_{_slug(case.name)}_trl.txt"
        )
    return result


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def worker_main(payload: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(payload.get("threads", torch.get_num_threads()))
    impl = payload.pop("impl")
    payload.pop("threads", None)
    payload["impls"] = tuple(payload["impls"])
    case = Case(**payload)
    result = worker_dapo(case) if impl == "dapo" else worker_trl(case)
    emit_result(result)


# ============================================================================ parent side


def padded_tokens(case: Case) -> dict[str, int]:
    """Tokens each framework computes (padding included) for the case's batch."""
    import torch

    from dapo_lightning.update import micro_batch_rows

    lengths = case.lengths()
    ours = 0
    for rows in micro_batch_rows(torch.tensor(lengths), case.micro_batch_size):
        ours += len(rows) * (case.prompt_len + max(lengths[i] for i in rows))
    trl = case.num_sequences * (case.prompt_len + max(lengths))
    real = case.num_sequences * case.prompt_len + sum(lengths)
    return {"real": real, "dapo": ours, "trl": trl}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for CI (< 60 s)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="add the 64 x 512-token SmolLM2-135M-shaped update (~3 min each side on idle cores)",
    )
    parser.add_argument("--only-full", action="store_true", help="run only the --full case")
    parser.add_argument(
        "--full-sequences",
        type=int,
        default=64,
        help="sequences of the --full case (64; a multiple of 8, or fewer than 8)",
    )
    parser.add_argument("--skip-trl", action="store_true", help="run our module only")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) for every worker, ours and TRL alike: "
        "allocations this large get their own pages, returned to the OS when freed",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _measure_case(case: Case, args: argparse.Namespace, threads: int) -> dict[str, dict[str, Any]]:
    """Each implementation's worker result for ``case`` (TRL left out with ``--skip-trl``)."""
    results: dict[str, dict[str, Any]] = {}
    for impl in case.impls:
        if impl == "trl" and args.skip_trl:
            continue
        payload = asdict(case) | {"impl": impl, "threads": threads}
        t0 = time.perf_counter()
        results[impl] = run_worker(
            "benchmarks.update_throughput",
            payload,
            timeout=case.timeout,
            log_name=f"update{'_quick' if args.quick else ''}_{_slug(case.name)}_{impl}",
        )
        print(
            f"  {case.name} [{impl}]: {results[impl]['seconds']:.2f} s/update "
            f"(worker {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return results


def _case_rows(
    case: Case,
    results: dict[str, dict[str, Any]],
    pads: dict[str, int],
    resp_tokens: int,
    flops: float,
    peak: float,
) -> list[list[Any]]:
    """The table's rows of ``case``: one per implementation, then TRL's time and memory over ours."""
    from benchmarks._shared.flops import mfu

    rows: list[list[Any]] = []
    for impl, r in results.items():
        rows.append(
            [
                case.name,
                "ours" if impl == "dapo" else "trl",
                f"{case.num_sequences}x{case.prompt_len}+{max(case.lengths())}",
                case.micro_batch_size,
                r["seconds"],
                resp_tokens / r["seconds"],
                pads[impl] / pads["real"],
                r["peak_rss"] / GIB,
                (r["peak_rss"] - r["rss_before_update"]) / GIB,
                mfu(flops, r["seconds"], peak),
                r["grad_norm"],
            ]
        )
    if "dapo" in results and "trl" in results:
        rows.append(
            [
                case.name,
                "trl / ours time",
                "",
                "",
                results["trl"]["seconds"] / results["dapo"]["seconds"],
                float("nan"),
                float("nan"),
                results["trl"]["peak_rss"] / results["dapo"]["peak_rss"],
                float("nan"),
                float("nan"),
                float("nan"),
            ]
        )
    return rows


def _print_update_table(rows: list[list[Any]]) -> None:
    print_table(
        "One DAPO optimizer update (median of repeats)",
        [
            "case",
            "impl",
            "seqs x prompt+resp",
            "micro",
            "s / update",
            "resp tok/s",
            "computed / real tok",
            "peak RSS GiB",
            "RSS delta GiB",
            "MFU",
            "grad norm",
        ],
        rows,
        caption="peak RSS = fresh-process ru_maxrss (imports+weights+optimizer+activations); "
        "RSS delta = peak minus RSS just before the first update; MFU = (6ND + 12LHQSD) / s / "
        "GEMM peak; grad norm = first update, before clipping (equal-work check)",
    )


def _print_extras(extras: dict[str, Any], profiles: dict[str, Any]) -> None:
    """The extras case's phase shares and forward counts, then every profile."""
    for name, r in extras.items():
        gen, push = r["gen_seconds"], r["push_seconds"]
        upd = r["seconds"]
        total = gen + push + upd
        print_table(
            f"Rollout step shares ({name}, HF engine, generation of the same shape)",
            ["phase", "seconds", "share"],
            [
                ["generation (HFRolloutEngine)", gen, gen / total],
                ["weight push (HF engine: no-op)", push, push / total],
                ["update (DAPOModule)", upd, upd / total],
            ],
        )
        print_table(
            f"Redundant-forward check ({name})",
            ["setting", "policy forwards per training_step"],
            [
                [
                    f"single update (mini_batch_size=None), {r['micro_batches']} micro-batches",
                    r["forwards_per_update"],
                ],
                ["two mini-batches (old log-probs needed)", r["forwards_two_minibatches"]],
            ],
        )
        prof = r.get("profile")
        if prof:
            print_profile(name, prof)
    for name, prof in profiles.items():
        print_profile(name, prof)


def _set_mmap_threshold(threshold: int | None) -> None:
    """``MALLOC_MMAP_THRESHOLD_`` for every worker (when given); the load and the setting printed."""
    if threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    print(
        f"load average at start: {os.getloadavg()}; MALLOC_MMAP_THRESHOLD_="
        f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc dynamic)')}",
        flush=True,
    )


def _gemm_peaks(cases: list[Case], quick: bool) -> dict[str, float]:
    """The GEMM peak (FLOP/s) of each precision the cases use, printed."""
    from benchmarks._shared.flops import peak_flops

    peaks = {
        p: peak_flops("bfloat16" if p == "bf16-mixed" else "float32", quick=quick)
        for p in {c.precision for c in cases}
    }
    print(
        "GEMM peak this run: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
    )
    return peaks


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0

    import torch

    from benchmarks._shared.flops import update_model_flops

    _set_mmap_threshold(args.mmap_threshold)
    cases = build_cases(args.quick, args.full or args.only_full, args.full_sequences)
    if args.only_full:
        cases = cases[-1:]
    peaks = _gemm_peaks(cases, args.quick)

    rows, labels, tps = [], [], {"dapo (ours)": [], "trl GRPOTrainer": []}
    extras: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    for case in cases:
        case.ckpt = checkpoint_for(case.model)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(case.ckpt)
        pads = padded_tokens(case)
        resp_tokens = sum(case.lengths())
        seq_len = pads["real"] / case.num_sequences
        flops = update_model_flops(config, case.num_sequences, round(seq_len))
        # --quick: one thread per worker (robust to a loaded CI machine; numbers not meaningful).
        threads = 1 if args.quick else torch.get_num_threads()
        results = _measure_case(case, args, threads)
        rows += _case_rows(case, results, pads, resp_tokens, flops, peaks[case.precision])
        labels.append(case.name)
        for impl, key in (("dapo", "dapo (ours)"), ("trl", "trl GRPOTrainer")):
            r = results.get(impl)
            tps[key].append(resp_tokens / r["seconds"] if r else float("nan"))
        if case.extras:
            extras[case.name] = results["dapo"]
        for impl, r in results.items():
            if r.get("profile") and not (case.extras and impl == "dapo"):
                profiles[f"{case.name}, {'ours' if impl == 'dapo' else 'TRL'}"] = r["profile"]

    _print_update_table(rows)
    _print_extras(extras, profiles)
    png = bar_chart(
        out_dir() / ("update_throughput_quick.png" if args.quick else "update_throughput.png"),
        "One DAPO update: response tokens / s (higher is better)",
        labels,
        tps,
        ylabel="response tokens / s",
        log_y=not args.quick,
    )
    print(f"load average at end: {os.getloadavg()}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
