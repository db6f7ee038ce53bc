"""Issue 63 item 1 through the real console script: two SIGTERMs 0.1-0.2 s apart skipped the
stop's save (exit 143, "the fit had ended at update N", ``last.ckpt`` updates behind, no
"Saved" line). Real signals, a real CLI fit of the tiny model, a real checkpoint."""

from __future__ import annotations

import re

import pytest
import torch

from tests._harness import ARITHMETIC_RUN, run_cli, write_run_config


@pytest.mark.timeout(300)
def test_second_sigterm_and_ctrl_c_inside_the_save_never_cut_it(tiny_checkpoint, tmp_path):
    """A SIGTERM during generation after update 1, then a second SIGTERM, a third 50 ms later
    and a Ctrl-C inside the stop's save: the save finishes, the ``Saved`` line names the update
    that is on disk, the repeats are one ignored line, exit 143 (the first signal's), no
    traceback, no lock left."""
    run = tmp_path / "run"
    config = write_run_config(
        tmp_path / "fit.yaml",
        run,
        tiny_checkpoint,
        base=ARITHMETIC_RUN,
        trainer={
            "max_steps": 6,
            "enable_checkpointing": True,
            "callbacks": [{"class_path": "_signal_callbacks.MoreSignalsDuringTheSave"}],
        },
    )
    proc = run_cli("fit", f"--config={config}", timeout=280)
    err = proc.stderr
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    saved = re.search(r"Saved (\S+) \(saved on SIGTERM, update (\d+)", err)
    assert saved, err[-3000:]
    assert "received while stopping: ignored; the save under way finishes first" in err, err
    assert "Traceback" not in err and "the fit had ended" not in err, err[-3000:]
    on_disk = torch.load(saved.group(1), weights_only=False, map_location="cpu")
    assert on_disk["global_step"] == int(saved.group(2)) >= 1
    assert not (run / ".dapo-run.lock").exists()
