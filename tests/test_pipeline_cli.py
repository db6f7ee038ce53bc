"""``dapo-lightning fit`` with ``data.dynamic_sampling.pipeline: one_step_off``: a resumed run
ends with the weights of an uninterrupted one (one process, and DDP on 2 gloo ranks: the batch
in flight is in the checkpoint), a real SIGTERM stops it within SLURM's grace with the last
update saved, and what it cannot run with is refused in one line before any rank starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch
from test_sharded_cli import CONFIGS, final_weights, fit

from dapo_lightning.plot import find_metrics_csv, read_metrics
from tests._harness import CLI, QUICKSTART, cli_env, run_cli

PIPELINE = ["--data.dynamic_sampling.pipeline", "one_step_off"]


def resume_matches_straight(tmp_path, model_dir, extra=()):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fit(straight, model_dir, extra=[*PIPELINE, *extra, "--trainer.max_steps", "8"])
    fit(resumed, model_dir, extra=[*PIPELINE, *extra, "--trainer.max_steps", "4"])
    fit(
        resumed, model_dir,
        extra=[*PIPELINE, *extra, "--trainer.max_steps", "8", "--ckpt_path", "auto"],
    )  # fmt: skip
    a, b = final_weights(straight), final_weights(resumed)
    start = torch.load(next((resumed).rglob("last.ckpt")), weights_only=False)
    assert start["global_step"] == 8
    ready = start["DAPODataModule"]["ranks"][0]["ready"]  # the batch in flight, saved
    assert (
        ready is not None and ready["policy_version"] == 6
    )  # batch 4, sampled after 3 steps' 6 updates
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0  # bit-exact


@pytest.mark.timeout(600)
def test_one_process_resume_is_bit_exact(tmp_path, model_dir):
    resume_matches_straight(tmp_path, model_dir)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_ddp_two_ranks_resume_is_bit_exact(tmp_path, model_dir):
    resume_matches_straight(
        tmp_path, model_dir, extra=["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    )


def test_fsdp2_is_refused_in_one_line(tmp_path, model_dir):
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--config", str(CONFIGS / "fsdp2_cpu_2ranks.yaml"),
        "--trainer.default_root_dir", str(tmp_path / "run"),
        "--model.model_name_or_path", str(model_dir), "--create_model_if_missing", "null",
        *PIPELINE,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "pipeline" in errors[0] and "fsdp2" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(600)
def test_sigterm_stops_within_the_grace_with_the_last_update_saved(tmp_path, model_dir):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [CLI, "fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(run),
         "--model.model_name_or_path", str(model_dir), "--create_model_if_missing", "null",
         "--data.reward", '{"class_path": "_length_reward.EvenLengthReward"}',
         "--data.dynamic_sampling.max_num_gen_batches", "3",
         "--trainer.max_steps", "400", *PIPELINE],
        env=cli_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists():  # quickstart saves every 20 updates: training is under way
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-4000:]
    assert time.monotonic() - t0 < 30, "SLURM's default grace is 30 s"
    saved = re.search(r"Saved \S+ \(.*update (\d+)|update (\d+) is already saved", err)
    assert saved, err[-3000:]
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == int(saved.group(1) or saved.group(2)) >= 20
    assert os.path.exists(last)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_engine_generates_on_the_rollout_thread(tmp_path, model_dir):
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    fit(run, model_dir, "quickstart_vllm.yaml", extra=[*PIPELINE, "--trainer.max_steps", "6"])
    rows = read_metrics(find_metrics_csv(run))  # quickstart_vllm.yaml nests its run folder
    assert [v for _, v in rows["data/staleness_max"]] == [0.0, 2.0, 2.0]  # 2 updates a step
    assert any(v > 0 for _, v in rows["data/gen_seconds"])  # a step may come from carried groups
    assert "engine: vllm" in next(run.rglob("config.yaml")).read_text()
