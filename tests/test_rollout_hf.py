"""HFRolloutEngine: sampling-distribution log-probs, stopping, RNG, and the pure logit processing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.rollout import HFRolloutEngine, RolloutEngine, SamplingConfig
from dapo_lightning.rollout.hf import process_logits
from dapo_lightning.rollout.parity import logprob_parity
from dapo_lightning.testing import completions_to_batch


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _prompts(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_is_a_rollout_engine(model, tokenizer):
    assert isinstance(HFRolloutEngine(model, tokenizer, seed=0), RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_training_forward_with_left_padding(model, tokenizer, temperature):
    engine = HFRolloutEngine(model, tokenizer, seed=1)
    prompts = _prompts(tokenizer, ["What is 2+2?", "Hi", "A much longer prompt here, ok."])
    sampling = SamplingConfig(max_tokens=12, temperature=temperature)
    completions = engine.generate(prompts, n=3, sampling=sampling)
    assert [len(g) for g in completions] == [3, 3, 3]
    batch = completions_to_batch(prompts, completions, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = response_log_probs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.response_width,
            temperature=temperature,
        )
    mask = batch.response_mask.bool()
    diff = (logp - batch.rollout_log_probs).abs()[mask]
    assert mask.sum() > 0
    assert diff.max().item() < 1e-5


def test_n_samples_differ_and_duplicates_differ(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, seed=2)
    prompt = _prompts(tokenizer, ["Tell me"])[0]
    out = engine.generate([prompt, prompt], n=4, sampling=SamplingConfig(max_tokens=16))
    seqs = {tuple(c.token_ids) for group in out for c in group}
    assert len(seqs) == 8


def test_max_tokens_gives_length(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, seed=3)
    prompts = _prompts(tokenizer, ["abc", "defgh"])
    out = engine.generate(prompts, n=2, sampling=SamplingConfig(max_tokens=5))
    for c in (c for g in out for c in g):
        if c.finish_reason == "length":
            assert len(c.token_ids) == 5
            assert tokenizer.eos_token_id not in c.token_ids
        else:
            assert c.token_ids[-1] == tokenizer.eos_token_id
        assert len(c.log_probs) == len(c.token_ids)


def test_eos_stops_and_is_included(model, tokenizer):
    # Greedy decoding is deterministic: take its 3rd token and declare it an end token.
    prompt = _prompts(tokenizer, ["Once upon"])[0]
    greedy = SamplingConfig(max_tokens=6, top_k=1)
    ref = HFRolloutEngine(model, tokenizer, seed=0).generate([prompt], 1, greedy)[0][0]
    stop_id = ref.token_ids[2]
    first = ref.token_ids.index(stop_id)
    engine = HFRolloutEngine(model, eos_token_id=[tokenizer.eos_token_id, stop_id], seed=0)
    other = _prompts(tokenizer, ["zzzzzzzzzzzzzz"])[0]  # a second, longer row keeps the batch going
    out = engine.generate([prompt, other], 1, SamplingConfig(max_tokens=6, top_k=1))
    c = out[0][0]
    assert c.finish_reason == "stop"
    assert c.token_ids == ref.token_ids[: first + 1]
    assert c.token_ids[-1] == stop_id


def test_top_k_1_is_greedy(model, tokenizer):
    prompt = _prompts(tokenizer, ["2+3="])[0]
    engine = HFRolloutEngine(model, tokenizer, seed=4)
    out = engine.generate([prompt], n=3, sampling=SamplingConfig(max_tokens=8, top_k=1))
    ids = torch.tensor([prompt])
    expected = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            expected.append(nxt)
            if nxt == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    for c in out[0]:
        assert c.token_ids == expected
        # one token keeps all the mass: log 1 = 0, computed in float32 over a 4-token support
        # (a few eps of 1.19e-07 at most)
        assert max(abs(x) for x in c.log_probs) < 1e-6


def test_rng_state_round_trip(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, seed=5)
    prompts = _prompts(tokenizer, ["x", "yy"])
    sampling = SamplingConfig(max_tokens=10, top_p=0.9)
    state = engine.state_dict()
    a = engine.generate(prompts, 2, sampling)
    b = engine.generate(prompts, 2, sampling)
    assert a != b
    fresh = HFRolloutEngine(model, tokenizer, seed=999)
    fresh.load_state_dict(state)
    assert fresh.generate(prompts, 2, sampling) == a


def test_chunking_restores_train_mode_and_shapes(model, tokenizer):
    model.train()
    try:
        engine = HFRolloutEngine(model, tokenizer, max_batch_size=3, seed=6)
        prompts = _prompts(tokenizer, ["a", "bb", "ccc", "dddd"])
        out = engine.generate(prompts, 2, SamplingConfig(max_tokens=4))
        assert model.training
        assert [len(g) for g in out] == [2, 2, 2, 2]
        batch = completions_to_batch(prompts, out, tokenizer.pad_token_id)
        model.eval()
        with torch.no_grad():
            logp, _ = response_log_probs(
                model, batch.input_ids, batch.attention_mask, batch.response_width
            )
        diff = (logp - batch.rollout_log_probs).abs()[batch.response_mask.bool()]
        assert diff.max().item() < 1e-5
    finally:
        model.eval()


def test_load_weights_is_noop(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, seed=0)
    before = model.model.embed_tokens.weight.clone()
    engine.load_weights((n, torch.zeros_like(p)) for n, p in model.named_parameters())
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_bad_arguments_name_the_field(model, tokenizer):
    with pytest.raises(ValueError, match="max_batch_size"):
        HFRolloutEngine(model, tokenizer, max_batch_size=0)
    engine = HFRolloutEngine(model, tokenizer, seed=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingConfig(max_tokens=2))
    with pytest.raises(ValueError, match="n="):
        engine.generate([[5]], 0, SamplingConfig(max_tokens=2))


def test_process_logits_top_k_top_p():
    """Probabilities of 4 tokens in float32: a renormalised softmax of 4 terms is within a few
    eps (1.19e-07) of the exact value, so ``atol=1e-6`` holds on every CPU."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top_p=0.7: 0.5 alone is < 0.7, 0.5+0.3 >= 0.7 -> keep the first two, renormalised.
    logp = process_logits(logits, 1.0, -1, 0.7)
    assert torch.allclose(logp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_k=3 keeps the three largest.
    logp = process_logits(logits, 1.0, 3, 1.0)
    assert torch.allclose(logp.exp(), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)
    # temperature 0.5 squares and renormalises the probabilities.
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]) ** 2
    logp = process_logits(logits, 0.5, -1, 1.0)
    assert torch.allclose(logp.exp(), p / p.sum(), atol=1e-6)


# ---------------------------------------------------------------- parity (rollout/parity.py)


def test_logprob_parity_formulas():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    engine = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the -9 is padding and must be ignored
    out = logprob_parity(trainer, engine, mask)
    d = torch.tensor([0.5, 0.0, 0.0, -0.25])
    assert out["parity/mean_abs_diff"] == pytest.approx(0.1875)
    assert out["parity/max_abs_diff"] == pytest.approx(0.5)
    assert out["parity/tis_ratio_mean"] == pytest.approx(d.exp().mean().item())
    assert out["parity/tis_ratio_max"] == pytest.approx(torch.exp(torch.tensor(0.5)).item())
    assert out["parity/tokens"] == 4.0
    empty = logprob_parity(trainer, engine, torch.zeros_like(mask))
    assert empty["parity/max_abs_diff"] == 0.0 and empty["parity/tis_ratio_mean"] == 1.0
    with pytest.raises(ValueError, match="one shape"):
        logprob_parity(trainer, engine[:, :2], mask)


def test_logprob_parity_on_real_rollouts(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, seed=8)
    prompts = _prompts(tokenizer, ["one", "three"])
    out = engine.generate(prompts, 2, SamplingConfig(max_tokens=8))
    batch = completions_to_batch(prompts, out, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = response_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.response_width
        )
    stats = logprob_parity(logp, batch.rollout_log_probs, batch.response_mask)
    assert stats["parity/max_abs_diff"] < 1e-5
    assert stats["parity/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["parity/tokens"] == batch.response_mask.sum().item()
    # a different policy (temperature 2 scoring) is flagged
    with torch.no_grad():
        hot, _ = response_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.response_width, temperature=2.0
        )
    hot_stats = logprob_parity(hot, batch.rollout_log_probs, batch.response_mask)
    assert hot_stats["parity/max_abs_diff"] > 1e-2


def test_a_stop_request_ends_generation_between_decode_steps(model, tokenizer):
    """Issue 29: the engine polls ``should_stop`` before every decode step; once it is True the
    round ends with StopRequested after exactly the decode steps already under way (a long
    round no longer holds a SIGTERM), and the model's train mode is restored."""
    from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop

    forwards: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    polls = {"n": 0}

    def should_stop() -> bool:
        polls["n"] += 1
        if polls["n"] == 4:  # before the 4th decode step of 1000
            request_stop("SIGTERM")
        return polls["n"] >= 4

    engine = HFRolloutEngine(model, tokenizer, seed=0, eos_token_id=10**6, should_stop=should_stop)
    model.train()
    try:
        with pytest.raises(StopRequested, match="SIGTERM") as info:
            engine.generate(_prompts(tokenizer, ["abc"]), n=2, sampling=SamplingConfig(1000))
        assert info.value.exit_code == 143
        assert len(forwards) == 3 and model.training
    finally:
        handle.remove()
        clear_stop_request()
    # the default polls the process-wide request (a SIGTERM handler sets it)
    default = HFRolloutEngine(model, tokenizer, seed=0)
    request_stop("SIGINT")
    try:
        with pytest.raises(StopRequested, match="SIGINT"):
            default.generate(_prompts(tokenizer, ["abc"]), n=1, sampling=SamplingConfig(5))
    finally:
        clear_stop_request()
