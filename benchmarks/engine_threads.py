"""Does an in-process vLLM engine take cores from the update? The same DAPO update timed in a
process without an engine and in one with a vLLM engine built (and sampled from) first, side by
side; then the threads of a real ``dapo-lightning fit`` with the vLLM engine, read during its
updates.

Run::

    .venv/bin/python -m benchmarks.engine_threads            # A/B rounds + a quickstart_vllm fit
    .venv/bin/python -m benchmarks.engine_threads --quick    # CI smoke sizes (< 2 min)
    .venv/bin/python -m benchmarks.engine_threads --skip-fit

What is measured:

* **A/B update** (fresh process per run, ``--rounds`` runs of each, alternating A B A B so a
  change of load hits both): ``Trainer.fit`` of ``DAPOModule`` on a fixed batch of the
  SmolLM2-135M shape (random weights, bf16 autocast), ``warmup`` untimed then ``repeats`` timed
  updates. B first builds ``VLLMRolloutEngine`` on the tiny checkpoint (float32, in process,
  as the data module does) and samples one batch from it; what vLLM changes is process-wide
  (torch threads, ``torch.set_num_threads``, OpenMP environment, CPU affinity), so the tiny
  engine shows it at a small memory cost. Reported: median s/update of each (pooled over
  rounds) and their ratio, ``torch.get_num_threads()``, ``os.sched_getaffinity(0)``, and the
  threads that did the update's work (per-thread CPU seconds from ``/proc/self/task``, see
  :func:`benchmarks._probe.thread_use`).
* **Fit**: ``dapo-lightning fit --config configs/quickstart.yaml --config
  configs/quickstart_vllm.yaml`` for a few updates with :class:`benchmarks._probe.StepProbe`
  appended; each rollout step records the torch threads, affinity and thread use during its
  ``training_step``.

Outputs a table and ``benchmarks/out/engine_threads[_quick].png``; raw numbers in
``benchmarks/out/engine_threads[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import bar_chart, emit_result, out_dir, print_table, run_worker


# ============================================================================ worker side
def worker_update(p: dict[str, Any]) -> dict[str, Any]:
    """One process: (optionally) a vLLM engine first, then ``warmup + repeats`` timed updates."""
    import torch
    from lightning.pytorch import Callback, LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from benchmarks._probe import thread_cpu_seconds, thread_state, thread_use
    from dapo_lightning.module import DAPOModule
    from dapo_lightning.testing import make_random_rollout_batch
    from dapo_lightning.update import BatchingConfig

    torch.set_num_threads(p["threads"])
    result: dict[str, Any] = {"before_engine": thread_state()}
    engine = None
    if p["engine"]:
        from dapo_lightning.rollout import SamplingConfig, create_engine

        t = time.perf_counter()
        engine = create_engine(
            "vllm", model_path=p["tiny_ckpt"], dtype="float32", kv_cache_space_gb=1, seed=0
        )
        engine.generate([[5, 6, 7, 8]] * 4, 4, SamplingConfig(max_tokens=16))
        result["engine_start_s"] = time.perf_counter() - t
    result["at_update"] = thread_state()
    batch = make_random_rollout_batch(
        num_groups=1,
        group_size=p["seqs"],
        response_lengths=[p["response"]],
        prompt_lengths=[p["prompt"]],
        vocab_size=259,
        seed=0,
    )
    steps = p["warmup"] + p["repeats"]

    class Fixed(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader([batch] * steps, batch_size=None)

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.uses: list[dict[str, float]] = []

        def on_train_batch_start(self, trainer, pl_module, b, i) -> None:  # noqa: ANN001
            self._cpu = thread_cpu_seconds()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, out, b, i) -> None:  # noqa: ANN001
            wall = time.perf_counter() - self._t
            self.times.append(wall)
            self.uses.append(thread_use(self._cpu, thread_cpu_seconds(), wall))

    module = DAPOModule(
        p["smol_ckpt"],
        batching=BatchingConfig(mini_batch_size=None, micro_batch_size=p["micro"]),
        parity_check_every=0,
    )
    timer = Timer()
    Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    ).fit(module, datamodule=Fixed())
    result.update(
        times=timer.times[p["warmup"] :],
        uses=timer.uses[p["warmup"] :],
        after_update=thread_state(),
        load=os.getloadavg(),
    )
    del engine
    return result


def worker_fit(p: dict[str, Any]) -> dict[str, Any]:
    """The quickstart with the vLLM engine for ``p["max_steps"]`` updates, probed."""
    import torch

    from benchmarks._probe import run_cli_with_probe, thread_state

    torch.set_num_threads(p["threads"])
    before = thread_state()
    root = Path(p["root"])
    records = root / "probe.jsonl"
    args = [
        "fit",
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/quickstart_vllm.yaml",
        # the warmed-up quickstart model, written once under benchmarks/out/ and reused
        "--create_model_if_missing.path",
        p["model"],
        "--model.model_name_or_path",
        p["model"],
        "--trainer.default_root_dir",
        str(root),
        "--trainer.logger.init_args.save_dir",
        str(root),
        "--trainer.max_steps",
        str(p["max_steps"]),
        "--trainer.val_check_interval",
        "1000",
    ]
    run_cli_with_probe(args, records)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    return {"before": before, "steps": rows, "load": os.getloadavg()}


def worker_main(payload: dict[str, Any]) -> None:
    kind = payload.pop("kind")
    emit_result(worker_update(payload) if kind == "update" else worker_fit(payload))


# ============================================================================ parent side
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke sizes")
    parser.add_argument("--rounds", type=int, default=None, help="A/B runs of each (default 2)")
    parser.add_argument("--skip-fit", action="store_true", help="no quickstart_vllm fit probe")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0

    import torch

    from benchmarks._shared.checkpoints import checkpoint_for

    threads = torch.get_num_threads()
    quick = args.quick
    rounds = args.rounds or (1 if quick else 2)
    base = dict(
        kind="update",
        threads=threads,
        seqs=2,
        prompt=16 if quick else 32,
        response=48 if quick else 64,
        micro=2,
        warmup=1,
        repeats=1 if quick else 2,
        smol_ckpt=checkpoint_for("tiny" if quick else "smol"),
        tiny_ckpt=checkpoint_for("tiny"),
    )
    print(f"load average at start: {os.getloadavg()}", flush=True)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for r in range(rounds):
        for engine in (False, True):
            t0 = time.perf_counter()
            res = run_worker(
                "benchmarks.engine_threads",
                base | {"engine": engine},
                timeout=1800,
                log_name=f"engine_threads{'_quick' if quick else ''}_{int(engine)}_{r}",
            )
            runs[engine].append(res)
            print(
                f"  round {r} engine={engine}: median {statistics.median(res['times']):.2f} s "
                f"(worker {time.perf_counter() - t0:.0f} s, load {res['load'][0]:.1f})",
                flush=True,
            )

    def summary(engine: bool) -> dict[str, Any]:
        rs = runs[engine]
        times = [t for r in rs for t in r["times"]]
        uses = [u for r in rs for u in r["uses"]]
        return {
            "median_s": statistics.median(times),
            "times": times,
            "torch_threads": sorted({r["at_update"]["torch_threads"] for r in rs}),
            "affinity": rs[0]["at_update"]["affinity"],
            "set_num_threads_is_torch": all(
                r["after_update"]["set_num_threads_is_torch"] for r in rs
            ),
            "active": statistics.median(u["active"] for u in uses),
            "cores": statistics.median(u["cores"] for u in uses),
            "engine_start_s": [r.get("engine_start_s") for r in rs],
        }

    a, b = summary(False), summary(True)
    rows = [
        [
            label,
            s["median_s"],
            len(s["times"]),
            str(s["torch_threads"]),
            str(s["affinity"]),
            s["active"],
            s["cores"],
            str(s["set_num_threads_is_torch"]),
        ]
        for label, s in (("no engine", a), ("vLLM engine in process", b))
    ]
    rows.append(
        [
            "engine / no engine",
            b["median_s"] / a["median_s"],
            "",
            "",
            "",
            float("nan"),
            b["cores"] / a["cores"],
            "",
        ]
    )
    shape = f"{base['seqs']} x ({base['prompt']} + {base['response']}), micro {base['micro']}"
    print_table(
        f"Same update with / without a vLLM engine in the process ({shape}, bf16 autocast)",
        [
            "process",
            "s / update (median)",
            "updates",
            "torch threads",
            "affinity",
            "active threads",
            "cores used",
            "set_num_threads is torch's",
        ],
        rows,
        caption="active threads: threads with >= 25% of the busiest thread's CPU time during the "
        "update; cores used: CPU seconds of all threads / wall seconds (below the active threads "
        "when other processes share the cores)",
    )
    result: dict[str, Any] = {"no_engine": a, "engine": b, "ratio": b["median_s"] / a["median_s"]}

    if not args.skip_fit:
        with tempfile.TemporaryDirectory(prefix="engine_threads_fit_") as root:
            fit = run_worker(
                "benchmarks.engine_threads",
                {
                    "kind": "fit",
                    "threads": threads,
                    "root": root,
                    "max_steps": 2 if quick else 4,
                    "model": str(out_dir() / "quickstart_model"),
                },
                timeout=1800,
                log_name=f"engine_threads{'_quick' if quick else ''}_fit",
            )
        result["fit"] = fit
        print_table(
            "dapo-lightning fit (quickstart + quickstart_vllm): threads during each update",
            [
                "rollout step",
                "engine",
                "torch threads",
                "affinity",
                "set_num_threads is torch's",
                "active threads",
                "cores used",
                "update s",
            ],
            [
                [
                    s["step"],
                    str(s["engine"]),
                    s["torch_threads"],
                    str(s["affinity"]),
                    str(s["set_num_threads_is_torch"]),
                    s["update_active"],
                    s["update_cores"],
                    s["step_s"],
                ]
                for s in fit["steps"]
            ],
            caption=f"before the fit: {fit['before']}",
        )

    suffix = "_quick" if quick else ""
    (out_dir() / f"engine_threads{suffix}.json").write_text(json.dumps(result, indent=1))
    png = bar_chart(
        out_dir() / f"engine_threads{suffix}.png",
        "Same DAPO update with / without an in-process vLLM engine (s / update, lower is better)",
        ["update"],
        {"no engine": [a["median_s"]], "vLLM engine in process": [b["median_s"]]},
        ylabel="seconds per update (median)",
    )
    print(f"load average at end: {os.getloadavg()}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
