"""dapo_lightning/threads.py: the thread-count rule, its overrides, the parameter count it reads
from a model folder, and the OpenMP wait policy set before torch loads (in a fresh process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning.cli import ConfigError, build_cli
from dapo_lightning.testing import tiny_num_parameters
from dapo_lightning.threads import (
    SINGLE_THREAD_MAX_PARAMS,
    choose_threads,
    count_parameters,
    prefer_passive_wait,
)


def test_auto_takes_one_thread_for_a_tiny_model_and_the_cores_for_a_large_one():
    tiny = choose_threads(300_000, cores=16, environ={})
    assert tiny.threads == 1 and "0.3M parameters" in tiny.reason
    assert choose_threads(SINGLE_THREAD_MAX_PARAMS, cores=16, environ={}).threads == 1
    assert choose_threads(SINGLE_THREAD_MAX_PARAMS + 1, cores=16, environ={}).threads == 16
    big = choose_threads(135_000_000, cores=16, processes=4, environ={})
    assert big.threads == 4 and "16 usable cores / 4 processes" in big.reason
    assert choose_threads(135_000_000, cores=2, processes=4, environ={}).threads == 1
    assert choose_threads(None, cores=3, environ={}).threads == 3  # size unknown: the cores


def test_setting_wins_over_the_environment_which_wins_over_auto():
    env = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}
    assert choose_threads(300_000, setting=2, cores=16, environ=env).threads == 2
    from_omp = choose_threads(300_000, cores=16, environ=env)
    assert from_omp.threads == 3 and "OMP_NUM_THREADS=3 from the environment" in from_omp.reason
    assert choose_threads(300_000, cores=16, environ={"MKL_NUM_THREADS": "5"}).threads == 5
    line = choose_threads(300_000, setting=2, cores=16, environ={}).line()
    assert line.startswith("threads: 2 (threads: 2 set; OMP_WAIT_POLICY")


@pytest.mark.parametrize("setting", [0, -1, True, "two", 1.5])
def test_a_bad_setting_is_refused(setting):
    with pytest.raises(ValueError, match="threads must be 'auto' or a positive integer"):
        choose_threads(300_000, setting=setting, environ={})


def test_a_bad_environment_value_is_named():
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='0'"):
        choose_threads(300_000, environ={"OMP_NUM_THREADS": "0"})
    with pytest.raises(ValueError, match=r"MKL_NUM_THREADS='x'"):
        choose_threads(300_000, environ={"MKL_NUM_THREADS": "x"})


def test_count_parameters_reads_the_folder_without_loading_it(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    loaded = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert count_parameters(tiny_checkpoint) == loaded == tiny_num_parameters()
    assert 300_000 < loaded < 400_000  # the quickstart's model is "0.3M parameters"
    assert count_parameters(tmp_path) is None  # no safetensors
    assert count_parameters("Qwen/Qwen2.5-0.5B") is None  # a hub id


def test_wait_policy_is_kept_when_set_and_never_set_after_torch():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert (
        prefer_passive_wait(env) == "OMP_WAIT_POLICY=ACTIVE" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    )
    env = {"GOMP_SPINCOUNT": "10000"}  # a bounded spin of the user's own: not made PASSIVE
    assert prefer_passive_wait(env) == "GOMP_SPINCOUNT=10000" and env == {"GOMP_SPINCOUNT": "10000"}
    env = {}
    assert "torch was imported before" in prefer_passive_wait(env)  # torch is loaded here
    assert env == {}


def test_importing_the_package_first_sets_a_passive_wait_policy():
    # Before torch loads libgomp (which reads the policy once); after torch: the test above.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    script = "import dapo_lightning, os, sys; print(os.environ['OMP_WAIT_POLICY'])"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "PASSIVE"


def test_cli_refuses_a_bad_thread_setting(tiny_checkpoint):
    threads = torch.get_num_threads()
    with pytest.raises(ConfigError, match="threads must be 'auto' or a positive integer, got 0"):
        build_cli(
            ["--model", "DAPOModule", "--model.model_name_or_path", str(tiny_checkpoint),
             "--data", "DAPODataModule", "--data.prompts.task", "arithmetic", "--threads", "0"],
            run=False,
        )  # fmt: skip
    assert torch.get_num_threads() == threads
