"""Issue 63 item 4: an environment whose constructor takes a minute hung the fit in "generating
the first rollout step" (not bounded by ``call_timeout_s``), and SIGTERM never stopped it. Real
CLI fits of the tiny model with a real slow constructor and a real signal."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests._harness import CLI, REPO, cli_env
from tests.test_bad_inputs import assert_one_error_line, fit_config, fit_main

#: The random model ends its turns on a third of the byte tokens: the environment is called.
STOPS = f"{{eos_token_id: {[1, *range(100, 190)]}}}"


def _environment(name: str, kwargs: str, call_timeout_s: float) -> str:
    return (
        f'--data.environment={{"name": "{name}", "kwargs": {kwargs}, "max_turns": 2, '
        f'"call_timeout_s": {call_timeout_s}, "add_instructions": false}}'
    )


@pytest.mark.timeout(150)
def test_environment_constructor_past_call_timeout_is_one_error_line_exit_2(
    tiny_checkpoint, tmp_path, capfd
):
    """A constructor that does not return within ``call_timeout_s`` (1 s) ends the fit at
    once: one ``error:`` line naming the setting and the fix, exit 2 (it hung for 10 minutes)."""
    config = fit_config(tmp_path, tiny_checkpoint)
    t0 = time.monotonic()
    code, err = fit_main(
        [
            f"--config={config}",
            _environment("_slow_envs.SlowInit", "{}", 1),
            f"--data.engine_kwargs={STOPS}",
        ],
        capfd,
    )
    assert_one_error_line(
        code, err, "environment '_slow_envs.SlowInit' took more than", "call_timeout_s=1 s"
    )
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(300)
def test_sigterm_while_an_environment_builds_in_the_first_step_exits_143(tiny_checkpoint, tmp_path):
    """The fit runs; the environments of the first rollout step take 10 minutes to build
    (``call_timeout_s`` 600: the timeout does not end it). A real SIGTERM then stops the fit
    within seconds: exit 143, the stop said, no traceback (it said "stopping at the next clean
    point" and never stopped)."""
    config = fit_config(tmp_path, tiny_checkpoint)
    marker = tmp_path / "building"
    proc = subprocess.Popen(
        [
            CLI,
            "fit",
            f"--config={config}",
            _environment("_slow_envs.SlowInitOnceFitting", f'{{"marker": "{marker}"}}', 600),
            f"--data.engine_kwargs={STOPS}",
        ],
        cwd=REPO,
        env=cli_env(None),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the fit never built an environment"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    assert time.monotonic() - t0 < 30
    assert "SIGTERM received" in err and "Traceback" not in err, err[-3000:]
