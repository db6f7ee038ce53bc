"""``dapo-lightning fit`` on 2 CPU ranks launched by Lightning itself (``--trainer.devices 2``):
FSDP2 (configs/fsdp2_cpu_2ranks.yaml) with the HF and the vLLM engine, DDP with vLLM, and a
sharded (distributed-checkpoint) resume that ends with the weights of an uninterrupted run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests._harness import CLI, QUICKSTART, REPO, check, cli_env, run_cli

CONFIGS = REPO / "configs"


def fit(run_dir: Path, model_dir: Path, *configs: str, extra=(), timeout=420):
    """``dapo-lightning fit`` of quickstart.yaml plus ``configs`` (from configs/) with the even
    length reward, one thread per rank; checked."""
    args = ["--config", QUICKSTART]
    for c in configs:
        args += ["--config", str(CONFIGS / c)]
    args += [
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.val_check_interval", "2",
        "--model.model_name_or_path", str(model_dir),
        "--create_model_if_missing", "null",
        "--data.reward", '{"class_path": "_length_reward.EvenLengthReward"}',
        "--data.dynamic_sampling.max_num_gen_batches", "3",
        *extra,
    ]  # fmt: skip
    return check(run_cli("fit", *args, env={"OMP_NUM_THREADS": "1"}, timeout=timeout))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The policy weights of a run's last.ckpt (a distributed checkpoint folder under FSDP2)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = next(run_dir.rglob("last.ckpt"))
    if ckpt.is_dir():
        flat = run_dir / "last_flat.pt"
        dcp_to_torch_save(ckpt, flat)
        state = torch.load(flat, weights_only=False)
        state = state.get("state_dict", state.get("model", state))
    else:
        state = torch.load(ckpt, weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "configs",
    [("fsdp2_cpu_2ranks.yaml",), ("quickstart_vllm.yaml", "fsdp2_cpu_2ranks.yaml")],
    ids=["fsdp2-hf", "fsdp2-vllm"],
)
def test_fsdp2_fit_on_two_ranks(tmp_path, model_dir, configs):
    if "quickstart_vllm.yaml" in configs:
        pytest.importorskip("vllm")
    proc = fit(tmp_path / "run", model_dir, *configs, extra=["--trainer.max_steps", "2"])
    out = proc.stdout + proc.stderr
    assert "max_steps=2 reached" in out
    assert (next((tmp_path / "run").rglob("last.ckpt")) / "meta.pt").exists()  # sharded save


@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_ddp_fit_with_vllm_on_two_ranks(tmp_path, model_dir):
    pytest.importorskip("vllm")
    proc = fit(
        tmp_path / "run", model_dir, "quickstart_vllm.yaml",
        extra=["--trainer.max_steps", "2", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
    )  # fmt: skip
    assert "max_steps=2 reached" in proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_resume_reaches_the_uninterrupted_weights(tmp_path, model_dir):
    straight = tmp_path / "straight"
    fit(straight, model_dir, "fsdp2_cpu_2ranks.yaml", extra=["--trainer.max_steps", "4"])
    resumed = tmp_path / "resumed"
    fit(resumed, model_dir, "fsdp2_cpu_2ranks.yaml", extra=["--trainer.max_steps", "2"])
    fit(
        resumed, model_dir, "fsdp2_cpu_2ranks.yaml",
        extra=["--trainer.max_steps", "4", "--ckpt_path", "auto"],
    )  # fmt: skip
    a, b = final_weights(straight), final_weights(resumed)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    policy = {k.removeprefix("policy."): v for k, v in a.items() if k.startswith("policy.")}
    assert policy.keys() >= set(
        dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    )
    assert max(float((policy[k] - start[k]).abs().max()) for k in policy) > 1e-4  # it trained
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0  # bit-exact resume


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_sigterm_mid_run_resumes_to_the_uninterrupted_weights(tmp_path, model_dir):
    """A real SIGTERM to rank 0 of a 2-rank FSDP2 fit after a few updates: every rank stops at
    the same clean point, the sharded state is saved, the command exits 143, and the resumed run
    ends with the weights of an uninterrupted one."""
    import signal
    import time

    straight = tmp_path / "straight"
    fit(straight, model_dir, "fsdp2_cpu_2ranks.yaml", extra=["--trainer.max_steps", "6"])
    run = tmp_path / "killed"
    args = [CLI, "fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config",
            str(CONFIGS / "fsdp2_cpu_2ranks.yaml"), "--trainer.default_root_dir", str(run),
            "--trainer.val_check_interval", "2", "--model.model_name_or_path", str(model_dir),
            "--create_model_if_missing", "null", "--data.reward",
            '{"class_path": "_length_reward.EvenLengthReward"}',
            "--data.dynamic_sampling.max_num_gen_batches", "3", "--trainer.max_steps", "6"]  # fmt: skip
    env = cli_env({"OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 600
    while (
        not list(run.rglob("metrics.csv"))
        or "update/loss" not in next(run.rglob("metrics.csv")).read_text()
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=600)[0]
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived (a loaded machine)")
    assert proc.returncode == 143, out[-4000:]
    fit(run, model_dir, "fsdp2_cpu_2ranks.yaml",
        extra=["--trainer.max_steps", "6", "--ckpt_path", "auto"])  # fmt: skip
    a, b = final_weights(straight), final_weights(run)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
