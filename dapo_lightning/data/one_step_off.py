"""How the one-step-off pipeline runs beside the update: ``dynamic_sampling.one_step_off``.

:class:`OneStepOffConfig` is read only with ``dynamic_sampling.pipeline: one_step_off``
(:mod:`~dapo_lightning.data.pipeline`); YAML ``one_step_off: {share_cores: true,
start_after_updates: 0}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_lightning.checks import check_count

#: Where :class:`OneStepOffConfig` sits in a run's YAML (its errors name this path).
ONE_STEP_OFF_PATH = "data.dynamic_sampling.one_step_off"


@dataclass(frozen=True)
class OneStepOffConfig:
    """The rollout thread's share of the cores and when each of its batches starts.

    Args:
        share_cores: The update uses the rollout thread's cores while that thread is idle, and
            the rollout thread the update's while the update waits for its batch (default
            True: :mod:`~dapo_lightning.shared_cores`). The thread counts then follow the
            timing, and some reductions (bf16 autocast's) round differently on another count:
            a run repeats to rounding, not bit for bit. False: a fixed split, bit-exact runs
            and resumes.
        start_after_updates: The next batch starts generating after this many of the current
            step's optimizer updates instead of at the hand-over (0, default), with the weights
            after them: its samples are that many policy versions fresher, and the update runs
            alone (on all the cores) until then. Worth it where generation beside the rest of
            the update still ends before it (the trainer then never waits:
            ``time/trainer_wait_s``); a step with fewer updates starts the batch when it ends.

    Raises:
        ConfigError: ``start_after_updates`` not an integer >= 0.
    """

    share_cores: bool = True
    start_after_updates: int = 0

    def __post_init__(self) -> None:
        check_count(
            f"{ONE_STEP_OFF_PATH}.start_after_updates", self.start_after_updates, 0, "updates"
        )
