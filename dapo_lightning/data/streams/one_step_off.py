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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.checks import ConfigError
from dapo_lightning.data.legacy_checkpoints import legacy_ready_batch
from dapo_lightning.data.sampling.producer import RolloutProducer
from dapo_lightning.data.sampling.settings import DYNAMIC_SAMPLING_PATH, DynamicSamplingConfig
from dapo_lightning.data.sampling.step_stats import PIPELINE_STAT_OPS
from dapo_lightning.data.streams.stream import Produced, RolloutStream
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.shared_cores import SharedCores
from dapo_lightning.strategy import strategy_kind
from dapo_lightning.threads import usable_cores
from dapo_lightning.trace import phase

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- where the next batch is
@dataclass(frozen=True)
class Idle:
    """No batch waits, runs or is ready: the next hand-over generates one first (the start of
    a run, after the end of training, after a batch that failed)."""


@dataclass(frozen=True)
class Pending:
    """The next batch, not started: it starts once ``start_after_updates`` versions were
    published after the hand-over (:meth:`OneStepOffStream.start_if_due`), or at the next
    hand-over, checkpoint or validation.

    Args:
        dropped_prompts: The data module's count of dropped prompts, stamped on the batch.
        handed_at: The published version at the hand-over.
    """

    dropped_prompts: int
    handed_at: int


@dataclass(frozen=True)
class InFlight:
    """The rollout thread generates the next batch.

    Args:
        future: Its :class:`Ready` (or the producer's exception, the producer back at the
            batch's start).
    """

    future: Future[Ready]


@dataclass(frozen=True)
class Ready:
    """A finished batch not handed over yet (after a checkpoint, validation, a resume or a
    rewind).

    Args:
        produced: The batch and the uids it drew.
        finished_at: When the rollout thread finished it (``time.perf_counter``; None: it was
            not generated since the last hand-over, ``time/engine_idle_s`` is then 0).
    """

    produced: Produced
    finished_at: float | None = None


#: Where the one-step-off stream's next batch is.
NextBatch = Idle | Pending | InFlight | Ready


class OneStepOffStream(RolloutStream):
    """A :class:`RolloutStream` that generates batch ``k + 1`` on a rollout thread while batch
    ``k`` updates (see the module docstring): a state machine over where the next batch is
    (:attr:`state`)::

        hand-over of batch k:  Ready, or InFlight waited for -> Pending (start_after > 0)
                               or InFlight (started with the weights published now)
        Pending -> InFlight:   start_if_due (start_after publishes), quiesce, the next hand-over
        InFlight -> Ready:     quiesce (checkpoint, validation, the end of fit)
        -> Ready:              rewind (batch k again), load_state_dict (the saved batch)
        -> Idle:               the end of training, a failed batch (the next hand-over starts one)

    Args:
        session: The engine session; it must sample with its own copy of the weights
            (``EngineSession(own_copy=True)``: the HF engine would otherwise sample with the
            module being updated), the rollout thread's share of the cores handed to its
            engine (``EngineSession(cores=...)``).
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
        #: Where the next batch is: :class:`Idle`, :class:`Pending`, :class:`InFlight`,
        #: :class:`Ready`.
        self.state: NextBatch = Idle()
        #: The batch handed over last (a rewind makes it :class:`Ready` again); None after a
        #: rewind or a resume.
        self.handed: Produced | None = None
        self._executor: ThreadPoolExecutor | None = None

    def _init_thread(self) -> None:
        if self.cores is not None:
            self.cores.rollout_thread_starts()
        else:
            torch.set_num_threads(1)

    # ------------------------------------------------------------------ the batches
    def next_batch(self, dropped_prompts: int) -> RolloutBatch | EndOfTraining:
        """The next batch (waiting for the one in flight; its uids appended to ``drawn_log``
        now, in step order), then the next one :class:`Pending`, or started now with the
        weights published now (``start_after`` 0)."""
        started = time.perf_counter()
        if isinstance(self.state, Pending):  # the step made fewer than start_after updates
            self._start(self.state.dropped_prompts)
        elif isinstance(self.state, Idle):  # the first batch (or the first after a failure)
            self._start(dropped_prompts)
        finished = self._finished_at()
        produced = self._take()
        batch, waited = produced.batch, time.perf_counter() - started
        if isinstance(batch, EndOfTraining) or produced.uids is None:
            return batch
        batch.stats["time/trainer_wait_s"] = waited
        batch.stats["time/engine_idle_s"] = (
            max(0.0, started - finished) if finished is not None else 0.0
        )
        self.drawn_log.append(produced.uids)
        self.handed = produced
        if self.start_after:
            self.state = Pending(dropped_prompts, self.version)
        else:
            self._start(dropped_prompts)
        return batch

    def start_if_due(self) -> None:
        """Start the :class:`Pending` batch once ``start_after`` versions were published since
        the hand-over (the data module calls it after each publish: on the main thread,
        between two updates)."""
        state = self.state
        if isinstance(state, Pending) and self.version - state.handed_at >= self.start_after:
            self._start(state.dropped_prompts)

    def _start(self, dropped_prompts: int) -> None:
        """Start the next batch with the weights published now, pushed from this thread (a
        collective when the policy is sharded; the rollout thread is idle)."""
        self.state = Idle()
        version = self.version
        self.session.build_engine()  # on the main thread (vLLM's start-up)
        self.session.sync(version)
        if self.cores is not None:
            self.cores.rollout_started()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dapo-rollout", initializer=self._init_thread
            )
        self.state = InFlight(self._executor.submit(self._generate, dropped_prompts, version))

    def _generate(self, dropped_prompts: int, version: int) -> Ready:
        if self.cores is not None:  # back to its share if the last batch ended on all cores
            self.cores.fit_rollout()
        try:
            produced = self.produce(dropped_prompts, version)
        finally:
            finished_at = time.perf_counter()
            if self.cores is not None:
                self.cores.rollout_finished()
        return Ready(produced, finished_at)

    def _finished_at(self) -> float | None:
        """When the next batch finished, if it has (never waits)."""
        state = self.state
        if isinstance(state, InFlight):
            future = state.future
            done = future.done() and future.exception() is None
            return future.result().finished_at if done else None
        return state.finished_at if isinstance(state, Ready) else None

    def _take(self) -> Produced:
        """The :class:`Ready` batch, else the one :class:`InFlight`, waited for (its exception
        raised here); the state is :class:`Idle` after."""
        state, self.state = self.state, Idle()
        if isinstance(state, Ready):
            return state.produced
        if not isinstance(state, InFlight):
            raise RuntimeError("OneStepOffStream: no batch is ready or in flight.")
        with phase("wait for batch"):
            return self._wait(state.future).produced

    def _wait(self, future: Future[Ready]) -> Ready:
        """The batch in flight, waited for (the rollout thread takes the cores meanwhile)."""
        if self.cores is None:
            return future.result()
        with self.cores.update_waits():
            return future.result()

    def quiesce(self) -> None:
        """Let the batch in flight finish and keep it :class:`Ready` (before validation and
        checkpoints: the engine is free, the producer's state is the one after it); a
        :class:`Pending` batch starts now, with the weights published last."""
        if isinstance(self.state, Pending):
            self._start(self.state.dropped_prompts)
        state = self.state
        if isinstance(state, InFlight):
            self.state = Idle()
            self.state = self._wait(state.future)  # raises: the producer is back at its start

    def rewind(self) -> None:
        """A stop undid the update of the batch handed over last: abandon the next batch and
        make the handed one :class:`Ready` again, the producer back to the start of the batch
        it began after the hand-over (its ``batch_start``; none began while it was
        :class:`Pending`)."""
        state, self.state = self.state, Idle()
        if isinstance(state, InFlight):
            try:
                state.future.result()
            except BaseException:  # noqa: BLE001 - a stop: the state is restored below
                log.debug("the batch in flight when the step was undone failed", exc_info=True)
        handed, self.handed = self.handed, None
        if handed is None:  # nothing handed over since the resume or the last rewind
            self.state = state if isinstance(state, Ready) else Idle()
            return
        if isinstance(state, (InFlight, Ready)):
            self.producer.rewind()
        for key in PIPELINE_STAT_OPS:
            handed.batch.stats.pop(key, None)
        self.state = Ready(handed)
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
        """The stream's state and its :class:`Ready` batch; never waits (:meth:`quiesce`
        first: the data module does before a checkpoint).

        Raises:
            RuntimeError: a batch is :class:`Pending` or :class:`InFlight` (the producer's
                state is not the one after it yet).
        """
        state = self.state
        if isinstance(state, (Pending, InFlight)):
            raise RuntimeError(
                f"OneStepOffStream.state_dict with a batch {type(state).__name__.lower()}: "
                "call quiesce() first (the checkpoint holds that batch, finished)."
            )
        out = super().state_dict()
        if isinstance(state, Ready) and isinstance(state.produced.batch, RolloutBatch):
            batch = state.produced.batch
            out["ready"] = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
            out["ready_uids"] = state.produced.uids
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the producer and engine; the checkpoint's finished batch is handed over
        first."""
        super().load_state_dict(state)
        ready = legacy_ready_batch(state.get("ready") or {})
        uids = list(state.get("ready_uids") or [])
        self.state = Ready(Produced(RolloutBatch(**ready), uids)) if ready else Idle()
        self.handed = None

    def close(self) -> None:
        """End the rollout thread once the batch in flight has finished; that batch stays
        :class:`Ready` (a checkpoint saved after the run holds it; a later fit trains on it)."""
        try:
            self.quiesce()
        except BaseException:  # noqa: BLE001 - the producer is back at the batch's start
            log.debug("the batch in flight at the end of the run failed", exc_info=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.cores is not None:
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


def split_cores(sampling: DynamicSamplingConfig) -> SharedCores | None:
    """How the update and the one-step-off rollout thread share the cores
    (:class:`~dapo_lightning.shared_cores.SharedCores`: the update takes the idle rollout
    thread's cores with ``sampling.one_step_off.share_cores``), said in the log; None in sync
    mode."""
    if sampling.pipeline != "one_step_off":
        return None
    usable = usable_cores()
    settings = sampling.one_step_off
    cores = SharedCores(torch.get_num_threads(), usable, lend=settings.share_cores)
    start = settings.start_after_updates
    later = f"; each batch starts after {start} updates of the step before" if start else ""
    log.info("pipeline one_step_off: %s (%d usable cores)%s", cores.line(), usable, later)
    return cores


def build_stream(
    sampling: DynamicSamplingConfig,
    make_session: Callable[[SharedCores | None], EngineSession],
    make_producer: Callable[[EngineSession], RolloutProducer],
    drawn_log: list[list[str]],
) -> RolloutStream:
    """The rollout stream of ``sampling.pipeline`` (the one object the data module holds),
    built in order: the split of the cores (:func:`split_cores`; None in sync mode), the
    engine session on it (``make_session(cores)``: it hands the rollout thread's share to its
    engine), the producer on the session, then the sync :class:`RolloutStream` or the
    :class:`OneStepOffStream` (whose ``cores`` the data module hands to the update)."""
    cores = split_cores(sampling)
    session = make_session(cores)
    producer = make_producer(session)
    if cores is None:
        return RolloutStream(session, producer, drawn_log)
    start = sampling.one_step_off.start_after_updates
    return OneStepOffStream(session, producer, drawn_log, cores=cores, start_after=start)
