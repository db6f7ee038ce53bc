"""DeepSpeed path of the module's gradient accumulation, on CPU with the raw engine.

Lightning's DeepSpeedStrategy needs CUDA; what runs here is the engine itself with the
module's accumulation protocol (``deepspeed_backward``): the update over k micro-batches
equals the one-micro-batch update.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_lightning.testing import free_port

WORKER = Path(__file__).with_name("_deepspeed_worker.py")


def _update(ckpt, tmp_path, micro: int) -> dict[str, torch.Tensor]:
    out = tmp_path / f"delta{micro}.pt"
    env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent), MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(ckpt), str(out), str(micro)],
        env=env, capture_output=True, text=True, timeout=600,  # the first one JIT-builds DeepSpeed's shm op
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.timeout(900)
def test_zero2_micro_batches_give_the_same_update(tiny_checkpoint, tmp_path):
    pytest.importorskip("deepspeed")
    one = _update(tiny_checkpoint, tmp_path, 16)
    many = _update(tiny_checkpoint, tmp_path, 3)
    scale = max(float(v.abs().max()) for v in one.values())
    assert scale > 0
    diff = max(float((one[k] - many[k]).abs().max()) for k in one)
    assert diff / scale <= 1e-5
