"""``dapo-lightning plot RUN_DIR`` on the CSV of a real (tiny, 2-update) fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_lightning.plot import (
    PANELS,
    find_metrics_csv,
    missing_panels,
    panel_coverage,
    plot_main,
    plot_run,
    read_metrics,
)

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "dapo-lightning")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [CLI, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-update quickstart fit on the tiny random model, all paths in a tmp dir."""
    root = tmp_path_factory.mktemp("plot")
    run_dir = root / "run"
    override = root / "override.yaml"
    override.write_text(
        f"""
trainer:
  default_root_dir: {run_dir}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {run_dir}, name: logs}}
  callbacks:
    - class_path: dapo_lightning.callbacks.OverlongRewardShaping
      init_args: {{buffer_length: 2}}
  enable_checkpointing: false
model:
  init_args:
    model_name_or_path: {root / "model"}
data:
  init_args:
    train_batch_size: 4
    gen_batch_size: 4
    n: 4
    max_response_length: 4
    filter_metric: null   # the random model never answers right: no group would be kept
"""
    )
    _cli(
        "fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(override),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "1",
        "--create_model_if_missing", "tiny",
    )  # fmt: skip
    return run_dir


def test_every_panel_gets_a_series_from_a_real_run(finished_run):
    series = read_metrics(find_metrics_csv(finished_run))
    assert missing_panels(series) == {}, (
        f"panels without any logged metric: {missing_panels(series)}"
    )
    coverage = panel_coverage(series)
    assert [title for title, _ in PANELS] == list(coverage)
    for title, names in coverage.items():
        assert names, title
        assert all(len(series[n]) >= 1 for n in names)


def test_plot_command_writes_png(finished_run):
    proc = _cli("plot", str(finished_run))
    png = finished_run / "metrics.png"
    assert proc.stdout.strip().endswith(str(png))
    assert "none of" not in proc.stderr  # no empty panel reported
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000  # nine drawn panels, not a blank canvas


def test_plot_reports_missing_metrics(finished_run, tmp_path, capsys):
    """A CSV lacking a panel's metrics still plots; the command names the empty panel."""
    csv_path = find_metrics_csv(finished_run)
    lines = csv_path.read_text().splitlines()
    header = lines[0].split(",")
    keep = [i for i, name in enumerate(header) if not name.startswith("update/grad_norm")]
    trimmed = tmp_path / "metrics.csv"
    trimmed.write_text("\n".join(",".join(row.split(",")[i] for i in keep) for row in lines) + "\n")
    series = read_metrics(trimmed)
    assert list(missing_panels(series)) == ["gradient norm"]
    plot_main([str(trimmed), "--out", str(tmp_path / "p.png")])  # in process: the CLI's code path
    assert (
        "panel 'gradient norm': none of ['update/grad_norm'] was logged" in capsys.readouterr().err
    )
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert plot_run(trimmed) == tmp_path / "metrics.png"  # beside the CSV
    assert (tmp_path / "metrics.png").is_file()


def test_plot_without_metrics_explains(tmp_path):
    with pytest.raises(FileNotFoundError, match="No metrics.csv under"):
        find_metrics_csv(tmp_path)
