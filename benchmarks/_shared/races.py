"""The peer race's shared pieces: the recipe both sides read, the budget's snapshots, TRL's
clock callback, reward and settings (``benchmarks.peer_race``, ``benchmarks.peer_race_tools``)."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import REPO_ROOT, config_callbacks, peak_rss_bytes
from benchmarks._shared.smollm2 import RECIPES, process_cpu_s

RECIPE = RECIPES["reasoning_gym"]


@dataclass
class Recipe:
    """The settings both sides take from ``configs/smollm2_reasoning_gym.yaml``."""

    lr: float
    weight_decay: float
    fused: bool
    start_factor: float
    end_factor: float
    total_iters: int
    grad_clip: float
    group_size: int
    groups_per_step: int
    groups_per_update: int
    max_tokens: int
    temperature: float
    overlong_buffer: int
    task_kwargs: dict[str, Any]
    answer_format: str
    val_n: int
    val_temperature: float
    engine_kwargs: dict[str, Any]

    @classmethod
    def load(cls, path: str = RECIPE, task: dict[str, Any] | None = None) -> Recipe:
        """The settings of the recipe at ``path`` (relative to the repository); ``task``
        (``--task-kwargs``) replaces keys of its ``task_kwargs`` (e.g. another reasoning-gym
        ``dataset`` and ``config``). A recipe without an ``lr_scheduler`` has the module's
        default schedule, constant when it does not warm up (a warm-up is refused here)."""
        cfg = yaml.safe_load((REPO_ROOT / path).read_text())
        model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
        optim, ds = model["optimizer"]["init_args"], data["dynamic_sampling"]
        constant = {"start_factor": 1.0, "end_factor": 1.0, "total_iters": 1}
        sched = model["lr_scheduler"]["init_args"] if "lr_scheduler" in model else constant
        warmup = int(model["optimizer_step"].get("warmup_steps", 0))
        if "lr_scheduler" not in model and warmup:
            raise ValueError(f"{path} warms up over {warmup} updates: Recipe reads no warm-up.")
        overlong = next(c for c in config_callbacks([path]) if "Overlong" in c["class_path"])
        return cls(
            lr=float(optim["lr"]),
            weight_decay=float(optim["weight_decay"]),
            fused=bool(optim.get("fused", False)),
            start_factor=float(sched["start_factor"]),
            end_factor=float(sched["end_factor"]),
            total_iters=int(sched["total_iters"]),
            grad_clip=float(model["optimizer_step"]["gradient_clip_val"]),
            group_size=int(ds["n"]),
            groups_per_step=int(ds["train_batch_size"]),
            groups_per_update=int(model["batching"]["mini_batch_size"]),
            max_tokens=int(data["sampling"]["max_tokens"]),
            temperature=float(data["sampling"]["temperature"]),
            overlong_buffer=int(overlong["init_args"]["buffer_length"]),
            task_kwargs={**data["prompts"]["task_kwargs"], **(task or {})},
            answer_format=data["scoring"]["reward_kwargs"]["answer_format"],
            val_n=int(data["validation"]["n"]),
            val_temperature=float(data["validation"]["temperature"]),
            engine_kwargs=dict(data["engine_kwargs"]),
        )

    def rows(self, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(training, held-out)`` rows, as ``dapo-lightning fit --seed_everything seed``
        builds them."""
        from dapo_lightning.tasks.reasoning_gym import make_reasoning_gym_rows

        rows = make_reasoning_gym_rows(seed=seed, **self.task_kwargs)
        return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "val"]


class Snapshots:
    """Saves the policy at every ``every_s`` of the budget clock and at the end, and says when
    the budget is spent. One row per snapshot in ``run_dir/snapshots.jsonl``: ``{"updates",
    "train_s", "train_cpu_s", "dir"}`` (and ``"samples"`` when given a counter); at the end ``run_dir/process.json`` (peak RSS, CPU
    seconds of live child processes)."""

    def __init__(self, run_dir: str, budget_s: float, every_s: float, clock: str, cores: int,
                 samples: Callable[[], float] | None = None) -> None:  # fmt: skip
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}.")
        self.run_dir = Path(run_dir)
        self.budget_s, self.every_s = float(budget_s), float(every_s)
        self.clock, self.cores = clock, max(1, int(cores))
        self.next_mark = self.every_s
        self.saved_updates = 0
        self.samples = samples  # samples generated so far, recorded with each snapshot
        self.t0, self.cpu0 = time.time(), process_cpu_s()

    def start(self) -> None:
        """Start both clocks (at the first update's start)."""
        self.t0, self.cpu0 = time.time(), process_cpu_s()

    def elapsed(self) -> tuple[float, float, float]:
        """``(wall s, CPU s, budget-clock s)`` since :meth:`start`."""
        wall, cpu = time.time() - self.t0, process_cpu_s() - self.cpu0
        return wall, cpu, wall if self.clock == "wall" else cpu / self.cores

    def after_update(self, updates: int, model: Any) -> bool:
        """Save at a passed mark; True once the budget is spent (the caller stops)."""
        *_, spent = self.elapsed()
        if spent >= min(self.next_mark, self.budget_s):
            self.save(updates, model)
            self.next_mark = (math.floor(spent / self.every_s) + 1) * self.every_s
        return spent >= self.budget_s

    def finish(self, updates: int, model: Any) -> None:
        """The final snapshot (unless the last update is saved already) and ``process.json``."""
        if updates != self.saved_updates:
            self.save(updates, model)
        import psutil

        children = psutil.Process().children(recursive=True)
        child_cpu = sum(sum(c.cpu_times()[:2]) for c in children if c.is_running())
        info = {"peak_rss": peak_rss_bytes(), "worker_cpu_s": child_cpu}
        (self.run_dir / "process.json").write_text(json.dumps(info))

    def save(self, updates: int, model: Any) -> None:  # noqa: D102
        wall, cpu, _ = self.elapsed()
        folder = self.run_dir / "snapshots" / f"update{updates:05d}"
        model.save_pretrained(folder)
        row = {"updates": updates, "train_s": wall, "train_cpu_s": cpu, "dir": str(folder)}
        if self.samples is not None:
            row["samples"] = self.samples()
        with open(self.run_dir / "snapshots.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        self.saved_updates = updates


def trl_clock(snapshots: Snapshots, model: Any, phases: dict[str, float] | None = None) -> Any:
    """:class:`Snapshots` in a TRL ``Trainer`` (a ``TrainerCallback``): the clocks start with
    training, a snapshot at each passed mark (stopping once the budget is spent), the last at
    the end; with ``phases``, each optimizer step's wall seconds are added to ``step_s``."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            snapshots.start()

        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if phases is not None:
                phases["step_s"] += time.perf_counter() - self.t
            if snapshots.after_update(state.global_step, model):
                control.should_training_stop = True

        def on_train_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            snapshots.finish(state.global_step, model)

    return Clock()


class ReasoningGymScore:
    """The reasoning-gym score of each completion, as a TRL reward function (the rows'
    ``answer`` and ``rg_entry`` columns come as keyword arguments)."""

    __name__ = "reasoning_gym"

    def __init__(self, answer_format: str) -> None:
        from dapo_lightning.tasks.reasoning_gym import ReasoningGymReward

        self.reward = ReasoningGymReward(answer_format=answer_format)

    def __call__(self, completions: list[Any], answer: list[str], rg_entry: list[str],
                 **kwargs: Any) -> list[float]:  # fmt: skip
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        entries = [json.loads(e) for e in rg_entry]
        return [r.score for r in self.reward(texts, answer, rg_entry=entries)]


def trl_config(recipe: Recipe, run_dir: Path, seed: int, args: argparse.Namespace) -> Any:
    """TRL's documented DAPO settings with the recipe's batch, schedule and precision."""
    from trl import GRPOConfig

    from dapo_lightning.precision import decide_bf16, device_caps

    vllm = args.trl_generation == "vllm"
    return GRPOConfig(
        output_dir=str(run_dir / "trl"),
        seed=seed,
        use_cpu=True,
        bf16=decide_bf16(device_caps("cpu")).bf16,  # as precision: auto
        gradient_checkpointing=False,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        mask_truncated_completions=True,
        beta=0.0,
        num_generations=recipe.group_size,
        per_device_train_batch_size=recipe.groups_per_update * recipe.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=recipe.groups_per_step // recipe.groups_per_update,
        num_iterations=1,
        max_completion_length=recipe.max_tokens,
        temperature=recipe.temperature,
        top_p=1.0,
        top_k=0,
        max_grad_norm=recipe.grad_clip,
        max_steps=args.max_updates or 100_000,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=recipe.engine_kwargs.get("max_model_len"),
    )
