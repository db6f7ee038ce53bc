"""Measurements taken from inside a running fit: per-thread CPU time, torch threads, CPU
affinity, RSS, and a per-rollout-step profile (generation, scoring, weight push, old log-probs,
update).

:class:`StepProbe` is a Lightning callback; a benchmark adds it to a real ``dapo-lightning fit``
run in-process (:func:`run_cli_with_probe`) and reads the JSON records it writes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from benchmarks._common import current_rss_bytes, peak_rss_bytes

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by thread id.

    Read from ``/proc/self/task/<tid>/stat`` fields 14 and 15 (``utime``, ``stime``, in clock
    ticks); threads that end while being read are skipped.
    """
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return out


def thread_use(
    before: dict[int, float], after: dict[int, float], wall: float, share: float = 0.25
) -> dict[str, float]:
    """How many threads did the work of an interval and how much CPU it took.

    ``cpu_s = sum_t (after_t - before_t)``; ``busiest`` = the largest per-thread delta;
    ``active`` = threads with a delta ``>= share * busiest`` (compute threads of one OpenMP pool
    do about equal work; helper threads that only wait do not count); ``cores = cpu_s / wall``
    (below ``active`` when other processes share the cores).
    """
    deltas = [after[t] - before.get(t, 0.0) for t in after]
    busiest = max(deltas, default=0.0)
    cpu = sum(deltas)
    active = sum(d >= share * busiest for d in deltas) if busiest > 0 else 0
    return {"cpu_s": cpu, "busiest_s": busiest, "active": float(active), "cores": cpu / wall}


def thread_state() -> dict[str, Any]:
    """Torch's intra-op threads, whether ``torch.set_num_threads`` is torch's own, the CPU
    affinity of this process and ``OMP_NUM_THREADS``."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "set_num_threads_is_torch": getattr(torch.set_num_threads, "__module__", "")
        in ("torch", "torch._C"),
        "affinity": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


class RssSampler:
    """Largest RSS seen by a background thread sampling every ``every`` seconds, per label.

    ``label`` is switched by the caller (e.g. ``"generation"`` / ``"update"``) so each phase's
    peak is known; :func:`~benchmarks._common.peak_rss_bytes` gives the process-wide peak.
    """

    def __init__(self, every: float = 0.02) -> None:
        self.label = "start"
        self.peaks: dict[str, int] = {}
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, label = current_rss_bytes(), self.label
            if rss > self.peaks.get(label, 0):
                self.peaks[label] = rss
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class StepProbe(Callback):
    """Per rollout step of a DAPO fit: where the wall time went and how many threads worked.

    Each step appends one JSON record to ``out_path`` with: ``fetch_s`` (from the end of the
    previous step to this one's start: weight push, generation rounds, scoring, shaping),
    ``gen_s`` / ``score_s`` (the module's ``time/generation_s``, ``data/score_seconds``),
    ``push_s`` (the engine session's pushes during the fetch), ``old_logp_s`` (the separate
    old-log-prob forward, 0 when skipped), ``update_s`` (``training_step`` minus
    ``old_logp_s``), the thread state and thread use during ``training_step``
    (:func:`thread_use`), RSS now and peaks per phase. Validation steps are not recorded.
    """

    def __init__(self, out_path: str | os.PathLike[str]) -> None:
        self.out_path = Path(out_path)
        self.sampler = RssSampler()
        self._t_end: float | None = None
        self._push_total = 0.0
        self._old_s = 0.0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        loop = pl_module.updater  # the update loop's old-log-prob pass (update_loop.py)
        original = loop.old_log_probs

        def timed_old_log_probs(batch: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(batch)
            finally:
                self._old_s += time.perf_counter() - start

        loop.old_log_probs = timed_old_log_probs
        self._t_end = time.perf_counter()
        self.sampler.label = "generation"

    def _session(self, trainer: Any) -> Any:
        return getattr(getattr(trainer, "datamodule", None), "session", None)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        now = time.perf_counter()
        session = self._session(trainer)
        total = getattr(session, "push_seconds_total", 0.0)
        self._fetch = now - (self._t_end or now)
        self._push = total - self._push_total
        self._push_total = total
        self._old_s = 0.0
        self.sampler.label = "update"
        self._cpu0 = thread_cpu_seconds()
        self._t0 = now

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, out: Any, batch: Any, i: int
    ) -> None:
        now = time.perf_counter()
        wall = now - self._t0
        use = thread_use(self._cpu0, thread_cpu_seconds(), wall)
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        engine = getattr(self._session(trainer), "_engine", None)
        record = {
            "step": i,
            "global_step": trainer.global_step,
            "fetch_s": self._fetch,
            "gen_s": m.get("time/generation_s", float("nan")),
            "score_s": m.get("data/score_seconds", float("nan")),
            "gen_rounds": m.get("data/gen_rounds", float("nan")),
            "generated_tokens": m.get("data/generated_tokens", float("nan")),
            "push_s": self._push,
            "old_logp_s": self._old_s,
            "update_s": wall - self._old_s,
            "step_s": wall,
            "updates": m.get("update/micro_batches", float("nan")),
            "engine": type(engine).__name__ if engine is not None else None,
            "rss_gib": current_rss_bytes() / 2**30,
            "peak_rss_gib": peak_rss_bytes() / 2**30,
            "phase_peak_gib": {k: v / 2**30 for k, v in self.sampler.peaks.items()},
            **thread_state(),
            **{f"update_{k}": v for k, v in use.items()},
        }
        with open(self.out_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.sampler.label = "generation"
        self._t_end = time.perf_counter()


def run_cli_with_probe(args: list[str], out_path: str | os.PathLike[str]) -> None:
    """Run ``dapo-lightning <args>`` in this process with a :class:`StepProbe` appended to the
    trainer's callbacks (records go to ``out_path``)."""
    from dapo_lightning import cli

    probe = StepProbe(out_path)
    original = cli.DAPOLightningCLI.instantiate_trainer

    def instantiate_trainer(self: Any, **kwargs: Any) -> Any:
        trainer = original(self, **kwargs)
        trainer.callbacks.append(probe)
        return trainer

    cli.DAPOLightningCLI.instantiate_trainer = instantiate_trainer  # type: ignore[method-assign]
    try:
        cli.main(args)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    finally:
        cli.DAPOLightningCLI.instantiate_trainer = original  # type: ignore[method-assign]
        probe.sampler.stop()
