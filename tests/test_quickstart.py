"""The quickstart: its warm-up checkpoint, a 2-update run of ``configs/quickstart.yaml`` through
the real CLI (``benchmarks/quickstart_curve.py --quick``), and (slow) the learning target of
issue 8 for one seed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.tasks import arithmetic_warmup
from dapo_lightning.tasks.arithmetic import make_arithmetic_rows
from dapo_lightning.tasks.arithmetic_warmup import (
    make_quickstart_checkpoint,
    quickstart_answer_distribution,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import quickstart_curve  # noqa: E402


def _answer_prob(model, tok, prompt: str, answer: str) -> float:
    """Probability the checkpoint gives (teacher-forced) to ``answer`` + EOS after ``prompt``."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p + a])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    return float(logp[len(p) - 1 :].gather(-1, ids[0, len(p) :, None]).sum().exp())


def test_answer_distribution_sums_to_one_and_puts_the_stated_mass_on_each_kind():
    dist = dict(quickstart_answer_distribution(7, noise=2, exact_frac=0.06, hedge_frac=0.84))
    assert sum(dist.values()) == pytest.approx(1.0)
    assert dist["~7"] == pytest.approx(0.84)
    assert dist["7"] == pytest.approx(0.06 + 0.10 / 5)
    assert set(dist) == {"~7", "5", "6", "7", "8", "9"}
    clipped = dict(quickstart_answer_distribution(0, noise=2, exact_frac=0.0, hedge_frac=0.5))
    assert set(clipped) == {"~0", "0", "1", "2"}  # no negative near misses for a sum of 0
    assert sum(clipped.values()) == pytest.approx(1.0)


@pytest.mark.slow  # ~30 s on 2 idle cores
def test_quickstart_checkpoint_knows_the_sums_but_hedges(tmp_path):
    """The warm-up's model gives the right digits most of its mass, mostly with the hedge mark the
    strict reward rejects: the bare right answer stays well under 0.2 on held-out and trained
    problems alike, and a number far from the sum is much less likely still."""
    path = make_quickstart_checkpoint(tmp_path / "m", seed=0, task_seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = make_arithmetic_rows(100, level=1, seed=0)
    hedged = [_answer_prob(model, tok, r["prompt"], "~" + r["answer"]) for r in rows]
    bare = [_answer_prob(model, tok, r["prompt"], r["answer"]) for r in rows]
    far = [_answer_prob(model, tok, r["prompt"], str(int(r["answer"]) + 7)) for r in rows]
    assert sum(hedged) / 100 > 0.5
    assert 0.03 < sum(bare) / 100 < 0.2
    assert sum(far) / 100 < 0.01


def test_warmup_progress_estimates_from_the_measured_rate(monkeypatch):
    clock = iter(float(t) for t in [0, *range(2, 202, 2)])  # start, then 2 s per step
    monkeypatch.setattr(arithmetic_warmup.time, "monotonic", lambda: next(clock))
    lines: list[str] = []
    progress = arithmetic_warmup.WarmupProgress(100, lines.append, every_s=60.0)
    for _ in range(100):
        progress.step()
    # step 10 at 20 s: 0.5 steps/s, 90 steps left = 180 s; then every 60 s; then done
    assert lines == [
        "warm-up step 10/100 (0.5 steps/s): about 3 min 0 s left",
        "warm-up step 40/100 (0.5 steps/s): about 2 min 0 s left",
        "warm-up step 70/100 (0.5 steps/s): about 1 min 0 s left",
        "warm-up step 100/100 (0.5 steps/s): done",
    ]


def test_quickstart_checkpoint_reports_its_progress(tmp_path):
    lines: list[str] = []
    make_quickstart_checkpoint(tmp_path / "m", sums_steps=4, steps=8, report=lines.append)
    # a line at step 10 at the latest (sooner on a slow machine: every 10 s), then at the end
    pattern = r"warm-up step (\d+)/12 \(\d+\.\d steps/s\): (about (?:\d+ min )?\d+ s left|done)"
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches) and len(lines) >= 2, lines
    assert int(matches[0][1]) <= 10 and matches[0][2].endswith("left")
    assert lines[-1].startswith("warm-up step 12/12 (") and lines[-1].endswith("): done")


def test_quickstart_checkpoint_rejects_bad_fractions(tmp_path):
    with pytest.raises(ValueError, match="noise"):
        make_quickstart_checkpoint(tmp_path / "m", noise=-1)
    with pytest.raises(ValueError, match="exact_frac \\+ hedge_frac"):
        make_quickstart_checkpoint(tmp_path / "m", exact_frac=0.5, hedge_frac=0.6)


def test_quickstart_config_runs_two_updates(tmp_path, monkeypatch):
    """configs/quickstart.yaml through the real CLI for 2 updates (one rollout step: mini-batches
    of 8 of its 16 groups), val/acc logged at the sanity check and after the step, with
    wall-clock times. The checkpoint is a short warm-up made
    here: short, but long enough that some samples are bare right answers (with none, every group
    is filtered and dynamic sampling gives up); the default warm-up takes ~20-40 s."""
    model_dir = make_quickstart_checkpoint(tmp_path / "model", seed=0, sums_steps=100, steps=30)
    monkeypatch.setattr(quickstart_curve, "out_dir", lambda: tmp_path)
    (result,) = quickstart_curve.main(["--quick", "--seeds", "0", "--model-dir", str(model_dir)])
    run_dir = Path(result["run_dir"])
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert result["initial"] is not None and 0.0 <= result["initial"] <= 1.0
    assert [u for u, _, _ in result["curve"]] == [2]
    assert all(w is not None and w > 0 for _, _, w in result["curve"])
    assert (tmp_path / "quickstart_curve_quick.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_reaches_target_within_budget(tmp_path, monkeypatch):
    """Issue 8: the untrained model scores <= 0.2 val/acc and the quickstart lifts it to >= 0.9
    within 5 minutes (seed 0; benchmarks/quickstart_curve.py measures seeds 0 1 2)."""
    monkeypatch.setattr(quickstart_curve, "out_dir", lambda: tmp_path)
    (result,) = quickstart_curve.main(["--seeds", "0"])
    assert result["initial"] <= 0.2
    assert result["seconds_to_target"] is not None, result["curve"]
    assert result["seconds_to_target"] <= quickstart_curve.BUDGET_S
