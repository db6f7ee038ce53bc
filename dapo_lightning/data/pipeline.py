"""One-step-off rollouts: the next rollout batch is generated while this one updates.

``dynamic_sampling.pipeline: one_step_off`` (default ``sync``). In ``sync`` mode the rollouts
of step ``k`` are generated right before step ``k`` (``on_before_batch_transfer``): the engine
waits while the model updates and the update waits while the engine generates. Here, as soon
as batch ``k`` is handed to the update, a rollout thread starts batch ``k + 1``:

    main thread:    [update k with batch k][wait][update k+1 with batch k+1] ...
    rollout thread:  [generate batch k+1 with w_k ][generate batch k+2 with w_k+1] ...

The engine samples with the weights published before update ``k`` (``w_k``, pushed into its own
copy on the main thread at the hand-over, where the update is idle), so every fresh response of
batch ``k + 1`` is exactly one rollout step stale when it is trained on (``data/staleness_mean``
and ``data/staleness_max`` count policy versions: the optimizer updates of one step). The
update corrects it as it corrects carried-over groups: the engine's log-probs are the behaviour
policy, token TIS capped at ``loss.rollout_correction.stale_tis_cap``, or the chosen
``rollout_correction`` mode. Carried-over groups older than ``max_staleness`` policy versions
are regenerated, never trained on.

Where generation is the shorter phase, the rollout thread can start later with fresher weights:
with ``one_step_off.start_after_updates: j`` the batch starts at the publish after the ``j``-th
update of step ``k`` (the module publishes after every update), so its samples are ``j``
versions fresher and the update runs alone until then; a step with fewer updates starts it at
its end.

Determinism: the weights of a batch are fixed when it starts (the engine never switches weights
inside a batch, and it starts after a fixed number of updates), so with
``one_step_off.share_cores: false`` a run is the same whatever the timing; with ``share_cores``
(default) the update's thread count follows the timing (:mod:`~dapo_lightning.shared_cores`)
and a run repeats to rounding. Checkpoints and validation first let the batch in flight finish:
the checkpoint holds it (and the producer's state after it), so a resumed run trains on the
same batch and samples the next one with the same weights; a stop that undoes step ``k`` gives
batch ``k`` back to the checkpoint the same way.

Threads, not a process: torch, the engines and the reward workers release the GIL while they
compute, and a thread shares the process's memory, so the weights move by one copy into the
engine's own model (vLLM: its ``load_weights``). The rollout thread gets its own intra-op
thread count, and the update uses the rollout thread's cores while it is idle
(:mod:`~dapo_lightning.shared_cores`); under ``torch.distributed`` the rollout thread has its
own gloo process group for the producer's lockstep sums, so its collectives never interleave
with the update's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.checks import ConfigError
from dapo_lightning.contract import PolicyHandle
from dapo_lightning.data.dynamic_sampling import DYNAMIC_SAMPLING_PATH, DynamicSamplingConfig
from dapo_lightning.data.legacy_checkpoints import legacy_ready_batch
from dapo_lightning.data.producer import RolloutProducer
from dapo_lightning.data.sources import PromptRecord
from dapo_lightning.data.step_stats import PIPELINE_STAT_OPS
from dapo_lightning.data.stream import RolloutStream
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.shared_cores import SharedCores, fit_rollout_threads, share_cores
from dapo_lightning.strategy import strategy_kind
from dapo_lightning.threads import usable_cores
from dapo_lightning.trace import phase

log = logging.getLogger(__name__)


class OneStepOffStream(RolloutStream):
    """A :class:`RolloutStream` that generates batch ``k + 1`` on a rollout thread while batch
    ``k`` updates (see the module docstring).

    Args:
        session: The engine session; it must sample with its own copy of the weights
            (``EngineSession(own_copy=True)``: the HF engine would otherwise sample with the
            module being updated).
        producer: The dynamic-sampling producer on ``session`` (under ``torch.distributed``
            its ``sync`` must use a process group of its own).
        drawn_log: Where the uids drawn at each step are appended (logging, tests).
        cores: How the update and the rollout thread share the cores (None: the rollout
            thread runs on one thread and the update keeps its own).
        start_after: Policy versions (the step's updates) published after the hand-over
            before the next batch starts (0: at the hand-over; ``start_after_updates``).
    """

    def __init__(
        self,
        session: EngineSession,
        producer: RolloutProducer,
        drawn_log: list[list[str]],
        cores: SharedCores | None = None,
        start_after: int = 0,
    ) -> None:
        super().__init__(session, producer, drawn_log)
        self.cores, self.start_after = cores, start_after
        #: The next batch, not started yet: (dropped prompts, the version at the hand-over).
        self._pending: tuple[int, int] | None = None
        self._executor: ThreadPoolExecutor | None = None
        #: The batch in flight (None when none is).
        self._future: Future | None = None
        #: A finished batch not handed over yet and the uids it drew (after a checkpoint,
        #: validation or a resume).
        self.ready: tuple[RolloutBatch | EndOfTraining, list[str] | None] | None = None
        #: The batch handed over last, its uids, the producer / engine state after it (rewind).
        self._handed: tuple[RolloutBatch, list[str], dict[str, Any]] | None = None
        self._finished_at: float | None = None

    def _init_thread(self) -> None:
        if self.cores is not None:
            self.cores.rollout_thread_starts()
        else:
            torch.set_num_threads(1)

    # ------------------------------------------------------------------ the batches
    def next_batch(self, dropped_prompts: int) -> RolloutBatch | EndOfTraining:
        """The next batch (waiting for the one in flight; its uids appended to ``drawn_log``
        now, in step order), then the start of the one after with the weights published now."""
        started = time.perf_counter()
        self._start_pending()  # the step made fewer than start_after updates
        if self.ready is None and self._future is None:
            self._submit(dropped_prompts)  # the first batch (or the first after a stop)
        finished_before = self._finished_at
        batch, uids = self._take()
        waited = time.perf_counter() - started
        if isinstance(batch, EndOfTraining) or uids is None:
            return batch
        batch.stats["time/trainer_wait_s"] = waited
        batch.stats["time/engine_idle_s"] = (
            max(0.0, started - finished_before) if finished_before is not None else 0.0
        )
        self.drawn_log.append(uids)
        self._handed = (batch, uids, super().state_dict())
        if self.start_after:
            self._pending = (dropped_prompts, self.version)  # started by publish()
        else:
            self._submit(dropped_prompts)
        return batch

    def publish(self, handle: PolicyHandle) -> None:
        """Take ``handle``; start the pending batch once ``start_after`` versions were
        published since the hand-over (on the main thread, between two updates)."""
        super().publish(handle)
        if self._pending is not None and handle.version - self._pending[1] >= self.start_after:
            self._start_pending()

    def _start_pending(self) -> None:
        """Start the batch that waits for ``start_after`` updates now (none waits: nothing)."""
        if self._pending is not None:
            self._submit(self._pending[0])

    def _submit(self, dropped_prompts: int) -> None:
        """Start the next batch with the weights published now, pushed from this thread (a
        collective when the policy is sharded; the rollout thread is idle)."""
        self._pending = None
        version = self.version
        self.session.engine  # noqa: B018 - built here, on the main thread (vLLM's start-up)
        self.session.sync(version)
        self._finished_at = None
        if self.cores is not None:
            self.cores.rollout_started()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dapo-rollout", initializer=self._init_thread
            )
        self._future = self._executor.submit(self._generate, dropped_prompts, version)

    def _generate(
        self, dropped_prompts: int, version: int
    ) -> tuple[RolloutBatch | EndOfTraining, list[str] | None]:
        fit_rollout_threads()  # back to its share if the last batch ended on all the cores
        try:
            return self.produce(dropped_prompts, version)
        finally:
            self._finished_at = time.perf_counter()
            if self.cores is not None:
                self.cores.rollout_finished()

    def _take(self) -> tuple[RolloutBatch | EndOfTraining, list[str] | None]:
        """The ready batch, else the one in flight (its exception raised here)."""
        if self.ready is not None:
            batch, self.ready = self.ready, None
            return batch
        future, self._future = self._future, None
        if future is None:
            raise RuntimeError("OneStepOffStream: no batch is ready or in flight.")
        with phase("wait for batch"):
            return self._wait(future)

    def _wait(self, future: Future) -> tuple[RolloutBatch | EndOfTraining, list[str] | None]:
        """The batch in flight, waited for (the rollout thread takes the cores meanwhile)."""
        if self.cores is None:
            return future.result()
        with self.cores.update_waits():
            return future.result()

    def quiesce(self) -> None:
        """Let the batch in flight finish and keep it as :attr:`ready` (before validation and
        checkpoints: the engine is free, the producer's state is the one after it); a batch
        not started yet starts now, with the weights published last."""
        self._start_pending()
        future, self._future = self._future, None
        if future is not None:
            self.ready = self._wait(future)  # raises: the producer is back at its start

    def rewind(self) -> None:
        """A stop undid the update of the batch handed over last: abandon the batch in flight
        and hand the last batch over again, the producer back to the state after it."""
        self._pending = None
        future, self._future = self._future, None
        if future is not None:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - a stop: the state is restored below
                log.debug("the batch in flight when the step was undone failed", exc_info=True)
        if self._handed is None:
            return
        batch, uids, state = self._handed
        super().load_state_dict(state)
        for key in PIPELINE_STAT_OPS:
            batch.stats.pop(key, None)
        self.ready, self._handed = (batch, uids), None
        if self.drawn_log:
            self.drawn_log.pop()

    def validate(
        self, chunk: list[PromptRecord], n: int, sampling: SamplingConfig
    ) -> ScoredRollouts:
        """Validation's own engine calls, once the batch in flight has finished (on all of
        the main thread's cores)."""
        self.quiesce()
        if self.cores is not None:
            self.cores.fit_update()
        return super().validate(chunk, n, sampling)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The stream's state after the batch in flight (waited for), and that batch."""
        self.quiesce()
        state = super().state_dict()
        if self.ready is not None and isinstance(self.ready[0], RolloutBatch):
            batch, uids = self.ready
            state["ready"] = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
            state["ready_uids"] = uids
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the producer and engine; the checkpoint's finished batch is handed over
        first."""
        super().load_state_dict(state)
        ready = legacy_ready_batch(state.get("ready") or {})
        self.ready = (RolloutBatch(**ready), list(state.get("ready_uids") or [])) if ready else None
        self._handed = None

    def close(self) -> None:
        """End the rollout thread once the batch in flight has finished; that batch stays
        :attr:`ready` (a checkpoint saved after the run holds it; a later fit trains on it)."""
        try:
            self.quiesce()
        except BaseException:  # noqa: BLE001 - the producer is back at the batch's start
            log.debug("the batch in flight at the end of the run failed", exc_info=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.cores is not None:
            share_cores(None)
            torch.set_num_threads(self.cores.chosen)


#: Strategies the one-step-off pipeline runs under (the weights pushed are the policy's own).
PIPELINE_STRATEGIES = ("single", "ddp")


def check_pipeline(trainer: Any, engine_kwargs: dict[str, Any]) -> None:
    """Refuse, with the field and the fix, what ``pipeline: one_step_off`` cannot run with.

    Raises:
        ConfigError: a sharded strategy (FSDP, DeepSpeed), or an engine in sleep mode.
    """
    kind = strategy_kind(getattr(trainer, "strategy", None))
    if kind not in PIPELINE_STRATEGIES:
        raise ConfigError(
            f"{DYNAMIC_SAMPLING_PATH}.pipeline=one_step_off runs on one device or with DDP, not "
            f"with the {kind} strategy (its weights are sharded): set "
            f"{DYNAMIC_SAMPLING_PATH}.pipeline: sync, or trainer.strategy: ddp."
        )
    if engine_kwargs.get("enable_sleep_mode"):
        raise ConfigError(
            f"{DYNAMIC_SAMPLING_PATH}.pipeline=one_step_off keeps the engine generating while "
            "the model updates, so it cannot sleep: remove data.engine_kwargs.enable_sleep_mode "
            "or set the pipeline to sync."
        )


def rollout_process_group(world_size: int) -> Any:
    """A gloo process group of every rank for the rollout thread's lockstep sums (None on one
    rank). Collective: every rank calls it, in ``setup``."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def make_stream(
    sampling: DynamicSamplingConfig,
    session: EngineSession,
    producer: RolloutProducer,
    drawn_log: list[list[str]],
) -> RolloutStream:
    """The rollout stream of ``sampling.pipeline``; one-step-off splits the cores between the
    update and the rollout thread (:class:`~dapo_lightning.shared_cores.SharedCores`; the
    update takes the idle rollout thread's cores with ``sampling.one_step_off.share_cores``)
    and says so."""
    if sampling.pipeline != "one_step_off":
        share_cores(None)
        return RolloutStream(session, producer, drawn_log)
    usable = usable_cores()
    settings = sampling.one_step_off
    cores = SharedCores(torch.get_num_threads(), usable, lend=settings.share_cores)
    share_cores(cores)
    start = settings.start_after_updates
    later = f"; each batch starts after {start} updates of the step before" if start else ""
    log.info("pipeline one_step_off: %s (%d usable cores)%s", cores.line(), usable, later)
    return OneStepOffStream(session, producer, drawn_log, cores=cores, start_after=start)
