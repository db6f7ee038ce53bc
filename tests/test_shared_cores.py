"""How the update and the one-step-off rollout thread share the cores
(dapo_lightning/shared_cores.py): the split, each side's own torch thread count, the update
taking the idle rollout thread's cores at its next micro-batch, the share handed down
explicitly (the data module's ``core_share()`` into each step's ``StepContext``, the engine
session into its engine's ``fit_threads``; nothing process-wide), and a real one-step-off fit
of DAPOModule whose micro-batches use the counts the rule gives."""

from __future__ import annotations

import threading

import pytest
import torch

from dapo_lightning import shared_cores
from dapo_lightning.shared_cores import SharedCores, split_threads
from dapo_lightning.update_loop import StepContext


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("update", "cores", "expected"),
    [
        (1, 2, (1, 1)),
        (2, 2, (1, 1)),
        (1, 16, (1, 15)),
        (16, 16, (8, 8)),
        (3, 3, (2, 1)),
        (1, 1, (1, 1)),
    ],
)
def test_split_threads(update, cores, expected):
    assert split_threads(update, cores) == expected


SHARED_2 = "the update on 2 (1 while rollouts run), rollouts on 1 (2 while the update waits)"
SHARED_16 = "the update on 16 (8 while rollouts run), rollouts on 8 (16 while the update waits)"


@pytest.mark.parametrize(
    ("update", "cores", "lend", "counts", "line"),
    [
        (2, 2, True, (2, 1, 1, 2), SHARED_2),
        (2, 2, False, (1, 1, 1, 1), "the update on 1, rollouts on 1"),
        (1, 2, True, (1, 1, 1, 1), "the update on 1, rollouts on 1"),  # a tiny model: no change
        (16, 16, True, (16, 8, 8, 16), SHARED_16),
        (4, 16, True, (4, 4, 12, 12), "the update on 4, rollouts on 12"),
    ],
)
def test_counts_and_line(update, cores, lend, counts, line):
    share = SharedCores(update, cores, lend=lend)
    assert (share.alone, share.beside, share.rollout, share.rollout_alone) == counts
    assert share.chosen == update and share.line() == line


def test_each_side_sets_its_own_threads():
    torch.set_num_threads(2)
    share = SharedCores(2, 2)
    context = StepContext(cores=share)  # the module hands the data's core_share() down
    seen: dict[str, object] = {}
    context.fit_threads()
    assert torch.get_num_threads() == 2  # the rollout thread is idle: the update has both

    share.rollout_started()  # on the main thread, before the rollout thread starts
    assert share.generating and torch.get_num_threads() == 1

    def rollout():
        torch.set_num_threads(share.rollout)
        seen["rollout"] = torch.get_num_threads()
        share.rollout_finished()

    worker = threading.Thread(target=rollout)
    worker.start()
    worker.join()
    assert seen["rollout"] == 1 and not share.generating
    assert torch.get_num_threads() == 1  # another thread's count is not this thread's
    context.fit_threads()  # the update's next micro-batch
    assert torch.get_num_threads() == 2


def test_the_rollout_thread_takes_the_cores_while_the_update_waits():
    torch.set_num_threads(2)
    share = SharedCores(2, 2)
    asked, answered = threading.Event(), threading.Event()
    seen: list[int | None] = []

    def rollout():
        share.rollout_thread_starts()
        seen.append(share.fit_rollout())  # the update runs: 1
        asked.set()
        answered.wait(5)
        seen.append(share.fit_rollout())  # the update waits for this batch: both cores
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=rollout)
    share.rollout_started()
    worker.start()
    asked.wait(5)
    with share.update_waits():
        answered.set()
        worker.join()
    assert seen == [1, 2, 2]
    assert share.fit_rollout() is None and torch.get_num_threads() == 1  # not the rollout thread


def test_without_a_sharing_the_update_keeps_its_threads():
    torch.set_num_threads(2)
    StepContext().fit_threads()  # sync mode: no share in the step's context
    assert torch.get_num_threads() == 2
    assert not [n for n in vars(shared_cores) if n.startswith("_active") or n == "share_cores"]


def test_fixed_split_never_lends():
    torch.set_num_threads(2)
    share = SharedCores(2, 2, lend=False)
    share.rollout_started()
    share.rollout_finished()
    StepContext(cores=share).fit_threads()
    assert torch.get_num_threads() == 1


def test_the_share_reaches_the_engine_through_its_session(tiny_checkpoint):
    """The engine session sets its engine's ``fit_threads`` to the rollout thread's share
    (built by name or given); without a share it stays None and a decode step changes nothing."""
    from test_producer import ScriptedEngine

    from dapo_lightning.rollout.session import EngineSession

    torch.set_num_threads(2)
    share = SharedCores(2, 2)
    given = EngineSession(ScriptedEngine(), cores=share)
    assert given.engine.fit_threads == share.fit_rollout
    policy = torch.nn.Linear(2, 2)
    built = EngineSession("hf", tokenizer=_Tok(), cores=share)
    built.attach(lambda: policy)
    assert built.build_engine().fit_threads == share.fit_rollout
    plain = EngineSession("hf", tokenizer=_Tok())
    plain.attach(lambda: policy)
    assert plain.build_engine().fit_threads is None
    seen: list[int | None] = []

    def rollout():
        share.rollout_thread_starts()  # its share while the update runs: 1
        built.engine._before_decode_step()  # the HF engine's next decode step
        seen.append(torch.get_num_threads())

    share.rollout_started()
    worker = threading.Thread(target=rollout)
    with share.update_waits():  # the update waits for the batch: the rollout thread takes both
        worker.start()
        worker.join()
    assert seen == [share.rollout_alone] == [2]


class _Tok:
    eos_token_id = 0
    pad_token_id = 0


def test_one_step_off_fit_runs_each_micro_batch_on_the_rule_s_threads(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """A real fit of DAPOModule on 2 cores: the first update of a step starts while the rollout
    thread generates (it sleeps 0.3 s first: 1 thread), the second after a 1.5 s pause, when
    the rollout thread is idle (2 threads); the rollout thread decodes on 2 while the trainer
    waits for its batch, else on 1."""
    from test_datamodule import trainer
    from test_pipeline import hf_dm

    from dapo_lightning import BatchingConfig, DAPOModule
    from dapo_lightning.data import pipeline
    from dapo_lightning.update_loop import UpdateLoop

    monkeypatch.setattr(pipeline, "usable_cores", lambda: 2)
    torch.set_num_threads(2)
    records: list[tuple[int, bool, int]] = []  # (update of the step, generating, threads)
    rollout_threads: list[int] = []
    decode_steps: list[tuple[bool, int]] = []  # (the update waits, threads)
    real_fit, real_update, real_produce, real_fit_rollout = (
        shared_cores.SharedCores.fit_update,
        UpdateLoop.update,
        pipeline.OneStepOffStream.produce,
        shared_cores.SharedCores.fit_rollout,
    )

    def fit_rollout(self):
        waits = self.waiting
        threads = real_fit_rollout(self)
        if threads is not None:
            decode_steps.append((waits, threads))
        return threads

    def fit_update(self):
        generating = self.generating
        threads = real_fit(self)
        if current:  # not rollout_started's call at the hand-over
            records.append((current[0].step_updates, generating, threads))
        return threads

    def update(self, *args, **kwargs):
        current[:] = [self]
        if self.step_updates == 1:
            threading.Event().wait(1.5)  # the rollout thread finishes meanwhile
        return real_update(self, *args, **kwargs)

    def produce(self, *args, **kwargs):
        threading.Event().wait(0.3)
        rollout_threads.append(torch.get_num_threads())
        return real_produce(self, *args, **kwargs)

    current: list = []
    monkeypatch.setattr(shared_cores.SharedCores, "fit_update", fit_update)
    monkeypatch.setattr(shared_cores.SharedCores, "fit_rollout", fit_rollout)
    monkeypatch.setattr(UpdateLoop, "update", update)
    monkeypatch.setattr(pipeline.OneStepOffStream, "produce", produce)
    module = DAPOModule(
        str(tiny_checkpoint),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batching=BatchingConfig(mini_batch_size=1, micro_batch_size=1),
        parity_check_every=0,
    )
    dm = hf_dm(tiny_checkpoint, pipeline="one_step_off")
    trainer(tmp_path, 4, logger=False).fit(module, datamodule=dm)
    assert all(threads == (1 if generating else 2) for _, generating, threads in records)
    # old log-probs and the first update: beside the rollout thread; the second: alone
    assert {r for r in records if r[0] == 0} == {(0, True, 1)}
    assert {r for r in records if r[0] == 1} == {(1, False, 2)}
    assert len(records) >= 2 * 4  # every micro-batch of the 4 updates asked
    assert rollout_threads and set(rollout_threads) == {1}  # at the start of each batch
    # the HF engine's decode steps: both cores while the trainer waits (the first batch: it
    # waits from the start), one while it updates (the later batches, during the 1.5 s pause)
    assert all(threads == (2 if waits else 1) for waits, threads in decode_steps)
    assert {waits for waits, _ in decode_steps} == {True, False}
    assert torch.get_num_threads() == 2  # the run's choice again after the fit


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (None, SHARED_2),  # the default
        (False, "the update on 1, rollouts on 1"),
    ],
)
def test_the_start_up_line_says_how_the_cores_are_shared(monkeypatch, capsys, share, expected):
    from jsonargparse import Namespace

    from dapo_lightning.cli import run_setup

    monkeypatch.setattr(run_setup, "usable_cores", lambda: 2)
    sampling = Namespace(pipeline="one_step_off")
    if share is not None:
        sampling.one_step_off = Namespace(share_cores=share)
    config = Namespace(threads=2, data=Namespace(init_args=Namespace(dynamic_sampling=sampling)))
    run_setup.choose_run_threads(config, None)
    line = capsys.readouterr().err.strip()
    assert line.startswith("threads: 2 (threads: 2 set;")
    assert line.endswith(f"; pipeline one_step_off: {expected}")
