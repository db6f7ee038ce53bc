"""The quickstart: its warm-up checkpoint, a 2-update run of ``configs/quickstart.yaml`` through
the real CLI (``benchmarks/quickstart_curve.py --quick``), and (slow) the learning target of
issue 8 for one seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.data.arithmetic import make_arithmetic_rows
from dapo_lightning.testing import make_quickstart_checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import quickstart_curve  # noqa: E402


def _answer_probs(path: Path, rows: list[dict]) -> tuple[float, float]:
    """Mean probability the checkpoint gives (teacher-forced) to the exact answer + EOS, and to
    a wrong answer far from the truth (truth + 7)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def prob(prompt: str, answer: str) -> float:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        tgt = ids[0, 1:]
        lp = logp.gather(-1, tgt[:, None]).squeeze(-1)[len(p) - 1 :]
        return float(lp.sum().exp())

    right = sum(prob(r["prompt"], r["answer"]) for r in rows) / len(rows)
    far = sum(prob(r["prompt"], str(int(r["answer"]) + 7)) for r in rows) / len(rows)
    return right, far


@pytest.mark.slow  # ~40 s with 2 cores shared with other jobs
def test_quickstart_checkpoint_learns_the_answer_window(tmp_path):
    """The warm-up puts mass near the true answer (noise window) but far from certainty."""
    path = make_quickstart_checkpoint(tmp_path / "m", seed=0, steps=150, batch_size=64, lr=3e-3)
    rows = make_arithmetic_rows(100, level=1, seed=0)[:20]
    right, far = _answer_probs(path, rows)
    assert 0.02 < right < 0.5, right  # near the answer, not the answer
    assert far < right / 3, (far, right)  # outside the noise window: much less likely


def test_quickstart_checkpoint_rejects_negative_noise(tmp_path):
    with pytest.raises(ValueError, match="noise"):
        make_quickstart_checkpoint(tmp_path / "m", noise=-1)


def test_quickstart_config_runs_two_updates(tmp_path, monkeypatch):
    """configs/quickstart.yaml through the real CLI for 2 updates, val/acc logged at the sanity
    check and after each update, with wall-clock times. The checkpoint is a short warm-up made
    here (the default one takes 20 s to minutes on 2 shared cores)."""
    model_dir = make_quickstart_checkpoint(tmp_path / "model", seed=0, steps=30)
    monkeypatch.setattr(quickstart_curve, "out_dir", lambda: tmp_path)
    (result,) = quickstart_curve.main(["--quick", "--seeds", "0", "--model-dir", str(model_dir)])
    run_dir = Path(result["run_dir"])
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert result["initial"] is not None and 0.0 <= result["initial"] <= 1.0
    assert [u for u, _, _ in result["curve"]] == [1, 2]
    assert all(w is not None and w > 0 for _, _, w in result["curve"])
    assert (tmp_path / "quickstart_curve_quick.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_reaches_target_within_budget(tmp_path, monkeypatch):
    """Issue 8: the untrained model scores <= 0.2 val/acc and the quickstart lifts it to >= 0.9
    within 5 minutes (seed 0). NOT MET by the current calibration (see the config header)."""
    monkeypatch.setattr(quickstart_curve, "out_dir", lambda: tmp_path)
    (result,) = quickstart_curve.main(["--seeds", "0"])
    assert result["initial"] <= 0.2
    assert result["seconds_to_target"] is not None, result["curve"]
    assert result["seconds_to_target"] <= quickstart_curve.BUDGET_S
