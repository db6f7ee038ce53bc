"""SampleLog (issue 65): rollout and validation samples on disk, read back with pandas.

One module-scoped run of ``configs/quickstart.yaml`` through the real CLI (a short warm-up
checkpoint made here, 4 rollout steps, a validation every 2), stopped with SIGTERM once step 2
is on disk and resumed with ``--ckpt_path auto``; the files it leaves are checked against the
run's own metrics.csv. The rest are unit tests of the pure parts.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from dapo_lightning.callbacks import SampleLog, SampleLogConfig
from dapo_lightning.callbacks.sample_files import SampleFile
from dapo_lightning.callbacks.sample_rows import (
    complete_rows,
    mark_trained,
    rollout_rows,
    row_fingerprints,
    step_rows,
)
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.batch import FILTER_DECISION, RESPONSE_TEXT, RolloutBatch, ScoredRollouts
from dapo_lightning.checks import ConfigError
from dapo_lightning.data.sampling.groups import filter_decisions
from dapo_lightning.data.sampling.scoring import RolloutScorer
from dapo_lightning.data.sampling.step_stats import StepStats
from dapo_lightning.envs import EnvironmentConfig, StepResult
from dapo_lightning.envs.runner import EpisodeRunner, ObservationFormatter
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "dapo-lightning")
STEPS = 4  # rollout steps (2 optimizer updates each)
#: The columns docs/samples.md documents.
ROLLOUT_COLUMNS = {
    "step", "group", "sample", "batch_index", "policy_version", "staleness", "prompt_id",
    "prompt", "response", "reward", "score", "shaping", "has_answer", "acc", "advantage",
    "filter", "trained", "in_loss", "truncated", "finish_reason", "length", "tool_calls", "extra",
}  # fmt: skip


def _fit_command(run: Path, *extra: str) -> list[str]:
    return [
        CLI, "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
        "--trainer.default_root_dir", str(run), "--trainer.max_steps", str(2 * STEPS),
        "--trainer.val_check_interval", "2", "--ckpt_path", "auto", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _steps_on_disk(path: Path) -> set[int]:
    if not path.exists():
        return set()
    return set(pd.read_json(path, lines=True)["step"]) if path.stat().st_size else set()


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart for 4 rollout steps: SIGTERM once step 2's samples are written (exit
    143), then resumed to the end (exit 0). Returns the run directory."""
    run = tmp_path_factory.mktemp("samples") / "run"
    make_quickstart_checkpoint(run / "model", seed=0, sums_steps=100, steps=30)
    rollouts = run / "samples" / "rollouts-rank0.jsonl"
    proc = subprocess.Popen(
        _fit_command(run), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if 2 in _steps_on_disk(rollouts):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err.decode()[-3000:]
    done = subprocess.run(_fit_command(run), env=_env(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return run


def _metrics(run: Path) -> pd.DataFrame:
    frames = [pd.read_csv(p) for p in sorted(run.glob("logs/version_*/metrics.csv"))]
    return pd.concat(frames, ignore_index=True)


def test_rollout_samples_hold_each_step_once_and_match_the_logged_metrics(stopped_and_resumed):
    df = pd.read_json(stopped_and_resumed / "samples" / "rollouts-rank0.jsonl", lines=True)
    assert ROLLOUT_COLUMNS <= set(df.columns)
    assert sorted(df["step"].unique()) == list(range(1, STEPS + 1))
    assert not df.duplicated(["step", "group", "sample"]).any()  # no step written twice
    metrics = _metrics(stopped_and_resumed).dropna(subset=["rollout/step"])
    assert sorted(metrics["rollout/step"]) == list(range(1, STEPS + 1))  # each step logged once
    trained = df[df["trained"]]
    for _, m in metrics.iterrows():
        rows = trained[trained["step"] == int(m["rollout/step"])]
        assert len(rows) == 16 * 16  # train_batch_size groups of n
        assert rows["reward"].mean() == pytest.approx(m["rollout/reward_mean"], abs=1e-6)
        assert rows["acc"].mean() == pytest.approx(m["rollout/acc"], abs=1e-6)
        assert rows["staleness"].mean() == pytest.approx(m["data/staleness_mean"], abs=1e-6)
        assert rows["length"].mean() == pytest.approx(m["rollout/response_length_mean"], abs=1e-4)
    # GRPO: a trained group's advantages sum to 0 and follow its rewards; others have none
    for _, group in trained.groupby(["step", "group"]):
        assert group["advantage"].sum() == pytest.approx(0.0, abs=1e-4)
        assert group["filter"].eq("kept").all() and group["reward"].nunique() > 1
        best = group.loc[group["reward"].idxmax()]
        assert best["advantage"] == group["advantage"].max()
    assert df.loc[~df["trained"], "advantage"].isna().all()
    assert set(df["filter"]) <= {"kept", "dropped: acc all 0", "dropped: acc all 1"}
    dropped = df[df["filter"] != "kept"]
    assert (dropped["acc"] == dropped["filter"].str.endswith("1").astype(float)).all()
    # the text the reward scored: a bare right answer scores 1, a hedge ("~7") does not
    assert df["response"].map(type).eq(str).all() and df["prompt"].str.endswith("=").all()
    assert (df.loc[df["acc"] == 1.0, "score"] == 1.0).all()
    assert df.loc[df["response"].str.contains("~"), "acc"].eq(0.0).all()
    assert (df["shaping"] == df["reward"] - df["score"]).all()
    assert df.groupby("step")["group"].nunique().max() <= 24  # quickstart.yaml's max_groups


def test_the_documented_pandas_line_reads_the_run_files(stopped_and_resumed):
    """docs/samples.md's one line, on this run's files (the quickstart's layout)."""
    line = 'df = pd.read_json("runs/quickstart/samples/rollouts-rank0.jsonl", lines=True)'
    assert line in (REPO / "docs" / "samples.md").read_text()
    path = line.split('"')[1].replace("runs/quickstart", str(stopped_and_resumed))
    df = pd.read_json(path, lines=True)
    assert len(df) > 0 and df["response"].notna().all()


def test_validation_samples_carry_correctness_and_match_val_acc(stopped_and_resumed):
    val = pd.read_json(stopped_and_resumed / "samples" / "validation-rank0.jsonl", lines=True)
    assert {0, STEPS} <= set(val["step"])  # ValidateAtStart, and after the last step
    logged = _metrics(stopped_and_resumed)["val/acc"].dropna().tolist()
    for step, rows in val.groupby("step"):
        assert len(rows) == 20 * 16  # 20 held-out prompts, n=16
        assert not rows.duplicated(["group", "sample"]).any()
        assert any(math.isclose(rows["acc"].mean(), v, abs_tol=1e-6) for v in logged), step
        assert set(rows["acc"]) <= {0.0, 1.0}


# ------------------------------------------------------------------------------- pure parts
def _rollouts(responses: list[list[int]], acc: list[float], n: int = 2) -> ScoredRollouts:
    groups = [i // n for i in range(len(responses))]
    prompts = [[5 + g] * (1 + g) for g in groups]
    r = ScoredRollouts(
        prompt_ids=prompts, response_ids=responses,
        rollout_log_probs=[[-0.5] * len(x) for x in responses],
        finish_reason=["stop"] * len(responses), group_index=torch.tensor(groups),
        prompt_uid=[f"p{g}" for g in groups], score=torch.tensor(acc) * 2 - 1,
        acc=torch.tensor(acc), sampling=SamplingConfig(max_tokens=8),
    )  # fmt: skip
    r.extra[RESPONSE_TEXT] = [" ".join(map(str, x)) for x in responses]
    keep = torch.tensor([len(set(acc[g * n : g * n + n])) > 1 for g in range(len(acc) // n)])
    r.extra[FILTER_DECISION] = filter_decisions(r.acc, r.group_index, keep, "acc")
    return r


def test_fingerprints_find_the_trained_rows_whatever_the_padding():
    r = _rollouts([[1, 2, 3], [4], [9, 9], [9, 9, 9, 9, 9], [7], [7]], [1, 0, 0, 1, 1, 1])
    rows = rollout_rows(r, round_id=1)
    assert [row["filter"] for row in rows] == ["kept"] * 4 + ["dropped: acc all 1"] * 2
    batch = RolloutBatch.from_rollouts(r.select([2, 3, 0, 1]), group_size=2, pad_token_id=3)
    keys = row_fingerprints(batch.input_ids, batch.attention_mask, batch.response_width)
    mark_trained(rows, keys.tolist(), [0.5, -0.5, 1.0, -1.0], version=3)
    assert [row["advantage"] for row in rows] == [1.0, -1.0, 0.5, -0.5, None, None]
    assert [row["staleness"] for row in rows[:4]] == [3] * 4
    out = step_rows(rows, step=7, max_groups=2)
    assert [(o["step"], o["group"], o["sample"]) for o in out] == [
        (7, 0, 0), (7, 0, 1), (7, 1, 0), (7, 1, 1),
    ]  # fmt: skip
    assert not any(k.startswith("#") for o in out for k in o)
    assert len(rollout_rows(r, round_id=2, dropped=False)) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("every_n_steps", 0), ("max_groups", 0), ("logger_samples", -1), ("dropped", "yes")],
)
def test_a_bad_setting_names_its_field(field, value):
    with pytest.raises(ConfigError, match=f"SampleLog.settings.{field}"):
        SampleLogConfig(**{field: value})
    with pytest.raises(ConfigError, match=f"SampleLog.settings.{field}"):
        SampleLog({field: value})


def test_a_bad_setting_is_one_error_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  callbacks:\n    - class_path: dapo_lightning.callbacks.SampleLog\n"
        "      init_args:\n        settings:\n          every_n_steps: 0\n"
    )
    cmd = [CLI, "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
           "--config", str(bad), "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "every_n_steps" in errors[0], proc.stderr[-3000:]


def test_an_unwritable_folder_or_a_full_disk_warns_once_and_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        unwritable = SampleFile(blocker / "samples" / "rollouts-rank0.jsonl")  # not a folder
        unwritable.append([{"step": 1}])
        unwritable.append([{"step": 2}])
        full = SampleFile(Path("/dev/full"))
        full.append([{"step": 1}])
        full.append([{"step": 2}])
    warnings = [
        r.getMessage() for r in caplog.records if "SampleLog: cannot write" in r.getMessage()
    ]
    assert len(warnings) == 2 and unwritable.failed and full.failed
    assert "No space left" in warnings[1] and "\n" not in warnings[0]


def test_a_resumed_file_is_cut_back_to_the_restored_step(tmp_path):
    file = SampleFile(tmp_path / "rollouts-rank0.jsonl")
    file.append([{"step": s, "group": 0} for s in (1, 2, 3)])
    with open(file.path, "a") as f:
        f.write('{"step": 4, "gro')  # a killed writer's torn line
    assert [r["step"] for r in file.keep_only(lambda r: r["step"] <= 2)] == [1, 2]
    file.append([{"step": 3, "group": 1}])
    assert pd.read_json(file.path, lines=True)["step"].tolist() == [1, 2, 3]


def test_tensorboard_shows_samples_and_an_unwritable_folder_only_warns(tmp_path):
    """The quickstart with ``--trainer.logger lightning.pytorch.loggers.TensorBoardLogger`` (one
    rollout step) and SampleLog's folder under a regular file: one warning line, the run ends
    normally, and the event file holds the scalars and the samples as text."""
    run = tmp_path / "run"
    make_quickstart_checkpoint(run / "model", seed=0, sums_steps=100, steps=30)
    (tmp_path / "a-file").write_text("")
    override = tmp_path / "override.yaml"
    override.write_text(
        "trainer:\n  callbacks:\n    - class_path: dapo_lightning.callbacks.SampleLog\n"
        f"      init_args:\n        settings:\n          dir: {tmp_path / 'a-file' / 'samples'}\n"
    )
    cmd = [*_fit_command(run, "--config", str(override)), "--trainer.max_steps", "2",
           "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "SampleLog: cannot write" in line]
    assert len(warned) == 1, proc.stderr[-3000:]
    (events,) = run.glob("logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("rollout/step")] == [1.0]
    (text,) = acc.Tensors("samples/rollouts/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 1 and table.startswith("| prompt | response | reward | acc |")
    assert len(table.splitlines()) == 2 + 4  # header, rule, logger_samples rows
    assert "| kept |" in table and "=" in table.splitlines()[2]


# ----------------------------------------------------------------------------- the inspector
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("DAPO_REQUIRE_CHROMIUM") != "1",
    reason="chromium missing: bash scripts/setup.sh installs it (CI sets DAPO_REQUIRE_CHROMIUM=1)",
)


def _chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None, "chromium is not installed (scripts/setup.sh installs it)"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--virtual-time-budget=5000", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _shown(page: Path, fragment: str) -> int:
    """The number of samples the page shows at ``page#fragment``, read from the DOM a real
    browser built (the page's script ran)."""
    dom = _chromium("--dump-dom", f"{page.as_uri()}#{fragment}").stdout
    match = re.search(r'<span id="count">(\d+)</span>', dom)
    assert match, dom[-2000:]
    return int(match.group(1))


@needs_chromium
def test_the_inspector_page_loads_filters_and_draws_in_a_real_browser(stopped_and_resumed):
    out = subprocess.run([CLI, "inspect", str(stopped_and_resumed)], capture_output=True,
                         text=True, timeout=120, env=_env())  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    page = Path(out.stdout.strip().splitlines()[-1])
    assert page == stopped_and_resumed / "samples.html"
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained: no network
    df = pd.read_json(stopped_and_resumed / "samples" / "rollouts-rank0.jsonl", lines=True)
    step1 = df[df["step"] == 1]
    assert _shown(page, "step=1") == len(step1)
    assert _shown(page, "step=1&show=dropped") == (step1["filter"] != "kept").sum()
    assert (
        _shown(page, "step=1&show=kept,right")
        == ((step1["filter"] == "kept") & (step1["acc"] == 1.0)).sum()
    )
    val = pd.read_json(stopped_and_resumed / "samples" / "validation-rank0.jsonl", lines=True)
    assert (
        _shown(page, "source=validation&step=0&show=right")
        == ((val["step"] == 0) & (val["acc"] == 1.0)).sum()
    )
    shot = page.with_suffix(".png")
    _chromium(f"--screenshot={shot}", "--window-size=1200,800", f"{page.as_uri()}#step=1")
    image = Image.open(shot).convert("L")
    assert image.size == (1200, 800)
    assert len(set(image.getdata())) > 8  # text and cards drawn, not a blank page


def test_inspect_without_sample_files_is_one_error_line(tmp_path):
    out = subprocess.run([CLI, "inspect", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=_env())  # fmt: skip
    assert out.returncode == 2
    assert [line for line in out.stderr.splitlines() if "error:" in line] == [out.stderr.strip()]


class _TwoTurns:
    """An environment answering the first turn with ``obs 7``, done after the second."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, record: PromptRecord) -> None:
        self.record = record

    def step(self, text: str) -> StepResult:
        self.seen += 1
        if self.seen >= 2:
            return StepResult(done=True)
        return StepResult(observation="obs 7", tool_calls=1)


class _AnyAnswer:
    """A reward runner stand-in: every response right."""

    reward = None
    last_failures = 0

    def score(self, texts: list[str], answers: list[str], kwargs: list[dict]) -> list:
        return [RewardResult(score=1.0, acc=True) for _ in texts]


def test_an_episode_row_holds_its_whole_exchange(tiny_checkpoint):
    """The scorer keeps each episode's turns and observations as text; its row shows them."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    record = PromptRecord("p0", "What is 3*4?", "12")
    record.prompt_ids = encode_prompt(tok, record.prompt, apply_chat_template=True)
    cfg = EnvironmentConfig(max_turns=3, call_timeout_s=2.0)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    runner = EpisodeRunner(
        HFRolloutEngine(model, tok, seed=0, eos_token_id=[1, *range(100, 190)]), cfg,
        make_env=_TwoTurns, formatter=ObservationFormatter(tok, cfg.observation_role),
        decode=decode, records=[record], max_episode_tokens=400,
    )  # fmt: skip
    sampling = SamplingConfig(max_tokens=40)
    (episodes,) = runner.generate([record.prompt_ids], 2, sampling)
    scorer = RolloutScorer(SimpleNamespace(engine=runner), _AnyAnswer(), decode)
    rollouts = scorer.score_completions([record], [episodes], sampling, 0, StepStats())
    rows = rollout_rows(rollouts, round_id=1)
    complete_rows(rows)
    for row, episode in zip(rows, episodes):
        assert row["tool_calls"] == 1 and row["prompt"] == "What is 3*4?"
        assert row["episode"] == decode(episode.token_ids) and "obs 7" in row["episode"]
        assert row["response"] == episode.text and row["episode"].endswith(episode.text)
    single = _rollouts([[1, 2], [3]], [1, 0])
    (out,) = step_rows(rollout_rows(single, round_id=1)[:1], step=1, max_groups=None)
    assert out["episode"] is None and out["response"] == "1 2" and out["reward"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cost_benchmark_runs_quick():
    """benchmarks/sample_log_cost.py --quick: one 3-step quickstart fit, its table and PNG."""
    png = REPO / "benchmarks" / "out" / "sample_log_cost_quick.png"
    png.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sample_log_cost", "--quick"], cwd=REPO,
        env={**_env(), "PYTHONPATH": str(REPO), "COLUMNS": "200"}, capture_output=True,
        text=True, timeout=850,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cost, share of all steps (%)" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
