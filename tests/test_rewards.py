"""Rewards: math-verify, arithmetic, the registry, and the runner's timeout / failure accounting
(real worker processes, real hangs). The DAPO "Answer:" rule is in tests/test_rewards_dapo.py."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dapo_lightning.rewards import (
    DAPOAnswerReward,
    MathVerifyReward,
    RewardFailureError,
    RewardOutputError,
    RewardResult,
    RewardRunner,
    get_reward,
)
from dapo_lightning.tasks.arithmetic import ArithmeticReward


class HangingReward:
    """Hangs (sleeps far past the timeout) on responses containing "HANG"; raises on "BOOM"."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        out = []
        for r, g in zip(responses, ground_truths):
            if "HANG" in r:
                time.sleep(3600)
            if "BOOM" in r:
                raise ValueError("boom")
            out.append(RewardResult(1.0 if r == g else -1.0, r == g, {"has_answer": True}))
        return out


class NaNReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(math.nan, False) for _ in responses]


class ShortReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(1.0, True)]


def test_math_verify_boxed_and_latex():
    reward = MathVerifyReward()
    res = reward(
        [
            "So we get \\boxed{\\frac{1}{2}}.",
            "The final answer is $0.5$",
            "\\boxed{\\frac{1}{3}}",
            "I do not know",
            "Thus \\boxed{540}",
        ],
        ["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", "540"],
    )
    assert [r.acc for r in res] == [True, True, False, False, True]
    assert [r.score for r in res] == [1.0, 1.0, -1.0, -1.0, 1.0]
    assert res[3].extra["has_answer"] is False and res[2].extra["has_answer"] is True


def test_arithmetic_reward_strict_and_lenient():
    strict = ArithmeticReward()
    res = strict([" 12 ", "12 apples", "13", ""], ["12"] * 4)
    assert [r.acc for r in res] == [True, False, False, False]
    assert [r.extra["has_answer"] for r in res] == [True, False, True, False]
    lenient = ArithmeticReward(strict=False)
    res = lenient(["it is 3, no 12", "12 apples", "none"], ["12"] * 3)
    assert [r.score for r in res] == [1.0, 1.0, -1.0]


def test_get_reward():
    assert isinstance(get_reward("dapo"), DAPOAnswerReward)
    assert isinstance(get_reward("math_verify"), MathVerifyReward)
    assert get_reward("arithmetic", strict=False).strict is False
    obj = HangingReward()
    assert get_reward(obj) is obj
    with pytest.raises(ValueError, match="not a built-in reward"):
        get_reward("nope")


def test_runner_timeout_and_failure_counting():
    runner = RewardRunner(
        HangingReward(), timeout_s=1.0, num_workers=2, max_failure_frac=0.5, chunk_size=4
    )
    try:
        responses = ["1", "HANG", "2", "BOOM", "3", "4"]
        truths = ["1", "1", "2", "2", "0", "4"]
        t0 = time.monotonic()
        res = runner.score(responses, truths)
        elapsed = time.monotonic() - t0
        # The hang lasts an hour: finishing at all proves the 1 s timeout cut it (the bound is
        # loose on purpose: these cores are shared and noisy).
        assert elapsed < 600, elapsed
        assert [r.acc for r in res] == [True, False, True, False, False, True]
        assert res[1].extra["reward_failure"] == "timeout"
        assert res[3].extra["reward_failure"].startswith("error")
        assert "boom" in res[3].extra["reward_failure"]
        assert res[1].score == -1.0 and res[3].score == -1.0
        assert runner.last_failures == 2
        # The killed worker was replaced: the runner still works.
        assert [r.acc for r in runner.score(["5"], ["5"])] == [True]
        with pytest.raises(RewardFailureError, match="data.scoring.max_failure_frac"):
            runner.score(["HANG", "BOOM", "1"], ["1", "1", "1"])
    finally:
        runner.close()


def test_runner_in_process_counts_exceptions():
    runner = RewardRunner(HangingReward(), in_process=True, max_failure_frac=0.5)
    res = runner.score(["1", "BOOM", "2"], ["1", "1", "2"])
    assert [r.acc for r in res] == [True, False, True]
    assert runner.last_failures == 1


@pytest.mark.parametrize("in_process", [True, False])
def test_runner_rejects_nan_and_wrong_length(in_process):
    for bad, match in ((NaNReward(), "finite"), (ShortReward(), "1 results for 2 responses")):
        runner = RewardRunner(bad, in_process=in_process, timeout_s=30)
        try:
            with pytest.raises(RewardOutputError, match=match):
                runner.score(["a", "b"], ["a", "b"])
        finally:
            runner.close()


# ------------------------------------------------------------- bad reward specs and outputs


def test_get_reward_builds_a_config_class_path():
    reward = get_reward(
        {"class_path": "dapo_lightning.tasks.arithmetic.ArithmeticReward",
         "init_args": {"strict": True}},
        strict=False,
    )  # fmt: skip
    assert isinstance(reward, ArithmeticReward) and reward.strict is False  # kwargs win


@pytest.mark.parametrize(
    ("class_path", "match"),
    [
        ("my_rewards.Exact", r"'my_rewards\.Exact' does not import \(ModuleNotFoundError: No module named 'my_rewards'\)"),
        ("dapo_lightning.rewards.Exact", r"'dapo_lightning\.rewards\.Exact' does not import \(AttributeError: .*Exact"),
        ("Exact", r"'Exact' must be a dotted path"),
    ],
)  # fmt: skip
def test_get_reward_class_path_that_does_not_import(class_path, match):
    with pytest.raises(ImportError, match=match):
        get_reward({"class_path": class_path})


def test_get_reward_class_path_with_wrong_init_args():
    path = "dapo_lightning.tasks.arithmetic.ArithmeticReward"
    with pytest.raises(TypeError, match=r"'dapo_lightning\.tasks.*' could not be built with "
                       r"init_args \{'strictness': 1\}"):  # fmt: skip
        get_reward({"class_path": path, "init_args": {"strictness": 1}})


class _ReturnsBadResult:
    failure_score = -1.0

    def __init__(self, **fields):
        self.fields = fields

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(**{"score": 1.0, "acc": True, **self.fields}) for _ in responses]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"score": "bad"}, r"_ReturnsBadResult returned RewardResult\(score='bad'\) at position "
                           r"0: the field score must be a number \(a str is not\)"),
        ({"score": None}, r"RewardResult\(score=None\) .*field score must be a number"),
        ({"acc": None}, r"RewardResult\(acc=None\) .*field acc must be True or False"),
        ({"acc": "yes"}, r"RewardResult\(acc='yes'\) .*field acc must be True or False"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("in_process", [True, False])
def test_bad_reward_result_fields_name_reward_field_and_value(fields, match, in_process):
    runner = RewardRunner(_ReturnsBadResult(**fields), in_process=in_process, timeout_s=30)
    try:
        with pytest.raises(RewardOutputError, match=match):
            runner.score(["a"], ["a"])
    finally:
        runner.close()


def test_numpy_and_tensor_scores_are_numbers():
    import numpy as np
    import torch

    for score, acc in ((np.float32(0.5), np.bool_(True)), (torch.tensor(1.0), 1), (1, False)):
        runner = RewardRunner(_ReturnsBadResult(score=score, acc=acc), in_process=True)
        (result,) = runner.score(["a"], ["a"])
        assert float(result.score) == float(score)


# ------------------------------------------- issue 38: deadlines, stops and failing rounds
# Real hangs (an hour's sleep), real worker processes (fork: a worker starts in milliseconds;
# spawn imports torch again, 5-100 s on these shared cores) and real stop requests.


@pytest.mark.timeout(120)
def test_in_process_reward_that_hangs_times_out_and_its_neighbours_score():
    """Issue 38 item 2: in-process scoring had no timeout (the hang held the round for its
    hour). The batch call times out after timeout_s, the samples are retried one by one: the
    hanging one fails as a timeout, the others score."""
    runner = RewardRunner(HangingReward(), in_process=True, timeout_s=1.0, max_failure_frac=0.5)
    t0 = time.monotonic()
    res = runner.score(["1", "HANG", "2"], ["1", "1", "2"])
    elapsed = time.monotonic() - t0
    runner.close()
    assert [r.acc for r in res] == [True, False, True]
    assert res[1].extra["reward_failure"] == "timeout" and runner.last_failures == 1
    assert elapsed < 2 * 1.0 + 5.0, elapsed  # the batch call's second, then the sample's


@pytest.mark.timeout(120)
def test_stop_request_while_an_in_process_reward_hangs_raises_at_once():
    """Issue 38 item 2: a hanging in-process reward ignored SIGTERM's stop request. Now the
    wait for the scoring thread sees it within STOP_POLL_S and raises StopRequested."""
    import threading

    from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop

    runner = RewardRunner(HangingReward(), in_process=True, timeout_s=300.0)
    timer = threading.Timer(1.0, request_stop, args=("SIGTERM",))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            runner.score(["HANG", "1"], ["1", "1"])
        assert time.monotonic() - t0 < 1.0 + 5.0
    finally:
        clear_stop_request()
        runner.close()


@pytest.mark.timeout(240)
def test_worker_reward_that_hangs_on_everything_fails_a_big_round_in_about_two_timeouts():
    """Issue 38 item 4: 64 samples on 2 workers with timeout_s=3 took the round's budget of
    3 s x 32 + 5 s = 101 s to fail. A reward that has not scored once and times out twice per
    worker now fails the round: about 2 x timeout_s (plus the fork of the replacements)."""
    from _bad_rewards import HangsAlways

    runner = RewardRunner(HangsAlways(), timeout_s=3.0, num_workers=2, mp_context="fork")
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardFailureError, match=r"64 of 64 responses .*HangsAlways") as info:
            runner.score(["x"] * 64, ["1"] * 64)
        elapsed = time.monotonic() - t0
    finally:
        runner.close()
    assert "timeout" in str(info.value) and "has not scored one response" in str(info.value)
    assert elapsed < 2 * 3.0 + 10.0, elapsed  # generous: shared cores


@pytest.mark.timeout(240)
def test_round_stops_as_soon_as_the_failed_share_passes_max_failure_frac():
    """Issue 38 item 4: a reward that worked, then hangs on everything: 40 samples, 2 workers,
    1 s each, max_failure_frac=0.1. The round stops at the 5th timeout (3 waves of 1 s), not
    after the budget of 1 s x 20 + 5 s; the rest counts as failed."""
    runner = RewardRunner(
        HangingReward(), timeout_s=1.0, num_workers=2, chunk_size=1, mp_context="fork"
    )
    # every other response hangs: results in between, so the failures count against the share
    # (not STRIKES_IN_A_ROW)
    responses = ["HANG" if i % 2 == 0 else "1" for i in range(40)]
    try:
        assert [r.acc for r in runner.score(["1", "2"], ["1", "2"])] == [True, True]
        t0 = time.monotonic()
        with pytest.raises(RewardFailureError, match=r"of 40 responses") as info:
            runner.score(responses, ["1"] * 40)
        elapsed = time.monotonic() - t0
    finally:
        runner.close()
    assert re.search(r"scoring stopped after [56] of 40 failed", str(info.value))  # > 4
    assert elapsed < 3 * 1.0 + 8.0, elapsed


@pytest.mark.timeout(240)
def test_worker_reward_that_starts_hanging_mid_run_fails_the_round_within_three_timeouts(capfd):
    """Issue 53 item 1: a reward that scored, then hangs on everything (2 workers, 256 samples,
    chunks of 16): each chunk waited 16 x timeout_s, then every sample one by one, until the
    round's budget ran out (8.7 minutes at timeout_s 3). Now a chunk's limit follows the pace
    seen (:func:`chunk_limit_s`) and 2 fresh jobs per worker timing out in a row fail the
    round: within 3 x timeout_s (fork: the restarts take milliseconds), with one line said."""
    runner = RewardRunner(HangingReward(), timeout_s=1.0, num_workers=2, mp_context="fork")
    try:
        assert [r.acc for r in runner.score(["1", "2"], ["1", "2"])] == [True, True]
        t0 = time.monotonic()
        with pytest.raises(RewardFailureError, match=r"256 of 256 responses") as info:
            runner.score(["HANG"] * 256, ["1"] * 256)
        elapsed = time.monotonic() - t0
    finally:
        runner.close()
    assert "4 fresh jobs in a row since its last result" in str(info.value), info.value
    assert elapsed < 3 * 1.0 + 2.0, elapsed
    said = capfd.readouterr().err
    assert said.count("scoring: reward HangingReward timed out on 16 response(s)") == 1, said


@pytest.mark.timeout(240)
def test_one_hanging_group_mid_run_fails_only_its_own_responses():
    """Issue 53 item 1, the other side: 8 adjacent responses (one prompt's group) that hang
    after the reward scored do not stop the round (their chunk's samples are retried one by
    one after the fresh chunks, and those retries count against max_failure_frac only)."""
    runner = RewardRunner(
        HangingReward(), timeout_s=0.5, num_workers=2, max_failure_frac=0.2, mp_context="fork"
    )
    responses = ["HANG" if 16 <= i < 24 else "1" for i in range(64)]
    try:
        assert [r.acc for r in runner.score(["1"], ["1"])] == [True]
        res = runner.score(responses, ["1"] * 64)
    finally:
        runner.close()
    assert [i for i, r in enumerate(res) if not r.acc] == list(range(16, 24))
    assert runner.last_failures == 8


def test_chunk_limit_follows_the_pace_and_never_exceeds_one_timeout_per_sample():
    """A chunk's limit: timeout_s before a score, then timeout_s plus 3x the pace, capped."""
    from dapo_lightning.rewards.base import chunk_limit_s

    assert chunk_limit_s(3.0, 16, None) == 3.0
    assert chunk_limit_s(3.0, 16, 0.01) == pytest.approx(3.0 + 3 * 16 * 0.01)
    assert chunk_limit_s(3.0, 16, 2.0) == 48.0


@pytest.mark.timeout(240)
def test_reward_that_ends_its_worker_fails_fast_naming_the_exit_code():
    """Issue 38 item 3: a reward calling os._exit made the pool respawn workers for minutes and
    ended with the missing-``__main__``-guard message. Now the dead worker is a failure named
    by its exit code, and a reward that never scored stops after 2 deaths per worker."""
    from _bad_rewards import ExitsInWorker

    runner = RewardRunner(ExitsInWorker(), num_workers=1, timeout_s=30.0, mp_context="fork")
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardFailureError, match=r"40 of 40 .*ExitsInWorker") as info:
            runner.score(["a"] * 40, ["1"] * 40)
    finally:
        runner.close()
    message = str(info.value)
    assert "worker process ended while scoring (exit code 3)" in message, message
    assert "__main__" not in message
    assert time.monotonic() - t0 < 20.0


def test_reward_output_errors_name_the_field_and_are_config_errors():
    """Issue 38 item 7: a NaN or string score is a bug of the reward: a ConfigError (the CLI's
    one ``error:`` line, exit 2) starting with the field, data.reward."""
    from _bad_rewards import NaNScore, StringScore

    from dapo_lightning.checks import ConfigError

    for reward, match in (
        (NaNScore(), r"^data\.reward: reward NaNScore returned score=nan at position 0"),
        (StringScore(), r"^data\.reward: reward StringScore returned RewardResult\(score='high'\)"),
    ):
        with pytest.raises(ConfigError, match=match):
            RewardRunner(reward, in_process=True).score(["a"], ["1"])


# ----------------------------------------------- issue 38: stops of a real `dapo-lightning fit`
TESTS = Path(__file__).resolve().parent
FIT = """
model:
  class_path: dapo_lightning.DAPOModule
  init_args:
    model_name_or_path: {model}
    batching: {{micro_batch_size: 8}}
    parity_check_every: 0
data:
  class_path: dapo_lightning.DAPODataModule
  init_args:
    reward: {{class_path: {reward}, init_args: {{marker: {marker}}}}}
    scoring: {scoring}
    prompts:
      task: arithmetic
      task_kwargs: {{level: 1, num_prompts: 16}}
      apply_chat_template: false
      max_prompt_length: 16
    sampling: {{max_tokens: 4}}
    dynamic_sampling: {{n: 2, train_batch_size: 2, filter_metric: null}}
trainer:
  max_steps: 5
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  accelerator: cpu
  default_root_dir: {run}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: 100}}
"""


def start_fit(tmp_path: Path, model: Path, reward: str, scoring: str) -> subprocess.Popen:
    """``python -m dapo_lightning fit`` on a config of FIT, in a session of its own (so the
    whole process group can be signalled, as SLURM and ``timeout`` do); tests/ importable."""
    config = tmp_path / "fit.yaml"
    marker, run = tmp_path / "marker.txt", tmp_path / "run"
    config.write_text(
        FIT.format(model=model, reward=reward, marker=marker, scoring=scoring, run=run)
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "dapo_lightning", "fit", f"--config={config}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def wait_for(proc: subprocess.Popen, ready: Any, what: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_sigterm_while_an_in_process_reward_hangs_exits_143_with_the_last_update_saved(
    tiny_checkpoint, tmp_path
):
    """Issue 38 item 2: ``scoring.in_process: true`` (the quickstart's) with a reward that hangs
    in update 2 ignored SIGTERM twice (SLURM then SIGKILLs: the work since the last save is
    lost). Now the stop reaches the wait for the scoring thread: update 1 is saved, exit 143
    within 30 s, and the checkpoint resumes."""
    proc = start_fit(
        tmp_path, tiny_checkpoint, "_hanging_reward.HangsAfterCalls",
        "{in_process: true, timeout_s: 300}",
    )  # fmt: skip
    marker = tmp_path / "marker.txt"
    wait_for(
        proc, lambda: marker.exists() and len(marker.read_text().splitlines()) >= 2,
        "the reward was never called twice",
    )  # fmt: skip
    time.sleep(0.5)  # well inside the hang
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-4000:]
    assert time.monotonic() - t0 < 30
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 1 and saved["state_dict"], err[-4000:]
    assert "Saved" in err and "update 1" in err


@pytest.mark.timeout(600)
def test_process_group_sigterm_while_reward_workers_start_exits_143(tiny_checkpoint, tmp_path):
    """Issue 38 item 3: SIGTERM to the whole process group while the reward workers start (how
    SLURM and ``timeout`` signal) killed the starting workers and the run ended with exit 1 and
    a false "put the training code under ``if __name__ == '__main__'``" error (the dead
    worker was seen before the stop request, here while the fit process starts the second
    worker). Now the workers start with the stop signals blocked, the fit honours the stop (nothing to save before the
    first update) and exits 143, and no process of the group is left behind."""
    proc = start_fit(
        tmp_path, tiny_checkpoint, "_bad_rewards.StartsSlowly", "{workers: 2, timeout_s: 10}"
    )
    marker = tmp_path / "marker.txt"

    def workers_starting() -> bool:  # worker 1 is starting, the fit process starts worker 2
        lines = marker.read_text().splitlines() if marker.exists() else []
        return f"pickling {proc.pid}" in lines and any(
            line.startswith("starting") and int(line.split()[1]) != proc.pid for line in lines
        )

    wait_for(proc, workers_starting, "the reward workers did not start")
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-4000:]
    assert "__main__" not in err and "Traceback" not in err, err[-4000:]
    assert "SIGTERM: nothing to save yet" in err, err[-4000:]
    deadline = time.monotonic() + 10
    while True:  # the workers were killed with their parent's stop
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a reward worker outlived the fit"
        time.sleep(0.1)
