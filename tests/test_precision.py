"""Precision that fits the machine: the bf16 / float32 decision on faked capabilities (a pure
function of them), the CPU flags read from a cpuinfo file, the warning on a bf16 setting without
bf16 hardware, and ``trainer.precision: auto`` resolved by the CLI before the Trainer is built."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

from dapo_lightning import precision
from dapo_lightning.cli import build_cli
from dapo_lightning.precision import (
    DeviceCaps,
    accelerator_device,
    decide_bf16,
    device_caps,
    read_cpu_flags,
    resolve_dtype,
    resolve_trainer_precision,
)

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})


@pytest.mark.parametrize(
    ("caps", "bf16", "why"),
    [
        (DeviceCaps("cuda", cuda_bf16=True), True, "CUDA device with bf16"),
        (DeviceCaps("cuda", cuda_bf16=False), False, "without bf16 support"),
        (DeviceCaps("cpu", cpu_flags=AVX2 | {"avx512f", "avx512_bf16"}), True, "avx512_bf16"),
        (DeviceCaps("cpu", cpu_flags=AVX2 | {"amx_bf16", "amx_tile"}), True, "amx_bf16"),
        (DeviceCaps("cpu", cpu_flags=AVX2, cpu_capability="AVX2"), False, "capability AVX2"),
        # AVX-512 without its BF16 extension is not enough
        (DeviceCaps("cpu", cpu_flags=AVX2 | {"avx512f"}, cpu_capability="AVX512"), False, "AVX512"),
        (DeviceCaps("cpu", cpu_capability="AMX"), True, "capability AMX"),
        (DeviceCaps("cpu"), False, "capability unknown"),
        # CPU flags do not matter for a CUDA decision
        (DeviceCaps("cuda", cpu_flags=frozenset({"amx_bf16"})), False, "pre-Ampere"),
    ],
)
def test_decision_is_a_function_of_the_capabilities(caps, bf16, why):
    decision = decide_bf16(caps)
    assert decision.bf16 is bf16 and why in decision.reason


def test_cpu_flags_from_a_cpuinfo_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu AVX2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert read_cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}  # first CPU, lower case
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize(
    ("accelerator", "device"), [("cpu", "cpu"), ("gpu", "cuda"), ("cuda", "cuda"), ("mps", "cpu")]
)
def test_accelerator_device(accelerator, device):
    assert accelerator_device(accelerator) == device


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_resolves_from_the_decision_and_says_why(bf16, capsys, monkeypatch):
    caps = DeviceCaps("cpu", cpu_flags=AVX2 | ({"amx_bf16"} if bf16 else set()))
    monkeypatch.setattr(precision, "device_caps", lambda device: caps)
    assert resolve_trainer_precision("auto", "cpu") == ("bf16-mixed" if bf16 else "32-true")
    assert resolve_dtype("auto", "cpu", "engine dtype") == ("bfloat16" if bf16 else "float32")
    err = capsys.readouterr().err
    reason = decide_bf16(caps).reason
    assert f"trainer.precision: auto -> {'bf16-mixed' if bf16 else '32-true'} ({reason})" in err
    assert f"engine dtype: auto -> {'bfloat16' if bf16 else 'float32'} ({reason})" in err
    assert resolve_trainer_precision("16-mixed", "cpu") == "16-mixed"  # others pass through
    assert resolve_dtype("float16", "cpu") == "float16"


def test_bf16_without_bf16_hardware_warns_once_with_the_measured_slowdown(monkeypatch):
    monkeypatch.setattr(precision, "device_caps", lambda device: DeviceCaps("cpu", cpu_flags=AVX2))
    monkeypatch.setattr(precision, "measure_bf16_slowdown", lambda: 70.4)
    monkeypatch.setattr(precision, "_WARNED", set())
    with pytest.warns(
        UserWarning,
        match=r"trainer.precision=bf16-mixed on a CPU without .*70x slower.*Fix: set it to auto",
    ):
        assert resolve_trainer_precision("bf16-mixed", "cpu") == "bf16-mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_trainer_precision("bf16-mixed", "cpu")  # once per setting
        resolve_trainer_precision("bf16-mixed", "gpu")  # not on a GPU
        monkeypatch.setattr(
            precision, "device_caps", lambda device: DeviceCaps("cpu", cpu_flags={"amx_bf16"})
        )
        resolve_dtype("bfloat16", "cpu", "other")  # nor with bf16 hardware


def test_measured_slowdown_is_a_positive_ratio():
    """The probe itself (a 256 x 256 GEMM in both dtypes, one thread; torch's threads restored)."""
    import torch

    threads = torch.get_num_threads()
    ratio = precision.measure_bf16_slowdown(size=64, repeats=1)
    assert ratio > 0 and torch.get_num_threads() == threads


def test_cli_resolves_auto_before_the_trainer_is_built(tiny_checkpoint, capsys):
    """On this machine: float32 (32-true) without bf16 hardware, bf16-mixed with it."""
    expected = "bf16-mixed" if decide_bf16(device_caps("cpu")).bf16 else "32-true"
    args = [
        "--config", QUICKSTART, "--model.init_args.model_name_or_path", str(tiny_checkpoint),
        "--create_model_if_missing", "null", "--trainer.logger", "false",
        "--trainer.precision", "auto",
    ]  # fmt: skip
    with mock.patch.object(sys, "argv", ["dapo-lightning"]):
        cli = build_cli(args, run=False)
    assert cli.config.trainer.precision == expected
    assert cli.trainer.precision == expected
    assert f"trainer.precision: auto -> {expected}" in capsys.readouterr().err
