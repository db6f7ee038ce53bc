"""``dapo-lightning plot RUN_DIR`` on the CSV of a real (tiny, 2-update) fit, and on synthetic
CSVLogger files: every ``val/pass@k``, coinciding reward lines, the learning-rate and tokens/s
panels, and the ``version_*`` folders of a resumed run merged in step order."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _module_harness import NUM_GROUPS, FixedBatches, fixed_batch
from lightning.pytorch.loggers import CSVLogger

from dapo_lightning import BatchingConfig, DAPOModule
from dapo_lightning.plot import (
    PANELS,
    draw_run,
    find_metrics_csv,
    find_metrics_csvs,
    merge_versions,
    missing_panels,
    panel_coverage,
    plot_main,
    plot_run,
    read_metrics,
    read_run_metrics,
)
from tests._harness import check, fit, fit_cli, run_cli, write_run_config


def _cli(*args: str) -> subprocess.CompletedProcess:
    return check(run_cli(*args))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A finished 2-update quickstart fit on the tiny random model, all paths in a tmp dir."""
    root = tmp_path_factory.mktemp("plot")
    run_dir = root / "run"
    trainer = {
        "default_root_dir": str(run_dir),
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "logs"},
        },
        "callbacks": [
            {
                "class_path": "dapo_lightning.callbacks.OverlongRewardShaping",
                "init_args": {"buffer_length": 2},
            }
        ],
        "enable_checkpointing": False,
    }
    override = write_run_config(
        root / "override.yaml", run_dir, tiny_checkpoint, create_model_if_missing=None,
        trainer=trainer,
    )  # fmt: skip
    fit_cli(override)
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
    assert len(data) > 30_000  # eleven drawn panels, not a blank canvas


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


# ------------------------------------------------------------------ synthetic CSVLogger files


def _write_csv(path: Path, rows: list[dict[str, float]]) -> Path:
    """A CSVLogger-style file: ``epoch,step,<metrics>``, empty cells where a row lacks one."""
    keys = sorted({k for r in rows for k in r} - {"step"})
    lines = [",".join(["epoch", "step", *keys])]
    for r in rows:
        cells = ["0", str(int(r["step"]))] + [str(r[k]) if k in r else "" for k in keys]
        lines.append(",".join(cells))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _lines(fig, title: str) -> dict[str, object]:
    (ax,) = [a for a in fig.axes if a.get_title() == title]
    return {line.get_label(): line for line in ax.get_lines()}


def test_every_pass_at_k_is_plotted(tmp_path):
    rows = [
        {"step": s, "val/acc": 0.1 * s, "val/pass@16": 0.2 * s, "val/pass@4": 0.15 * s}
        for s in range(3)
    ]
    series = read_metrics(_write_csv(tmp_path / "metrics.csv", rows))
    assert panel_coverage(series)["validation accuracy"] == [
        "val/acc",
        "val/pass@4",
        "val/pass@16",
    ]
    lines = _lines(draw_run(series), "validation accuracy")
    assert list(lines) == ["val/acc", "val/pass@4", "val/pass@16"]
    assert list(lines["val/pass@16"].get_ydata()) == pytest.approx([0.0, 0.2, 0.4])


def test_coinciding_reward_lines_both_show(tmp_path):
    """Without reward shaping the reward equals the score: the later line is drawn thinner and
    dashed, on top of the first, so both stay visible."""
    rows = [
        {"step": s, "rollout/reward_mean": -0.5 + 0.1 * s, "rollout/score_mean": -0.5 + 0.1 * s}
        for s in range(4)
    ]
    lines = _lines(draw_run(read_metrics(_write_csv(tmp_path / "m.csv", rows))),
                   "rollout reward / accuracy")  # fmt: skip
    reward, score = lines["rollout/reward_mean"], lines["rollout/score_mean"]
    assert list(reward.get_ydata()) == list(score.get_ydata())
    assert reward.get_linestyle() != score.get_linestyle()
    assert reward.get_linewidth() > score.get_linewidth()
    assert list(lines).index("rollout/score_mean") > list(lines).index("rollout/reward_mean")


def test_learning_rate_and_tokens_per_second_panels(tmp_path):
    rows = [{"step": s, "update/lr": 1e-6 * min(1, s / 2), "rollout/tokens_per_second": 900.0 + s}
            for s in range(1, 4)]  # fmt: skip
    series = read_metrics(_write_csv(tmp_path / "m.csv", rows))
    fig = draw_run(series)
    assert list(_lines(fig, "learning rate")["update/lr"].get_ydata()) == pytest.approx(
        [5e-7, 1e-6, 1e-6]
    )
    assert list(_lines(fig, "tokens per second")) == ["rollout/tokens_per_second"]
    assert "learning rate" not in missing_panels(series)
    assert "gradient norm" in missing_panels(series)


def _resumed_run(run: Path) -> Path:
    """version_0 logged steps 1-6 and died; the resume (version_1) restarted from the step-3
    checkpoint and logged 4-8; a stray second resume, version_10, logged 9-10 (sorts after
    version_1 numerically, before it as text)."""
    _write_csv(
        run / "version_0" / "metrics.csv",
        [{"step": s, "rollout/acc": 0.0, "val/acc": 0.0} for s in range(1, 7)],
    )
    _write_csv(
        run / "version_1" / "metrics.csv", [{"step": s, "rollout/acc": 0.5} for s in range(4, 9)]
    )
    _write_csv(run / "version_10" / "metrics.csv",
               [{"step": s, "rollout/acc": 1.0} for s in range(9, 11)])  # fmt: skip
    return run


def test_versions_of_a_resumed_run_merge_in_step_order(tmp_path):
    run = _resumed_run(tmp_path / "logs")
    files = find_metrics_csvs(run)
    assert [p.parent.name for p in files] == ["version_0", "version_1", "version_10"]
    assert find_metrics_csv(run) == files[-1]
    series = read_run_metrics(run)
    assert series["rollout/acc"] == [(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)] + [
        (float(s), 0.5) for s in range(4, 9)
    ] + [(9.0, 1.0), (10.0, 1.0)]
    # version_0's val/acc after the restart point is superseded too
    assert [s for s, _ in series["val/acc"]] == [1.0, 2.0, 3.0]
    # the run folder above the logs works as well
    assert read_run_metrics(tmp_path) == series
    assert merge_versions([read_metrics(p) for p in files]) == series


def test_plot_of_a_resumed_run_draws_all_versions(tmp_path, capsys):
    run = _resumed_run(tmp_path / "logs")
    fig = draw_run(read_run_metrics(run))
    xs = list(_lines(fig, "rollout reward / accuracy")["rollout/acc"].get_xdata())
    assert xs == [float(s) for s in range(1, 11)]
    plot_main([str(run)])
    assert capsys.readouterr().out.strip() == str(run / "metrics.png")
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_newest_run_is_taken_from_a_folder_of_runs(tmp_path):
    old = _write_csv(tmp_path / "a" / "logs" / "version_0" / "metrics.csv",
                     [{"step": 1, "val/acc": 0.1}])  # fmt: skip
    new = _write_csv(tmp_path / "b" / "logs" / "version_0" / "metrics.csv",
                     [{"step": 1, "val/acc": 0.9}])  # fmt: skip
    os.utime(old, (1, 1))
    assert find_metrics_csvs(tmp_path) == [new]
    assert read_run_metrics(tmp_path)["val/acc"] == [(1.0, 0.9)]


def test_rollout_metrics_follow_the_update_count_with_mini_batches(tiny_checkpoint, tmp_path):
    """2 updates per rollout step: update/* land at global_step (1..6) and rollout/* at
    updates done - 1 (1, 3, 5), the x axis of the plot, as with one update per step
    (Lightning's own logging step counts rollout steps: 0, 1, 2)."""
    batching = BatchingConfig(mini_batch_size=NUM_GROUPS // 2, micro_batch_size=8)
    module = DAPOModule(str(tiny_checkpoint), batching=batching, parity_check_every=0)
    fit(module, FixedBatches(fixed_batch(0), steps=3), logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1, num_sanity_val_steps=0)  # fmt: skip
    series = read_run_metrics(tmp_path / "logs")
    assert [s for s, _ in series["update/loss"]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [s for s, _ in series["rollout/step"]] == [1.0, 3.0, 5.0]
    assert [v for _, v in series["rollout/step"]] == [1.0, 2.0, 3.0]
