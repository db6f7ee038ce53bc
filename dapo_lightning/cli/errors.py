"""The CLI's error contract: a bad configuration is one ``dapo-lightning: error:`` line and exit
status 2, wherever it is found (a class's constructor, Lightning's Trainer, a check before the
fit), and so is a reward or environment of the config that fails a round (too many responses or
episodes failed: it raised, hung past its timeout or returned garbage; the message names the
settings to fix); a stop the library reports in one line (a held run directory, a full disk or
a checkpoint folder that refuses writes, non-finite weights, a collapse detector's stop) exits 1
the same way; anything else is a traceback and exit status 1.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from dapo_lightning.callbacks.collapse import CollapseStopError
from dapo_lightning.callbacks.progress import ONE_LINE_FAULTS
from dapo_lightning.checkpoint.files import CheckpointWriteError
from dapo_lightning.checkpoint.io import NonFiniteCheckpointError
from dapo_lightning.checks import ConfigError
from dapo_lightning.metrics import MetricNamesMismatch
from dapo_lightning.ranks import lost_rank_message
from dapo_lightning.run_lock import RunDirLockedError
from dapo_lightning.step_guard import NonFiniteUpdatesError

#: Errors printed as one line: (exception types, exit status).
ONE_LINE_ERRORS: tuple[tuple[tuple[type[BaseException], ...], int], ...] = (
    (ONE_LINE_FAULTS, 2),  # the config's, its reward's or environment's (callbacks/progress.py)
    (
        (
            RunDirLockedError,
            CheckpointWriteError,
            CollapseStopError,
            NonFiniteCheckpointError,
            NonFiniteUpdatesError,
            MetricNamesMismatch,
        ),
        1,
    ),
)


def run_reporting_errors(command: Callable[[], object]) -> None:
    """Run ``command``; an error of :data:`ONE_LINE_ERRORS` is printed as
    ``dapo-lightning: error: <message>`` and exits with its status."""
    try:
        command()
    except tuple(t for types, _ in ONE_LINE_ERRORS for t in types) as error:
        print(f"dapo-lightning: error: {error}", file=sys.stderr)
        sys.exit(next(code for types, code in ONE_LINE_ERRORS if isinstance(error, types)))
    except RuntimeError as error:  # a rank whose peer died: one line naming it, exit 1
        lost = lost_rank_message(error)
        if lost is None:
            raise
        print(f"dapo-lightning: error: {lost}", file=sys.stderr)
        sys.exit(1)


def class_error(error: ValueError) -> ConfigError | None:
    """The one-line :class:`ConfigError` for a configured class that refused its arguments,
    with the class's own message (``PolicyLossConfig: model.loss.clip_ratio_high ...``), not
    jsonargparse's union dump; None when ``error`` is jsonargparse's own (nothing raised it).

    jsonargparse raises its error *from* the class's, so the class's error is the end of the
    ``__cause__`` chain. The class it names is the one whose constructor raised it: the
    innermost ``__init__`` (a dataclass's ``__post_init__`` runs inside it) that the error's
    traceback passes through.
    """
    original: BaseException = error
    while original.__cause__ is not None:
        original = original.__cause__
    if original is error:
        return None
    constructors = [
        type(frame.f_locals["self"]).__name__
        for frame, _ in traceback.walk_tb(original.__traceback__)
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals
    ]
    owner = constructors[-1] if constructors else "config"
    text = str(original)  # "Class.field ..." names its owner already
    return ConfigError(text if text.startswith(f"{owner}.") else f"{owner}: {text}")


#: Fixes for Lightning's Trainer errors our configs can reach: (a phrase of its message, fix).
TRAINER_FIXES = (
    (
        "enable_progress_bar=False",
        "set trainer.enable_progress_bar: true, or remove the progress bar from trainer.callbacks",
    ),
)


def trainer_fix(message: str) -> str:
    """`` Fix: ...`` for a Lightning Trainer error of :data:`TRAINER_FIXES`, else ``""``."""
    return next((f" Fix: {fix}." for phrase, fix in TRAINER_FIXES if phrase in message), "")
