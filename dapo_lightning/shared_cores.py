"""The process's cores, shared by the update (the main thread) and the one-step-off rollout
thread, each using the other's cores while the other is idle.

torch's intra-op thread count belongs to the OS thread that sets it (each thread's OpenMP
setting; a new thread starts from the last count set anywhere), so each side sets its own, at
its own boundaries. With ``dynamic_sampling.pipeline: one_step_off`` the rollout thread is busy
from the hand-over of a batch until the next batch is generated; the update runs the whole
step, then waits for that batch when it is not ready::

    rollout thread:  [ generate batch k+1 on `rollout`  ][ idle                 ]
    main thread:     [ update k on `beside`  ][ on `alone` ...                  ]   (update-bound)

    rollout thread:  [ generate batch k+1 on `rollout`  ][ on `rollout_alone` ]
    main thread:     [ update k on `beside`             ][ wait for batch k+1 ]     (generation-bound)

The update uses ``alone`` threads (the run's choice, :mod:`~dapo_lightning.threads`) while the
rollout thread is idle and ``beside`` threads (:func:`split_threads`) while it generates,
switching before its next micro-batch (:meth:`SharedCores.fit_update`); the rollout thread uses
``rollout_alone`` while the main thread waits for its batch and ``rollout`` otherwise, switching
before its engine's next decode step (:meth:`SharedCores.fit_rollout`).
The cores are never oversubscribed for longer than one micro-batch or decode step: the main
thread drops to ``beside`` itself before it starts the rollout thread
(:meth:`SharedCores.rollout_started`). Measured on 2 cores (benchmarks/RESULTS.md, "One-step-off
rollouts").

The one-step-off stream builds one :class:`SharedCores` per run (none in ``sync`` mode) and
hands it down explicitly: to the update through the data module's
:meth:`~dapo_lightning.contract.RolloutChannel.core_share` (the module puts it in each step's
:class:`~dapo_lightning.update_loop.StepContext`), to the engine through the engine session
(the engine's ``fit_threads``, called before each decode step). Nothing here is process-wide.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


def split_threads(update_threads: int, cores: int) -> tuple[int, int]:
    """(update threads, rollout threads) while both work, for ``cores`` usable cores, the update
    having chosen ``update_threads``: the rollout thread takes the cores the update leaves
    free; when the update takes them all, each side gets half (the update the larger half), at
    least 1."""
    update_threads, cores = max(1, update_threads), max(1, cores)
    if update_threads < cores:
        return update_threads, cores - update_threads
    rollout = max(1, cores // 2)
    return max(1, cores - rollout), rollout


class SharedCores:
    """The update's and the rollout thread's intra-op threads (see the module docstring).

    Args:
        update_threads: The run's choice for the update (:mod:`~dapo_lightning.threads`).
        cores: Usable cores (:func:`~dapo_lightning.threads.usable_cores`).
        lend: Whether each side uses the other's cores while the other is idle (False: the
            update always runs on ``beside`` threads and the rollout thread on ``rollout``, a
            fixed split).
    """

    def __init__(self, update_threads: int, cores: int, lend: bool = True) -> None:
        #: The run's choice, restored when the pipeline ends.
        self.chosen = max(1, int(update_threads))
        self.beside, self.rollout = split_threads(self.chosen, cores)
        #: The update's threads while the rollout thread is idle.
        self.alone = self.chosen if lend else self.beside
        #: The rollout thread's threads while the main thread waits for its batch.
        self.rollout_alone = max(self.rollout, self.chosen) if lend else self.rollout
        self._generating = threading.Event()
        self._waiting = threading.Event()
        self._rollout_thread: int | None = None

    @property
    def generating(self) -> bool:
        """Whether the rollout thread is generating now."""
        return self._generating.is_set()

    @property
    def waiting(self) -> bool:
        """Whether the main thread waits for the rollout thread's batch now."""
        return self._waiting.is_set()

    def line(self) -> str:
        """How the cores are shared, for the start-up line."""
        when = f" ({self.beside} while rollouts run)" if self.beside != self.alone else ""
        alone = self.rollout_alone
        waits = f" ({alone} while the update waits)" if alone != self.rollout else ""
        return f"the update on {self.alone}{when}, rollouts on {self.rollout}{waits}"

    def rollout_started(self) -> None:
        """On the main thread, before it starts the rollout thread: the update drops to
        ``beside`` threads now."""
        self._generating.set()
        self.fit_update()

    def rollout_thread_starts(self) -> None:
        """On the rollout thread, once: its ``rollout`` threads, and :meth:`fit_rollout` acts on
        this thread only."""
        self._rollout_thread = threading.get_ident()
        torch.set_num_threads(self.rollout)

    def rollout_finished(self) -> None:
        """On the rollout thread, when its batch is done: the update may use ``alone``."""
        self._generating.clear()

    def fit_update(self) -> int:
        """On the main thread (the update; validation): use ``beside`` threads while the
        rollout thread generates, ``alone`` otherwise; returns the count."""
        return _use(self.beside if self.generating else self.alone)

    @contextlib.contextmanager
    def update_waits(self) -> Iterator[None]:
        """On the main thread, around its wait for the batch in flight."""
        self._waiting.set()
        try:
            yield
        finally:
            self._waiting.clear()

    def fit_rollout(self) -> int | None:
        """On the rollout thread (elsewhere: nothing, None): ``rollout_alone`` threads while
        the main thread waits for its batch, ``rollout`` otherwise; returns the count."""
        if threading.get_ident() != self._rollout_thread:
            return None
        return _use(self.rollout_alone if self.waiting else self.rollout)


def _use(threads: int) -> int:
    """Set this thread's intra-op threads to ``threads`` (only when they differ)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
