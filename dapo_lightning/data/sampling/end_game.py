"""How a rollout step ends when it cannot fill its batch (docs/design.md, "Dynamic sampling").

* No eligible prompt is left (all retired or parked): :class:`TrainingComplete`, with
  :func:`solved_message` saying why.
* ``max_num_gen_batches`` rounds ran out: :func:`out_of_rounds` acts on
  ``dynamic_sampling.on_exhausted`` (``train_on_kept``: nothing to do, the batch holds what was
  kept; ``stop``: :class:`TrainingComplete`; ``error``: :class:`DynamicSamplingError`).
"""

from __future__ import annotations

from dapo_lightning.data.sampling.settings import DynamicSamplingConfig
from dapo_lightning.data.sampling.step_stats import StepStats
from dapo_lightning.data.selection.difficulty import DifficultyTracker


class DynamicSamplingError(RuntimeError):
    """Generation rounds ran out (``max_num_gen_batches``) before the batch was full."""


class TrainingComplete(Exception):
    """Nothing is left to train on (every prompt retired, or rounds ran out with ``stop``)."""


def solved_message(
    tracker: DifficultyTracker | None, prompts: int, config: DynamicSamplingConfig
) -> str:
    """Why the run ends when no prompt is eligible any more."""
    retired, parked = (tracker.num_retired, tracker.num_parked) if tracker is not None else (0, 0)
    return (
        f"no training prompt is left to sample: {retired} of {prompts} are retired "
        f"(all-correct {config.selection.retire_after} visits in a row) and {parked} parked. "
        "The training set is solved; add harder prompts to continue."
    )


def out_of_rounds(
    config: DynamicSamplingConfig,
    have: int,
    need: int,
    short_ranks: int,
    world_size: int,
    stats: StepStats,
) -> None:
    """Act on ``config.on_exhausted`` when the rounds ran out with ``have`` of ``need`` groups.

    ``stats`` are this rank's statistics of the step so far (generated and kept groups: the
    message gives the zero-variance share).

    Raises:
        DynamicSamplingError: ``on_exhausted="error"``.
        TrainingComplete: ``on_exhausted="stop"``.
    """
    gen = stats.generated_groups
    frac = 1 - stats.kept_groups / gen if gen else 0.0
    msg = (
        f"dynamic sampling ran out of rounds (max_num_gen_batches={config.max_num_gen_batches}): "
        f"this rank kept {have} of the {need} groups a batch needs ({short_ranks} of "
        f"{world_size} ranks short); of {int(gen)} groups generated here {frac:.0%} had zero "
        f"variance of {config.filter_metric!r}."
    )
    if config.on_exhausted == "error":
        raise DynamicSamplingError(
            msg + " Raise n, add prompts, raise max_num_gen_batches (0 = unlimited), set "
            "on_exhausted: train_on_kept, or filter_metric: null."
        )
    if config.on_exhausted == "stop":
        raise TrainingComplete(msg + " Stopping (on_exhausted: stop).")
