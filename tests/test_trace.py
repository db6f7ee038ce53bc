"""Phase spans (dapo_lightning/trace.py) and the PhaseTrace callback: the recorded spans' names,
threads and durations, and in a real fit that one-step-off rollouts run on their own thread
while the main thread updates (sync: one after the other, on the main thread)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from dapo_lightning.callbacks import PhaseTrace
from test_datamodule import trainer
from test_pipeline import hf_dm

from dapo_lightning.trace import PhaseRecorder, phase, read_spans


def test_spans_keep_name_thread_and_duration(tmp_path):
    with PhaseRecorder() as recorder:
        with phase("outer"):
            time.sleep(0.05)
            with phase("threaded"):
                time.sleep(0.01)
        other = threading.Thread(target=lambda: _sleep_in("on w", 0.03), name="w")
        other.start()
        other.join()
    with phase("after"):  # not recording any more
        pass
    path = recorder.write(tmp_path / "t" / "trace.json")
    spans = {s["name"]: s for s in read_spans(path)}
    assert set(spans) == {"outer", "threaded", "on w"}
    assert spans["outer"]["thread"] == threading.current_thread().name
    assert spans["on w"]["thread"] == "w"
    assert spans["outer"]["dur"] >= 50_000  # microseconds
    assert 30_000 <= spans["on w"]["dur"] < 1_000_000
    assert spans["outer"]["ts"] <= spans["threaded"]["ts"]  # nested: inside its parent
    assert spans["threaded"]["ts"] + spans["threaded"]["dur"] <= (
        spans["outer"]["ts"] + spans["outer"]["dur"]
    )
    raw = json.loads(path.read_text())
    assert {e["ph"] for e in raw["traceEvents"]} == {"M", "X"}  # Chrome's format


def _sleep_in(name: str, seconds: float) -> None:
    with phase(name):
        time.sleep(seconds)


def test_one_recorder_at_a_time():
    with PhaseRecorder(), pytest.raises(RuntimeError, match="already recording"):
        PhaseRecorder().__enter__()


def test_filename_is_checked():
    with pytest.raises(ValueError, match="PhaseTrace.filename"):
        PhaseTrace("a/b.json")


def overlap_s(a: list[dict], b: list[dict]) -> float:
    """Seconds during which a span of ``a`` and a span of ``b`` both run."""
    total = 0.0
    for x in a:
        for y in b:
            start = max(x["ts"], y["ts"])
            end = min(x["ts"] + x["dur"], y["ts"] + y["dur"])
            total += max(0.0, end - start) / 1e6
    return total


@pytest.mark.parametrize("pipeline", ["sync", "one_step_off"])
def test_fit_writes_the_phases_and_one_step_off_overlaps_them(tiny_checkpoint, tmp_path, pipeline):
    from dapo_lightning import BatchingConfig, DAPOModule

    module = DAPOModule(
        str(tiny_checkpoint),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batching=BatchingConfig(mini_batch_size=1, micro_batch_size=8),
        parity_check_every=0,
    )
    dm = hf_dm(tiny_checkpoint, pipeline=pipeline)
    callback = PhaseTrace()
    trainer(tmp_path, 8, callbacks=[callback], logger=False).fit(module, datamodule=dm)
    assert callback.path == tmp_path / "phase_trace.json"
    spans = read_spans(callback.path)
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert len(by_name["update"]) == 4  # 4 rollout steps of 2 updates
    assert {s["thread"] for s in by_name["update"]} == {"MainThread"}
    rollout_threads = {s["thread"] for s in by_name["rollout"]}
    if pipeline == "sync":
        assert rollout_threads == {"MainThread"}
        assert len(by_name["rollout"]) == 4
        assert overlap_s(by_name["rollout"], by_name["update"]) == 0.0
        assert "wait for batch" not in by_name
        assert "weight push" not in by_name  # the HF engine samples with the module itself
    else:
        assert len(rollout_threads) == 1 and rollout_threads != {"MainThread"}
        assert next(iter(rollout_threads)).startswith("dapo-rollout")
        assert len(by_name["rollout"]) == 5  # the batch after the last step is in flight
        assert overlap_s(by_name["rollout"], by_name["update"]) > 0.0  # the point of it
        assert len(by_name["wait for batch"]) >= 1
        # into the engine's own copy at each hand-over: batches 0 and 1 sample with the
        # initial weights, batches 2, 3 and 4 with those after steps 0, 1 and 2
        assert len(by_name["weight push"]) == 3


def test_a_failed_fit_writes_its_spans_and_stops_recording(tiny_checkpoint, tmp_path):
    """An exception in training: the trace up to it is written and the recorder is released
    (a second fit in the same process records again)."""
    from dapo_lightning import BatchingConfig, DAPOModule

    class Failing(DAPOModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    module = Failing(
        str(tiny_checkpoint),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batching=BatchingConfig(mini_batch_size=1, micro_batch_size=8),
        parity_check_every=0,
    )
    callback = PhaseTrace("failed.json")
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, 8, callbacks=[callback], logger=False).fit(
            module, datamodule=hf_dm(tiny_checkpoint)
        )
    names = [s["name"] for s in read_spans(tmp_path / "failed.json")]
    assert names.count("update") == 1 and names.count("rollout") == 2
    with PhaseRecorder():  # released
        pass
