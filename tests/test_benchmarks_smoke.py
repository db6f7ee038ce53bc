"""Smoke tests: each benchmark script runs end to end with ``--quick`` in a fresh process,
exits 0, prints its table and writes its PNG. No timing is asserted (these machines are noisy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


def _run(module: str, png: str, timeout: int) -> str:
    target = OUT / png
    target.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert target.is_file() and target.stat().st_size > 1000, f"{target} not written"
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return proc.stdout


@pytest.mark.timeout(120)
def test_roofline_quick() -> None:
    out = _run("benchmarks.roofline", "roofline_quick.png", timeout=110)
    assert "Square GEMM throughput" in out
    assert "float32 GFLOP/s" in out and "bfloat16 GFLOP/s" in out
    assert (OUT / "gemm_quick.png").is_file()


def test_model_flops_formula() -> None:
    """6 N D + 12 L H Q S D on a hand-computed toy config."""
    from types import SimpleNamespace

    from benchmarks._shared.flops import matmul_params, mfu, update_model_flops

    cfg = SimpleNamespace(
        hidden_size=8,
        head_dim=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_hidden_layers=3,
        vocab_size=10,
    )
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 = 192; mlp 3*8*16 = 384; head 10*8 = 80
    assert matmul_params(cfg) == 3 * (192 + 384) + 80
    n, d, s = 1808, 2 * 5, 5
    assert update_model_flops(cfg, 2, 5) == 6 * n * d + 12 * 3 * 2 * 4 * s * d
    assert mfu(100.0, 2.0, 100.0) == 0.5


@pytest.mark.timeout(120)
def test_shared_prompts_quick() -> None:
    """Both layouts run a rollout step's updates, and their old log-probs agree."""
    out = _run("benchmarks.shared_prompts", "shared_prompts_quick.png", timeout=110)
    assert "every row whole vs each shared prompt once" in out
    row = next(line for line in out.splitlines() if "tiny 4 x 4" in line and "│" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert int(cells[1]) > int(cells[2]) > 0  # fewer tokens through the model
    assert float(cells[6]) < 1e-5  # the same old log-probs (float32)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_update_throughput_quick() -> None:
    out = _run("benchmarks.update_throughput", "update_throughput_quick.png", timeout=290)
    assert "One DAPO optimizer update" in out
    assert "ours" in out and "trl" in out
    assert "Rollout step shares" in out
    assert "Redundant-forward check" in out
    assert "Profile of one update" in out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_rollout_throughput_quick() -> None:
    out = _run("benchmarks.rollout_throughput", "rollout_throughput.png", timeout=290)
    assert "vllm" in out.lower() and "hf" in out.lower()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_learning_efficiency_quick() -> None:
    out = _run("benchmarks.learning_efficiency", "learning_efficiency_quick.png", timeout=890)
    assert "DAPO" in out and "GRPO baseline" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sampling_efficiency_simulated_quick() -> None:
    out = _run("benchmarks.sampling_efficiency", "sampling_efficiency_quick.png", timeout=290)
    last = out.strip().splitlines()[-1]
    assert last.startswith("samples per kept group: uniform ") and last.endswith(" n")
    uniform = float(last.split("uniform ")[1].split(" n")[0])
    parts = float(last.split("all parts ")[1].split(" n")[0])
    assert parts < uniform  # predictive selection already helps within 20 steps


def test_mean_over_budget_is_the_area_under_the_curve() -> None:
    """smollm2_curve's "mean in budget": trapezoids of val/acc over minutes, cut at the budget."""
    from benchmarks._shared.smollm2 import mean_over_budget

    # (updates, val/acc, wall s, idle-equivalent s, load): 0.2 -> 0.4 in minute 1, -> 0.6 by 3
    curve = [(0, 0.2, 0, 0, 0), (8, 0.4, 60, 120, 0), (16, 0.6, 180, 240, 0)]
    assert mean_over_budget(curve, 3, "wall") == pytest.approx((0.3 * 1 + 0.5 * 2) / 3)
    # cut at 1.5 wall minutes: 0.4 -> 0.45 over the last half minute
    assert mean_over_budget(curve, 1.5, "wall") == pytest.approx((0.3 + 0.425 * 0.5) / 1.5)
    # the cpu clock reads the idle-equivalent column; a run shorter than the budget is averaged
    # over what it covered
    assert mean_over_budget(curve, 10, "cpu") == pytest.approx((0.3 * 2 + 0.5 * 2) / 4)
    assert mean_over_budget(curve[:1], 3, "wall") is None


def test_pipeline_bounds_from_the_phase_times() -> None:
    """pipeline_phases.bounds: sync's step over the step each layout allows (written out)."""
    from benchmarks.pipeline_phases import bounds

    sync = {"gen_s": 12.0, "update_s": 22.0, "step_s": 44.0}  # 10 s of the step elsewhere
    fixed = {"gen_s": 15.0, "update_s": 34.0}  # each phase on one of the two cores
    shared_update = 15.0 + (1 - 15.0 / 34.0) * 22.0  # on one core beside generation, then two
    assert bounds(sync, fixed) == pytest.approx(
        {
            "separate hardware": 44.0 / (22.0 + 10.0),
            "fixed split": 44.0 / (34.0 + 10.0),
            "shared cores": 44.0 / (shared_update + 10.0),
        }
    )
    assert bounds(sync, None) == pytest.approx({"separate hardware": 44.0 / 32.0})
    # generation longer than the update on its share: it ends on all the cores
    shared_generation = 34.0 + (1 - 34.0 / 40.0) * 12.0
    assert bounds(sync, {"gen_s": 40.0, "update_s": 34.0})["shared cores"] == pytest.approx(
        44.0 / (shared_generation + 10.0)
    )


@pytest.mark.parametrize(
    ("method", "share_cores", "stale_old", "stale_tis_cap", "start_after_updates"),
    [
        ("dapo_one_step_off_fixed", False, "engine", 1.0, 0),
        ("dapo_one_step_off_trainer_old", True, "trainer", 2.0, 0),
        ("dapo_one_step_off_late_start", True, "trainer", 2.0, 2),
    ],
)
def test_smollm2_curve_method_configs_resolve(
    method: str,
    share_cores: bool,
    stale_old: str,
    stale_tis_cap: float,
    start_after_updates: int,
    capsys,
) -> None:
    """Each benchmark method's file stack (recipe, then its overrides) parses through the CLI,
    and the override's keys arrive in the resolved config on top of configs/one_step_off.yaml."""
    from benchmarks.smollm2_curve import METHOD_OVERRIDES, RECIPES, STYLES
    from tests.test_configs import print_config

    assert method in STYLES
    files = [RECIPES["reasoning_gym"], *METHOD_OVERRIDES[method]]
    cfg = print_config(capsys, *(str(ROOT / f) for f in files))
    sampling = cfg["data"]["init_args"]["dynamic_sampling"]
    correction = cfg["model"]["init_args"]["loss"]["rollout_correction"]
    settings = sampling["one_step_off"]
    assert (sampling["pipeline"], settings["share_cores"]) == ("one_step_off", share_cores)
    assert settings["start_after_updates"] == start_after_updates
    assert (correction["stale_old"], correction["stale_tis_cap"]) == (stale_old, stale_tis_cap)
