"""One rank's rollouts without Lightning: the engine session and the rollout producer, and the
weights the module published last (:class:`~dapo_lightning.contract.PolicyHandle`); a stop
rewinds the producer to the start of the batch under way (its
:attr:`~dapo_lightning.data.sampling.producer.RolloutProducer.batch_start`). ``DAPODataModule`` builds
one in ``setup`` (:func:`~dapo_lightning.data.streams.one_step_off.build_stream`: this sync stream, or the
one-step-off one) and hands its Lightning hooks to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.contract import PolicyHandle
from dapo_lightning.data.sampling.end_game import TrainingComplete
from dapo_lightning.data.sampling.producer import RolloutProducer
from dapo_lightning.envs.session import EpisodeSession
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.trace import phase

if TYPE_CHECKING:
    from dapo_lightning.shared_cores import SharedCores


@dataclass(frozen=True)
class Produced:
    """What one batch's generation gave: the batch (or the end of training) and the uids it
    drew (None with the end of training)."""

    batch: RolloutBatch | EndOfTraining
    uids: list[str] | None


class RolloutStream:
    """Training batches and validation rollouts of one rank, sampled with the last published
    weights and stamped with their version.

    Args:
        session: The engine session (its weights come from :meth:`policy`).
        producer: The dynamic-sampling producer on ``session``.
        drawn_log: Where the uids drawn at each step are appended (logging, tests).
    """

    #: How the update shares the cores with a rollout thread generating beside it (None: no
    #: such thread; the one-step-off stream has one): the data module's ``core_share()``.
    cores: SharedCores | None = None

    def __init__(
        self, session: EngineSession, producer: RolloutProducer, drawn_log: list[list[str]]
    ) -> None:
        self.session, self.producer, self.drawn_log = session, producer, drawn_log
        #: The weights to sample with and their version (None before the first publish).
        self.policy_handle: PolicyHandle | None = None
        session.attach(self.policy)

    def policy(self) -> nn.Module:
        """The published policy module (the engine session pushes its weights)."""
        if self.policy_handle is None:
            raise RuntimeError(
                "DAPODataModule has no policy to sample with: the module publishes one at the "
                "start of training and of validation (DAPOModule does); a module of your own "
                "calls datamodule.publish_policy(PolicyHandle(policy, version))."
            )
        return self.policy_handle.policy

    def publish(self, handle: PolicyHandle) -> None:
        """Sample from now on with ``handle``'s weights, stamped with its version (only that:
        :meth:`start_if_due` starts a batch)."""
        self.policy_handle = handle

    def start_if_due(self) -> None:
        """Nothing is generated ahead in sync mode (the one-step-off stream starts a batch
        that waits for ``start_after_updates`` publishes here)."""

    @property
    def version(self) -> int:
        """The version of the published weights (0 before any)."""
        return self.policy_handle.version if self.policy_handle is not None else 0

    def next_batch(self, dropped_prompts: int) -> RolloutBatch | EndOfTraining:
        """Generate, score, shape and filter the rollouts of the current step (the uids it
        drew appended to ``drawn_log``)."""
        produced = self.produce(dropped_prompts, self.version)
        if produced.uids is not None:
            self.drawn_log.append(produced.uids)
        return produced.batch

    def produce(self, dropped_prompts: int, version: int) -> Produced:
        """A batch sampled with the weights of ``version`` and the uids it drew, touching
        nothing but the producer and the session (the one-step-off stream calls it on its
        rollout thread)."""
        episodes = isinstance(self.session, EpisodeSession)
        if episodes:
            self.session.take_stats()  # validation's episodes are not this step's
        try:
            with phase("rollout"):
                batch = self.producer.next_batch(version)
        except TrainingComplete as done:
            return Produced(EndOfTraining(str(done)), None)
        batch.stats["data/dropped_prompts"] = float(dropped_prompts)
        if episodes:
            batch.stats.update(self.session.take_stats())
        return Produced(batch, list(self.producer.drawn_uids))

    def rewind(self) -> None:
        """Put the producer and the engine's RNG back to before the last :meth:`next_batch`
        (:meth:`RolloutProducer.rewind`: a stop dropped its update before any weight changed,
        so on resume the same rollouts are generated again) and forget the uids it drew."""
        if self.producer.rewind() and self.drawn_log:
            self.drawn_log.pop()

    def quiesce(self) -> None:
        """Nothing runs between calls here (the one-step-off stream finishes its batch; call
        it before :meth:`state_dict` for a checkpoint)."""

    def close(self) -> None:
        """Nothing to stop here (the one-step-off stream ends its rollout thread)."""

    def state_dict(self) -> dict[str, Any]:
        """The producer's state (prompt cursor, RNGs, statistics, carried groups) and the
        engine's sampling RNG (never waits: :meth:`quiesce` first)."""
        return {"producer": self.producer.state_dict(), "engine": self.session.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.producer.load_state_dict(state["producer"])
        if state.get("engine"):
            self.session.load_state_dict(state["engine"])

    def validate(
        self, chunk: list[PromptRecord], n: int, sampling: SamplingConfig
    ) -> ScoredRollouts:
        """``n`` scored responses for each prompt of ``chunk``. The engine's sampling RNG is
        put back afterwards: training samples the same whether or not (and wherever) a
        validation ran, so a resume from a checkpoint saved just before one is exact."""
        version, rng = self.version, self.session.state_dict()
        try:
            with phase("validation"), self.session.generating(version):
                return self.producer.score(chunk, [n] * len(chunk), sampling, version)
        finally:
            self.session.load_state_dict(rng)
