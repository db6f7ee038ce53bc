"""Reward workers that die between rounds and rewards that end their own scoring (issue 63
items 7 and 13), with real worker processes killed by a real SIGKILL."""

from __future__ import annotations

import os
import signal
import time

import pytest
from _bad_rewards import CallsSysExit, EvenLength, RaisesKeyboardInterrupt

from dapo_lightning.rewards import RewardOutputError, RewardRunner


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` is no longer a running process (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {pid} still runs")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_worker_sigkilled_between_rounds_is_respawned(start_method, capfd):
    """Item 7: a reward worker SIGKILLed between two rounds (what the OOM killer does) ended
    the run with a BrokenPipeError traceback. Now the next round starts a fresh worker, says
    so in one line, and scores every response (no failure counted)."""
    runner = RewardRunner(EvenLength(), num_workers=2, timeout_s=30.0, mp_context=start_method)
    try:
        first = runner.score(["ab", "abc", "abcd", "a"], ["", "", "", ""])
        assert [r.acc for r in first] == [True, False, True, False]
        # a worker that has scored (under load the second may still be starting: a death
        # during the start is the start's error, not this test's)
        ready = [w.proc.pid for w in runner._workers if w.ready]
        assert ready and os.getpid() not in ready
        victim = ready[0]
        os.kill(victim, signal.SIGKILL)  # a real kill, between two rounds
        _wait_dead(victim)
        second = runner.score(["ab", "abc", "abcd", "a"] * 2, [""] * 8)
        assert [r.acc for r in second] == [True, False, True, False] * 2
        assert runner.last_failures == 0
        assert victim not in {r.extra["pid"] for r in second}
        third = runner.score(["xy"] * 4, [""] * 4)  # the pool is whole again
        assert [r.score for r in third] == [1.0] * 4
    finally:
        runner.close()
    err = capfd.readouterr().err
    assert "ended between rounds (killed by SIGKILL (exit code -9)); starting a fresh one" in err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("reward", "did"),
    [
        (CallsSysExit(), "called sys.exit(3)"),
        (RaisesKeyboardInterrupt(), "raised KeyboardInterrupt"),
    ],
    ids=["sys.exit", "KeyboardInterrupt"],
)
@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "worker"])
def test_reward_that_exits_is_reported_at_once_as_what_it_is(reward, did, in_process, capfd):
    """Item 13: an in-process reward calling ``sys.exit(3)`` or raising ``KeyboardInterrupt``
    was reported after ~34 s as a timeout with the fix "raise timeout_s" (the thread had ended
    silently; KeyboardInterrupt also printed a thread traceback). Now: a RewardOutputError (the
    CLI's one ``error:`` line, exit 2) at once, naming the reward, what it did and the fix;
    no traceback. In a worker process the same."""
    runner = RewardRunner(reward, in_process=in_process, timeout_s=10.0, mp_context="fork")
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardOutputError) as info:
            runner.score(["a", "b"], ["1", "2"])
    finally:
        runner.close()
    took = time.monotonic() - t0
    message = str(info.value)
    name = type(reward).__name__
    assert message.startswith(f"data.reward: reward {name} {did} while scoring"), message
    assert "never exit" in message and "timeout_s" not in message, message
    assert took < 5.0, took
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
