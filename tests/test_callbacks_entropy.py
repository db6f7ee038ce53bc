"""Tests for dapo_lightning.callbacks.entropy: schedules, adaptive controller, resume."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from dapo_lightning.callbacks.entropy import (
    AdaptiveEntropyBand,
    EntropyScheduler,
    adaptive_coef,
    schedule_value,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dapo_lightning.policy_state import PolicyState
from tests._harness import fit


class RecordingModule:
    """Stand-in for the LightningModule in unit tests: the hooks only set the entropy weight
    of its ``policy_state`` and call ``log`` (Lightning refuses ``log`` outside a running loop,
    so this records it)."""

    def __init__(self) -> None:
        self.policy_state = PolicyState(entropy_coef=-1.0)
        self.logged: dict[str, list[float]] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged.setdefault(name, []).append(float(value))


GRID = [0, 5, 10, 15, 20, 30, 60, 110, 200]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # warm-up 10 updates from 0, then 0.1 -> 0.01 between update 10 and 110
        ("constant", [0.0, 0.05, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]),
        ("linear", [0.0, 0.05, 0.1, 0.0955, 0.091, 0.082, 0.055, 0.01, 0.01]),
        (
            "cosine",
            [0.0, 0.05, 0.1]
            + [0.01 + 0.09 * (1 + math.cos(math.pi * p)) / 2 for p in (0.05, 0.1, 0.2, 0.5)]
            + [0.01, 0.01],
        ),
        (
            "exponential",
            [0.0, 0.05, 0.1] + [0.1 * 0.1**p for p in (0.05, 0.1, 0.2, 0.5)] + [0.01, 0.01],
        ),
    ],
)
def test_schedules_hit_their_values_on_a_grid(schedule: str, expected: list[float]) -> None:
    got = [
        schedule_value(
            s, schedule=schedule, start=0.1, end=0.01, total_updates=110, warmup_updates=10
        )
        for s in GRID
    ]
    assert got == pytest.approx(expected, abs=1e-12)


def test_cosine_midpoint_and_exponential_is_geometric() -> None:
    kw = {"start": 0.1, "end": 0.01, "total_updates": 100}
    assert schedule_value(50, schedule="cosine", **kw) == pytest.approx(0.055)
    assert schedule_value(50, schedule="exponential", **kw) == pytest.approx(math.sqrt(0.1 * 0.01))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "linear", "start": 0.1, "end": 0.0}, "needs total_updates"),
        (
            {"schedule": "cosine", "start": 0.1, "total_updates": 5, "warmup_updates": 5},
            "total_updates",
        ),
        (
            {"schedule": "exponential", "start": 0.1, "end": 0.0, "total_updates": 5},
            "start > 0 and end > 0",
        ),
        ({"schedule": "step", "start": 0.1}, "schedule must be one of"),
        ({"schedule": "constant", "start": -0.1}, "start must be"),
    ],
)
def test_bad_schedule_arguments_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EntropyScheduler(**kwargs)


def test_callback_sets_the_coefficient_for_every_update() -> None:
    cb = EntropyScheduler("linear", start=0.1, end=0.0, warmup_updates=2, total_updates=12)
    module = RecordingModule()
    cb.on_train_start(None, module)
    applied = [module.policy_state.entropy_coef]
    for k in range(1, 15):
        cb.on_dapo_update(None, module, {"update": float(k), "entropy": 0.5})
        applied.append(module.policy_state.entropy_coef)
    expected = [
        schedule_value(k, schedule="linear", start=0.1, end=0.0, total_updates=12, warmup_updates=2)
        for k in range(15)
    ]
    assert applied == pytest.approx(expected)
    assert module.logged["entropy/coef"] == pytest.approx(expected[1:])


ADAPTIVE = {
    "target_low": 0.4,
    "target_high": 0.8,
    "adapt_rate": 0.5,
    "max_rel_change": 0.05,
    "coef_min": 1e-3,
    "coef_max": 0.02,
}


BAND = AdaptiveEntropyBand(**ADAPTIVE)


def test_adaptive_step_directions_and_rate_limit() -> None:
    c = 0.01
    assert adaptive_coef(c, 0.6, BAND) == c  # inside the band
    assert adaptive_coef(c, 0.36, BAND) == pytest.approx(c * (1 + 0.5 * 0.1))  # small gap
    assert adaptive_coef(c, 0.0, BAND) == pytest.approx(c * 1.05)  # capped
    assert adaptive_coef(c, 0.88, BAND) == pytest.approx(c * (1 - 0.5 * 0.1))
    assert adaptive_coef(c, 5.0, BAND) == pytest.approx(c * 0.95)  # capped
    assert adaptive_coef(c, math.nan, BAND) == c  # skipped update


def test_adaptive_stays_in_bounds_and_respects_the_rate_limit() -> None:
    cb = EntropyScheduler("adaptive", start=0.01, **ADAPTIVE)
    module = RecordingModule()
    cb.on_train_start(None, module)
    g = torch.Generator().manual_seed(0)
    # entropy far below the band for 40 updates, then far above, then noisy
    entropies = [0.01] * 40 + [3.0] * 80 + (torch.rand(60, generator=g) * 2).tolist()
    coefs = [module.policy_state.entropy_coef]
    for k, h in enumerate(entropies, start=1):
        cb.on_dapo_update(None, module, {"update": float(k), "entropy": h})
        coefs.append(module.policy_state.entropy_coef)
    assert all(ADAPTIVE["coef_min"] <= c <= ADAPTIVE["coef_max"] for c in coefs)
    rel = [abs(b / a - 1) for a, b in zip(coefs, coefs[1:])]
    assert max(rel) <= ADAPTIVE["max_rel_change"] + 1e-12
    assert max(coefs[:41]) == pytest.approx(ADAPTIVE["coef_max"])  # rose to the cap
    assert coefs[120] == pytest.approx(ADAPTIVE["coef_min"])  # fell to the floor


def test_a_module_without_a_policy_state_gets_a_clear_error() -> None:
    """A LightningModule that is no DAPOModule has no entropy weight to set: a TypeError that
    names the callback and what it needs, not an AttributeError."""
    with pytest.raises(
        TypeError,
        match=r"^EntropyScheduler needs a LightningModule with a `policy_state`.*LightningModule has none",
    ):
        EntropyScheduler("constant", start=0.1).on_train_start(None, pl.LightningModule())


def test_state_round_trip_continues_identically() -> None:
    kwargs = {"schedule": "adaptive", "start": 0.01, "warmup_updates": 3, **ADAPTIVE}
    a, ma = EntropyScheduler(**kwargs), RecordingModule()
    a.on_train_start(None, ma)
    for k in range(1, 8):
        a.on_dapo_update(None, ma, {"update": float(k), "entropy": 0.1})
    b, mb = EntropyScheduler(**kwargs), RecordingModule()
    b.load_state_dict(a.state_dict())
    b.on_train_start(None, mb)  # a resumed run calls on_train_start again
    assert mb.policy_state.entropy_coef == ma.policy_state.entropy_coef
    for k in range(8, 20):
        h = 0.1 if k < 14 else 2.0
        a.on_dapo_update(None, ma, {"update": float(k), "entropy": h})
        b.on_dapo_update(None, mb, {"update": float(k), "entropy": h})
        assert mb.policy_state.entropy_coef == ma.policy_state.entropy_coef
    assert b.state_dict() == a.state_dict()


class TinyDAPOLike(pl.LightningModule):
    """Trivial module following the DAPOModule contract: manual optimization, two optimizer
    updates per training_step, ``policy_state.entropy_coef`` in the loss, ``on_dapo_update``
    after each."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = torch.nn.Linear(4, 3)
        self.policy_state = PolicyState()
        self.updates = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        for half in batch.chunk(2):
            logits = self.policy(half)
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
            loss = logits.pow(2).mean() - self.policy_state.entropy_coef * entropy
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.updates += 1
            metrics = {
                "update": float(self.updates),
                "loss": loss.item(),
                "entropy": entropy.item(),
            }
            for cb in self.trainer.callbacks:
                if hasattr(cb, "on_dapo_update"):
                    cb.on_dapo_update(self.trainer, self, metrics)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["updates"] = self.updates

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.updates = checkpoint["updates"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        # every batch the same: how Lightning re-enters an epoch on resume cannot change the data
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(x.repeat(3, 1), batch_size=4)


def _fit(
    root: Path, max_steps: int, ckpt_path: str | None = None
) -> tuple[EntropyScheduler, pl.Trainer]:
    torch.manual_seed(0)
    # the 3-class entropy (< ln 3) sits below the band; with a small gain each step depends
    # on the measured entropy, so equal states need equal models
    band = {"target_low": 1.2, "target_high": 1.5, "adapt_rate": 0.1}
    cb = EntropyScheduler("adaptive", start=0.01, **{**ADAPTIVE, **band})
    trainer = fit(
        TinyDAPOLike(), None, [cb, ModelCheckpoint(dirpath=root / "ckpt", save_last=True)],
        ckpt_path=ckpt_path, default_root_dir=root, max_steps=max_steps, max_epochs=None,
        enable_checkpointing=True,
    )  # fmt: skip
    return cb, trainer


def test_state_is_saved_into_and_restored_from_a_real_checkpoint(tmp_path: Path) -> None:
    # with manual optimization Lightning's max_steps counts optimizer steps: 2 per batch
    straight, trainer = _fit(tmp_path / "straight", max_steps=12)
    assert trainer.logged_metrics["entropy/coef"].item() == pytest.approx(straight.coef)
    first, _ = _fit(tmp_path / "resumed", max_steps=6)  # one epoch = 3 rollout steps
    ckpt = tmp_path / "resumed" / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert saved["EntropyScheduler"] == first.state_dict()
    assert first.updates == 6 and first.coef > 0.01  # entropy below the band: the coef rose

    resumed, _ = _fit(tmp_path / "resumed", max_steps=12, ckpt_path=str(ckpt))
    assert resumed.updates == 12
    # resuming from the file continues exactly like the uninterrupted run
    assert resumed.state_dict() == straight.state_dict()
