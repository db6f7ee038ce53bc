"""A real one-node SLURM cluster for the ``slurm`` tests (tests/test_slurm_cluster.py).

:func:`start_cluster` runs ``scripts/local_slurm.sh start`` (the same cluster docs/cluster.md
tells a user to try a job script on: munged, slurmctld and slurmd on this machine, config and
state in a folder of its own, free ports); :meth:`SlurmCluster.stop` stops the daemons by their
PIDs. :class:`SlurmCluster` wraps the client commands the tests use (``sbatch``, ``scancel``,
``scontrol``), each with a timeout: a job that cannot start (more tasks than cores without
``--overcommit``) pends forever, a requeued one waits ~2 minutes unless released.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "local_slurm.sh"
INSTALL = "bash scripts/local_slurm.sh install  (apt-get install -y slurm-wlm munge, as root)"

#: How long a requeued job pends before the tests release it (seen to fail at ~0.5 s).
RELEASE_AFTER_S = 2.0
#: Job states after which a job no longer runs (it may still be requeued: see ``Restarts``).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def missing() -> str | None:
    """Why the cluster cannot be started here (None: it can)."""
    tools = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
    absent = [t for t in tools if shutil.which(t) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): {INSTALL}"
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    """A running cluster: its folder and the environment its client commands need."""

    folder: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A SLURM client command, checked."""
        proc = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
        return proc

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit from the repository root (the job's ``SLURM_SUBMIT_DIR``); the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=30, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job`` as a mapping (JobState, Restarts, ExitCode, ...); for an array
        job, its first task's."""
        out = self.run("scontrol", "show", "job", "-o", job).stdout.splitlines()[0]
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job: str, states: set[str], timeout: float, restarts: int = 0) -> dict:
        """Wait until ``job`` is in one of ``states`` with at least ``restarts`` restarts;
        returns its record. A requeued job held for its ~2 minutes (BeginTime) is released
        (``StartTime=now``) once it has been pending for :data:`RELEASE_AFTER_S` (at once,
        slurmd may still hold the ended run and refuse the launch: the job fails)."""
        deadline = time.monotonic() + timeout
        pending_since = None
        while True:
            info = self.job(job)
            state = info["JobState"]
            if state in states and int(info["Restarts"]) >= restarts:
                return info
            assert state not in ENDED - states, f"job {job} ended: {info}"
            held = state == "PENDING" and info.get("Reason") == "BeginTime"
            pending_since = (pending_since or time.monotonic()) if held else None
            if held and time.monotonic() - pending_since >= RELEASE_AFTER_S:
                self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
                pending_since = None
            assert time.monotonic() < deadline, (
                f"job {job} not in {states} after {timeout} s: {info}"
            )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the daemons by their PIDs (the script's ``stop``)."""
        subprocess.run(["bash", str(SCRIPT), "stop", str(self.folder)], timeout=60, check=False)


def start_cluster(folder: Path) -> SlurmCluster:
    """Start the cluster in ``folder`` (on free ports); the caller stops it."""
    env = {
        **os.environ,
        "SLURMCTLD_PORT": str(_free_port()),
        "SLURMD_PORT": str(_free_port()),
        "SLURM_CONF": str(folder / "slurm.conf"),
    }
    cluster = SlurmCluster(folder, env)
    try:
        subprocess.run(
            ["bash", str(SCRIPT), "start", str(folder)],
            env=env, check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.CalledProcessError as err:
        cluster.stop()
        raise RuntimeError(f"the local SLURM cluster did not start:\n{err.stderr}") from err
    except BaseException:
        cluster.stop()
        raise
    return cluster
