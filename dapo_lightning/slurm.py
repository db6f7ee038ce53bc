"""What a run does differently under SLURM (docs/cluster.md, "Tested under SLURM").

* **The requeue signal** (``--signal=USR1@90``, ``scancel --signal=USR1``): Lightning's
  ``SLURMEnvironment`` saves ``hpc_ckpt_<n>.ckpt`` inside its signal handler, wherever the
  signal lands: in the middle of an update, and on several ranks as a collective save that meets
  whatever collective the other ranks are in. Here the signal is a stop request like SIGTERM
  (:func:`requeue_signal` says which signal, :mod:`dapo_lightning.interrupt` records it): the
  ranks stop together at the next clean point, :class:`~dapo_lightning.callbacks.RunGuard`
  saves ``last.ckpt``, then global rank 0 runs ``scontrol requeue`` (:func:`requeue_job`) and the
  command exits with 138 (128 + SIGUSR1). The requeued job's ``--ckpt_path auto`` resumes there.
  Outside ``srun`` (or without ``auto_requeue``) SIGUSR1 is a plain stop request, like every
  stop signal (:data:`~dapo_lightning.interrupt.STOP_SIGNALS`): saved, exit 138, no requeue.
* **Task counts**: under ``srun`` the tasks are the ranks; :func:`check_task_count` refuses a
  ``trainer.devices x trainer.num_nodes`` that disagrees, before anything is built.
* **Job arrays**: :func:`array_task_run` gives each task of ``sbatch --array`` its own seed and
  run directory (``--seed_per_array_task``, which ``slurm/dapo.sbatch`` passes).
* **Outside SLURM**: on a machine with SLURM's client tools, Lightning warns on every
  ``Trainer`` built outside ``srun`` ("The `srun` command is available on your system but is not
  used"), also for a local run that has nothing to do with SLURM. :func:`replace_srun_hint`
  says it once in our words, and only inside a SLURM job (where a missing ``srun`` is the likely
  mistake).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

from dapo_lightning.checks import ConfigError
from dapo_lightning.lightning_internals import cluster_environment, replace_srun_check, srun_used


def requeue_signal(trainer: Any) -> signal.Signals | None:
    """The signal on which Lightning would save and requeue this fit (SIGUSR1 by default), or
    None when the fit does not run under ``srun`` with ``auto_requeue``."""
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def job_id() -> str | None:
    """This job's id for ``scontrol`` (``<array job>_<task>`` in a job array), or None."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array is not None:
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job() -> str:
    """Run ``scontrol requeue`` for this job; returns what happened, as a line to print."""
    job = job_id()
    if job is None:
        return "not requeued: SLURM_JOB_ID is not set."
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"requeueing SLURM job {job} failed ({err}); resubmit the same command."
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip() or f"exit {proc.returncode}"
        return f"requeueing SLURM job {job} failed ({why}); resubmit the same command."
    return f"Requeued SLURM job {job}: it resumes from the checkpoint with --ckpt_path auto."


def check_task_count(devices: Any, num_nodes: Any) -> None:
    """Under ``srun`` (``SLURM_NTASKS`` set and SLURM's job name not ``bash`` / ``interactive``),
    raise :class:`ConfigError` when ``devices x num_nodes`` is not the job step's task count.

    Only counts are checked (``auto``, ``-1`` and device lists are Lightning's to resolve).
    Task 0 raises the error; the other tasks exit 2 without a word (one line per job)."""
    devices, num_nodes = _count(devices), _count(num_nodes)
    if not srun_used() or devices is None or num_nodes is None:
        return
    tasks = int(os.environ["SLURM_NTASKS"])
    if devices * num_nodes != tasks:
        if os.environ.get("SLURM_PROCID", "0") != "0":
            raise SystemExit(2)
        raise ConfigError(
            f"trainer.devices {devices} x trainer.num_nodes {num_nodes} = "
            f"{devices * num_nodes} ranks, but this SLURM job step has {tasks} tasks "
            f"(SLURM_NTASKS): under srun every task is one rank. Fix: give sbatch "
            f"--nodes={num_nodes} --ntasks-per-node={devices}, or leave trainer.devices and "
            "trainer.num_nodes to slurm/dapo.sbatch (it passes SLURM's counts)."
        )


def _count(value: Any) -> int | None:
    """A positive count given as an int or a string of digits (``devices: "2"``), else None."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def array_task_run(root: str | None) -> tuple[int, str] | None:
    """In a job array task (``SLURM_ARRAY_TASK_ID``): its seed (the task id) and run directory
    (``<root>/seed_<id>``, root default ``.``); None outside a job array."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    return int(task), os.path.join(root or ".", f"seed_{task}")


def replace_srun_hint() -> None:
    """Replace Lightning's srun hint (see the module docstring): nothing outside a SLURM job,
    one line inside a job that did not start the process with ``srun``."""
    replace_srun_check(_srun_hint)


_hinted = False


def _srun_hint() -> None:
    global _hinted
    if _hinted or "SLURM_JOB_ID" not in os.environ or srun_used():
        return
    _hinted = True
    print(
        f"note: this process runs inside SLURM job {os.environ['SLURM_JOB_ID']} but was not "
        "started by srun: it trains as one process (slurm/dapo.sbatch starts one per task).",
        file=sys.stderr,
    )
