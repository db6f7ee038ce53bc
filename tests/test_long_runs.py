"""Long multi-rank runs as users make them (issue 53): the README's 2-rank command lines, run as
shown on the quickstart for 200 updates, reach its EarlyStopping target; a SIGTERM mid-run and
a resume end where the uninterrupted run ends; the periodic checkpoints fire at every crossing
of ``every_n_train_steps``. (A rank killed with SIGKILL: tests/test_rank_loss.py.)

Each run is the real console script under Lightning's own launcher (2 gloo processes), on the
quickstart's warmed-up model written once for the module (the harness: tests/_long_run.py).
``SEED`` is a seed on which the 2-rank quickstart takes 200 updates to reach 0.9 (seed 0 takes
80): long enough to meet what the short tests did not (the rank-dependent metric of issue 53
crashed such runs at update ~12). The README's two lines (DDP, FSDP2) run in CI; their
one-step-off variant, which the README does not show on 2 ranks, runs with ``-m slow``
(``bash scripts/test.sh -m slow tests/test_long_runs.py``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests._harness import REPO
from tests._long_run import (
    COMMANDS,
    EVERY,
    STOP_AT,
    final_update,
    finish,
    metrics_by_step,
    start,
    wait_for_update,
)
from tests._save_recorder import saved_updates

pytestmark = [pytest.mark.distributed]


#: The README's lines in CI; the one-step-off variant (not shown on 2 ranks) with ``-m slow``.
MODES = [
    pytest.param(m, marks=pytest.mark.slow) if m == "ddp_one_step_off" else m for m in COMMANDS
]


@pytest.fixture(scope="module", params=MODES)
def reference(request, quickstart_model: Path, tmp_path_factory) -> tuple[str, Path, str]:
    """The uninterrupted run of each command line: (mode, run folder, output)."""
    mode = request.param
    run = tmp_path_factory.mktemp(f"reference-{mode}")
    code, text = finish(start(run, quickstart_model, mode))
    assert code == 0, text[-4000:]
    return mode, run, text


@pytest.mark.timeout(2400, func_only=True)  # setup: the warm-up and the reference run
def test_each_two_rank_command_trains_to_the_target_with_periodic_saves(reference):
    """Exit 0 at the EarlyStopping target after 100+ updates; a checkpoint at every crossing of
    a multiple of every_n_train_steps (within the rollout step that crosses it), and the
    final one."""
    mode, run, text = reference
    assert "Stopping threshold reached" in text, text[-3000:]
    last = final_update(text)
    assert last >= 100, f"{mode}: only {last} updates: not a long run"
    saves = saved_updates(run / "saves.txt")
    for multiple in range(EVERY, last + 1, EVERY):
        assert any(multiple <= s < multiple + 4 for s in saves), (mode, multiple, saves)
    assert saves[-1] == last


@pytest.mark.timeout(2400, func_only=True)  # setup: the warm-up and the reference run
def test_sigterm_mid_run_and_resume_end_where_the_uninterrupted_run_ends(
    reference, quickstart_model, tmp_path
):
    """SIGTERM to the whole job (as a terminal or a scheduler sends it) at update 100+: exit 143
    with the state saved; `--ckpt_path auto` then ends at the reference's update with every
    non-timing metric of every update equal to the reference's."""
    mode, reference_run, reference_text = reference
    proc = start(tmp_path, quickstart_model, mode)
    wait_for_update(proc, STOP_AT[mode])
    os.killpg(proc.pid, signal.SIGTERM)
    code, text = finish(proc, timeout=120, stall=120)
    assert code == 143, text[-3000:]
    stopped_at = saved_updates(tmp_path / "saves.txt")[-1]
    assert 100 <= stopped_at < final_update(reference_text)
    code, text = finish(start(tmp_path, quickstart_model, mode, "--ckpt_path", "auto"))
    assert code == 0, text[-4000:]
    assert final_update(text) == final_update(reference_text)
    expected, got = metrics_by_step(reference_run), metrics_by_step(tmp_path)
    # a validation the signal interrupted is not repeated on resume (docs/design.md, "Stopping
    # and resuming"): its values at the stop's update may be missing, nothing else
    for key in [k for k in expected if k[0] == stopped_at - 1 and k[1].startswith("val/")]:
        if key not in got:
            del expected[key]
    assert expected.keys() <= got.keys(), sorted(expected.keys() - got.keys())[:10]
    differ = [(k, expected[k], got[k]) for k in expected if got[k] != expected[k]]
    assert not differ, (f"stopped at update {stopped_at}", differ[:10])


def test_every_two_rank_line_of_the_readme_is_run_here():
    """The README's command lines that start 2 ranks are COMMANDS' (so a changed line is run
    long here, not only shown)."""
    shown = []
    for line in (REPO / "README.md").read_text().splitlines():
        line = line.split("#")[0].split()
        two_ranks = "--trainer.devices" in line and line[line.index("--trainer.devices") + 1] == "2"
        if "fit" in line and (two_ranks or any("2ranks" in a for a in line)):
            start_at = line.index("configs/quickstart.yaml") + 1
            shown.append(line[start_at:])
    assert shown, "the README shows no 2-rank line"
    runs = [[a.removeprefix(str(REPO) + "/") for a in args] for args in COMMANDS.values()]
    for args in shown:
        assert args in runs, args
