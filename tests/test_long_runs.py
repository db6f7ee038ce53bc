"""Long multi-rank runs as users make them (issue 53): the README's 2-rank command lines, run as
shown on the quickstart for 200 updates, reach its EarlyStopping target; a SIGTERM mid-run and
a resume end where the uninterrupted run ends; the periodic checkpoints fire at every crossing
of ``every_n_train_steps``; a rank killed with SIGKILL ends the run within 60 s, naming it.

Each run is the real console script under Lightning's own launcher (2 gloo processes), on the
quickstart's warmed-up model written once for the module. ``SEED`` is a seed on which the
2-rank quickstart takes 200 updates to reach 0.9 (seed 0 takes 80): long enough to meet what
the short tests did not (the rank-dependent metric of issue 53 crashed such runs at update ~12).
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
from tests._harness import CLI, QUICKSTART, REPO, cli_env
from tests._save_recorder import saved_updates

pytestmark = [pytest.mark.distributed]

SEED = 2
EVERY = 20  # configs/quickstart.yaml: ModelCheckpoint every_n_train_steps
#: The README's 2-rank lines (after `fit --config configs/quickstart.yaml`), and their
#: one-step-off variant (FSDP2 with one-step-off is refused by design: docs/sampling.md).
COMMANDS = {
    "ddp": ["--trainer.devices", "2", "--trainer.strategy", "ddp"],
    "fsdp2": ["--config", "configs/fsdp2_cpu_2ranks.yaml"],
    "ddp_one_step_off": [
        "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--config", "configs/one_step_off.yaml",
    ],
}  # fmt: skip
#: The update after which each command line gets its SIGTERM: at a validation and a periodic
#: save (100), inside a rollout step's updates (107), between two steps (112).
STOP_AT = {"ddp": 100, "fsdp2": 107, "ddp_one_step_off": 112}
#: metrics.csv columns that measure time, not behaviour.
TIMING = re.compile(r"seconds|per_second|^time/")


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's warmed-up model (what `create_model_if_missing` writes for seed 0)."""
    return make_quickstart_checkpoint(tmp_path_factory.mktemp("quickstart") / "model")


def start(run: Path, model: Path, mode: str, *extra: str) -> subprocess.Popen:
    """The README's command line of ``mode`` in ``run`` on ``model``, a callback recording each
    save appended; output to ``run/out-<n>.log``; its own session (the test signals it whole)."""
    run.mkdir(parents=True, exist_ok=True)
    log = run / f"out-{len(list(run.glob('out-*.log')))}.log"
    args = [
        CLI, "fit", "--config", QUICKSTART, *COMMANDS[mode], "--seed_everything", str(SEED),
        "--trainer.default_root_dir", str(run), "--model.init_args.model_name_or_path", str(model),
        "--trainer.callbacks+=_save_recorder.SaveRecorder", *extra,
    ]  # fmt: skip
    env = cli_env({"DAPO_TEST_SAVES": str(run / "saves.txt")})
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> str:
    return Path(proc.log).read_text()  # type: ignore[attr-defined]


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    """Wait for ``proc`` (and kill its session on a timeout); its exit code and output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"no exit within {timeout} s:\n{output(proc)[-3000:]}")
    return proc.returncode, output(proc)


def wait_for_update(proc: subprocess.Popen, update: int, timeout: float = 300) -> int:
    """Block until the progress lines report ``update`` or later; returns the update seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = [int(u) for u in re.findall(r"update (\d+)/", output(proc))]
        if seen and max(seen) >= update:
            return max(seen)
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before update {update}:\n{output(proc)[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"update {update} not reached in {timeout} s:\n{output(proc)[-3000:]}")


def final_update(text: str) -> int:
    return int(re.search(r"updates:\s+(\d+)/", text).group(1))


def metrics_by_step(run: Path) -> dict[tuple[int, str], str]:
    """Every non-timing value of every ``metrics.csv`` under ``run/logs`` keyed by (step, name),
    the later file (a resumed run's) winning where both logged a step."""
    out: dict[tuple[int, str], str] = {}
    files = sorted(
        (run / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])
    )
    for path in files:
        for row in csv.DictReader(open(path)):
            for name, value in row.items():
                if value != "" and name != "step" and not TIMING.search(name):
                    out[int(row["step"]), name] = value
    return out


@pytest.fixture(scope="module", params=list(COMMANDS))
def reference(request, quickstart_model: Path, tmp_path_factory) -> tuple[str, Path, str]:
    """The uninterrupted run of each command line: (mode, run folder, output)."""
    mode = request.param
    run = tmp_path_factory.mktemp(f"reference-{mode}")
    code, text = finish(start(run, quickstart_model, mode))
    assert code == 0, text[-4000:]
    return mode, run, text


@pytest.mark.timeout(900)
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


@pytest.mark.timeout(900)
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
    code, text = finish(proc, timeout=120)
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
    assert not differ, differ[:10]


def rank_one(proc: subprocess.Popen, timeout: float = 60) -> psutil.Process:
    """The process of rank 1: the child Lightning's launcher started (LOCAL_RANK=1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if child.environ().get("LOCAL_RANK") == "1":
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    pytest.fail("no rank-1 process found")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_the_run_within_60_s_naming_it(quickstart_model, tmp_path, killed):
    """SIGKILL of one rank after the periodic checkpoint at update 20: the other rank's process
    exits within 60 s (not at a 30-minute collective timeout) with a message naming the dead
    rank, and `--ckpt_path auto` resumes the last periodic checkpoint."""
    proc = start(tmp_path, quickstart_model, "ddp")
    other = rank_one(proc)
    wait_for_update(proc, EVERY + 4)
    victim, survivor = (
        (other, psutil.Process(proc.pid)) if killed == 1 else (psutil.Process(proc.pid), other)
    )
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor.wait(timeout=90)
    assert time.monotonic() - killed_at < 60
    proc.wait(timeout=30)
    text = output(proc)
    line = f"dapo-lightning: error: rank {1 - killed} lost rank {killed} of 2: its connection"
    assert line in text, text[-3000:]
    resumed = start(
        tmp_path, quickstart_model, "ddp", "--ckpt_path", "auto", "--trainer.max_steps", "30"
    )
    code, text = finish(resumed)
    assert code == 0, text[-4000:]
    assert re.search(rf"resum\w* .*update {EVERY}\b", text, re.I), text[-3000:]


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
