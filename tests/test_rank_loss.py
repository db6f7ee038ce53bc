"""A rank lost mid-run (issue 53): SIGKILL of one of the 2 ranks of the README's DDP line ends the
run within 60 s with a message naming the dead rank (not at a 30-minute collective timeout), and
`--ckpt_path auto` resumes the last periodic checkpoint. The harness: tests/_long_run.py."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import psutil
import pytest

from tests._long_run import EVERY, finish, output, start, wait_for_update

pytestmark = [pytest.mark.distributed]


def rank_one(proc: subprocess.Popen, timeout: float = 60) -> psutil.Process:
    """The process of rank 1: the child Lightning's launcher started (LOCAL_RANK=1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if child.environ().get("LOCAL_RANK") == "1":
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    pytest.fail("no rank-1 process found")


@pytest.mark.timeout(600, func_only=True)  # setup: the run's first warm-up (conftest)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_the_run_within_60_s_naming_it(quickstart_model, tmp_path, killed):
    """SIGKILL of one rank after the periodic checkpoint at update 20: the other rank's process
    exits within 60 s (not at a 30-minute collective timeout) with a message naming the dead
    rank, and `--ckpt_path auto` resumes the last periodic checkpoint."""
    proc = start(tmp_path, quickstart_model, "ddp")
    other = rank_one(proc)
    wait_for_update(proc, EVERY + 4)
    victim, survivor = (
        (other, psutil.Process(proc.pid)) if killed == 1 else (psutil.Process(proc.pid), other)
    )
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor.wait(timeout=90)
    assert time.monotonic() - killed_at < 60
    proc.wait(timeout=30)
    text = output(proc)
    line = f"dapo-lightning: error: rank {1 - killed} lost rank {killed} of 2: its connection"
    assert line in text, text[-3000:]
    resumed = start(
        tmp_path, quickstart_model, "ddp", "--ckpt_path", "auto", "--trainer.max_steps", "30"
    )
    code, text = finish(resumed)
    assert code == 0, text[-4000:]
    assert re.search(rf"resum\w* .*update {EVERY}\b", text, re.I), text[-3000:]
