"""The fused chunked log-prob / entropy head against the naive float32-logits path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning.linear_log_probs import LinearLogProbs, auto_chunk_rows, fused_linear_log_probs
from dapo_lightning.logprobs import output_head, response_log_probs
from dapo_lightning.precision import reduced_input_float32_gemm
from dapo_lightning.shared_prompts import shared_prompt_log_probs
from dapo_lightning.testing import (
    make_random_rollout_batch,
    make_tiny_checkpoint,
    one_process_group,
)
from tests._tolerance import float32_reorder_bound

#: Two float32 evaluations of a log-softmax over the tiny model's 259-token vocabulary in
#: another order (tests/_tolerance.py).
VOCAB_BOUND = float32_reorder_bound(259)

B, L, T = 3, 24, 14


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied, as the brief asks
    return m.train()


def _batch(seed: int = 0, vocab: int = 259) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, -4:] = 0  # right padding in the response
    ids[mask == 0] = 0
    return ids, mask


def _reference(logits: torch.Tensor, targets: torch.Tensor, tau: float):
    """Independent float64 computation: explicit softmax, ``H = -sum p log p``."""
    z = logits.double() / tau
    logq = z - z.exp().sum(-1, keepdim=True).log()
    return logq.gather(-1, targets[..., None]).squeeze(-1), -(logq.exp() * logq).sum(-1)


def _assert_grads_close(got: dict, ref: dict, prefix: str = "") -> None:
    """Float32 rounding scales with each tensor's magnitude: atol = 1e-6 * max |grad|."""
    assert ref
    for name, g in ref.items():
        other = got[prefix + name]
        other = other.full_tensor() if hasattr(other, "full_tensor") else other
        atol = 1e-6 * float(g.abs().max())
        torch.testing.assert_close(other, g, atol=atol, rtol=1e-4, msg=name)


def _loss_grads(model, ids, mask, w1, w2, **kw):
    model.zero_grad(set_to_none=True)
    logp, ent = response_log_probs(model, ids, mask, T, with_entropy=True, **kw)
    (w1 * logp + w2 * ent).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), ent.detach(), grads


# ---------------------------------------------------------------- forward values
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", ["auto", 1, 5])
def test_forward_equals_naive_and_reference(model, tau, chunk_size):
    ids, mask = _batch()
    with torch.no_grad():
        naive = response_log_probs(
            model, ids, mask, T, temperature=tau, with_entropy=True, chunk_size=None
        )
        fused = response_log_probs(
            model, ids, mask, T, temperature=tau, with_entropy=True, chunk_size=chunk_size
        )
        from dapo_lightning.logprobs import position_ids_from_mask

        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits[:, L - T - 1 : -1]
    ref_logp, ref_ent = _reference(logits, ids[:, L - T :], tau)
    for got in (naive, fused):
        assert got[0].dtype == got[1].dtype == torch.float32
        assert got[0].shape == got[1].shape == (B, T)
        torch.testing.assert_close(got[0].double(), ref_logp, atol=2e-5, rtol=0)
        torch.testing.assert_close(got[1].double(), ref_ent, atol=2e-5, rtol=0)
    # the fused head sums the log-sum-exp over the 259-token vocabulary in chunks: another order
    torch.testing.assert_close(fused[0], naive[0], atol=VOCAB_BOUND, rtol=0)
    assert "forward" not in vars(model.lm_head)  # the head's forward is restored


@pytest.mark.parametrize("n,h,v,chunk", [(1, 3, 5, 1), (17, 8, 33, 4), (64, 16, 1000, 7)])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_function_random_shapes_match_reference(n, h, v, chunk, tau):
    gen = torch.Generator().manual_seed(n + v)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    bias = torch.randn(v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    logp, ent = fused_linear_log_probs(
        hidden, weight, y, bias, temperature=tau, chunk_size=chunk, with_entropy=True
    )
    ref_logp, ref_ent = _reference(hidden.double() @ weight.double().T + bias.double(), y, tau)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-5)
    logp_only, none = fused_linear_log_probs(hidden, weight, y, bias, temperature=tau)
    assert none is None
    torch.testing.assert_close(logp_only, logp)


def test_auto_chunk_rows():
    assert auto_chunk_rows(49152) == 170  # 32 MiB / (4 * 49152)
    assert auto_chunk_rows(10**9) == 1
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_log_probs(
            torch.ones(2, 2), torch.ones(3, 2), torch.zeros(2).long(), chunk_size=0
        )


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_gradcheck_float64(tau):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=gen)

    def both(h, w, b):
        return LinearLogProbs.apply(h, w, b, y, tau, 3, True, torch.float64)

    def logp_only(h, w, b):
        return LinearLogProbs.apply(h, w, b, y, tau, 2, False, torch.float64)[0]

    def entropy_only(h, w, b):
        return LinearLogProbs.apply(h, w, b, y, tau, 5, True, torch.float64)[1]

    for fn in (both, logp_only, entropy_only):
        assert torch.autograd.gradcheck(fn, (hidden, weight, bias))
    with pytest.raises(RuntimeError):  # once_differentiable: no double backward
        out = both(hidden, weight, bias)[0].sum()
        (g,) = torch.autograd.grad(out, hidden, create_graph=True)
        g.sum().backward()


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_parameter_grads_equal_naive_tied_qwen2(model, tau):
    ids, mask = _batch(1)
    gen = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    naive = _loss_grads(model, ids, mask, w1, w2, temperature=tau, chunk_size=None)
    fused = _loss_grads(model, ids, mask, w1, w2, temperature=tau, chunk_size=4)
    torch.testing.assert_close(fused[0], naive[0], atol=VOCAB_BOUND, rtol=0)  # chunked sums
    torch.testing.assert_close(fused[1], naive[1], atol=VOCAB_BOUND, rtol=0)
    assert naive[2].keys() == fused[2].keys()
    _assert_grads_close(fused[2], naive[2])
    # the tied matrix gets the head's contribution too: the input embedding alone touches only
    # the rows of tokens in the batch, the head touches every row
    emb = fused[2]["model.embed_tokens.weight"]
    unused = torch.ones(emb.shape[0], dtype=torch.bool)
    unused[ids.unique()] = False
    assert emb[unused].abs().sum() > 0


def test_entropy_without_grad_and_logp_only(model):
    ids, mask = _batch(2)
    gen = torch.Generator().manual_seed(4)
    w1 = torch.randn(B, T, generator=gen)
    grads = []
    for cs in (None, 3):
        model.zero_grad(set_to_none=True)
        logp, ent = response_log_probs(
            model, ids, mask, T, with_entropy=True, entropy_grad=False, chunk_size=cs
        )
        assert not ent.requires_grad and logp.requires_grad
        (w1 * logp).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        logp2, none = response_log_probs(model, ids, mask, T, chunk_size=cs)
        assert none is None
        torch.testing.assert_close(logp2, logp)
    _assert_grads_close(grads[1], grads[0])


# ---------------------------------------------------------------- bf16
def test_bf16_weights_and_autocast_close_to_float32(model, tiny_checkpoint):
    ids, mask = _batch(3)
    with torch.no_grad():
        ref_logp, ref_ent = response_log_probs(
            model, ids, mask, T, with_entropy=True, chunk_size=None
        )
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).train()
    gen = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    runs = {}
    for cs in (None, 4):
        bf16.zero_grad(set_to_none=True)
        logp, ent = response_log_probs(bf16, ids, mask, T, with_entropy=True, chunk_size=cs)
        assert logp.dtype == ent.dtype == torch.float32
        (w1 * logp + w2 * ent).sum().backward()
        runs[cs] = (logp.detach(), ent.detach(), bf16.lm_head.weight.grad.float())
        assert bf16.lm_head.weight.grad.dtype == torch.bfloat16
    for logp, ent, _ in runs.values():
        torch.testing.assert_close(logp, ref_logp, atol=0.1, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=0.1, rtol=0)
    torch.testing.assert_close(runs[4][0], runs[None][0], atol=1e-5, rtol=0)  # same bf16 logits
    torch.testing.assert_close(runs[4][1], runs[None][1], atol=1e-4, rtol=0)
    g_fused, g_naive = runs[4][2], runs[None][2]
    assert (g_fused - g_naive).norm() / g_naive.norm() < 0.02

    # bf16 autocast over float32 weights (the benchmark's bf16-mixed): head matmul in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = [
            response_log_probs(model, ids, mask, T, with_entropy=True, chunk_size=cs)
            for cs in (None, 4)
        ]
    torch.testing.assert_close(auto[1][0], auto[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(auto[1][1], auto[0][1], atol=1e-4, rtol=0)
    torch.testing.assert_close(auto[1][0], ref_logp, atol=0.1, rtol=0)


def test_autocast_head_weight_grad_accumulates_in_float32(model):
    """Under bf16 autocast over float32 weights, the fused head's dL/dW (float32 dL/dz chunks
    summed by a float32 GEMM on bf16-rounded inputs, the bf16 W of forward reused in backward)
    is within 2% of the exact float32 gradient and no further from it than the naive path's
    bf16 GEMM (measured here: 0.0056 fused, 0.0058 naive; bf16 hidden states dominate both)."""
    ids, mask = _batch(3)
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(B, T, generator=gen)

    def head_grad(cs, autocast: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = response_log_probs(model, ids, mask, T, chunk_size=cs)
        (w1 * logp).sum().backward()
        return model.lm_head.weight.grad.clone()

    exact = head_grad(None, autocast=False)
    fused, naive = head_grad(4, autocast=True), head_grad(None, autocast=True)
    err_fused = ((fused - exact).norm() / exact.norm()).item()
    err_naive = ((naive - exact).norm() / exact.norm()).item()
    assert err_fused < 0.02 and err_fused <= err_naive * 1.05, (err_fused, err_naive)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="CPU without bf16 instructions"
)
def test_reduced_input_float32_gemm_is_no_coarser_than_a_bf16_gemm_and_restores():
    """Inside the context the CPU float32 GEMM runs in oneDNN's bf16 mode (the flag is set) and
    its error against the float64 product is within a bf16 GEMM's (what the autocast head's own
    GEMM gives): bf16-rounded inputs, then float32 sums (this AVX512-bf16 EPYC: 1e-7 from the
    product of the rounded inputs) or, on CI's CPU, 2.6e-3 from it (oneDNN's kernel differs),
    no worse than the bf16 GEMM's 4e-3; outside it is the plain float32 GEMM; the flag is
    restored, also after an exception."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 300, generator=gen), torch.randn(300, 48, generator=gen)
    exact = a.double() @ b.double()
    bf16_gemm = (a.bfloat16() @ b.bfloat16()).double()  # output rounded to bf16, as autocast's
    flag = torch.backends.mkldnn.matmul.fp32_precision
    rel = lambda x, ref: float((x.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    with reduced_input_float32_gemm("cpu", torch.bfloat16):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        got = torch.zeros(64, 48).addmm_(a, b)  # the in-place form the head's backward uses
    assert got.dtype == torch.float32
    assert rel(got, exact) <= 1.5 * rel(bf16_gemm, exact), (rel(got, exact), rel(bf16_gemm, exact))
    float32_gemm = float32_reorder_bound(300)  # dot products of 300 terms
    assert rel(a @ b, exact) < float32_gemm  # outside: float32
    for device, dtype in (("cpu", torch.float32), ("cpu", torch.float16), ("meta", torch.bfloat16)):
        with reduced_input_float32_gemm(device, dtype):  # no rounding coarser than the dtype's
            assert rel(a @ b, exact) < float32_gemm
    with pytest.raises(RuntimeError), reduced_input_float32_gemm("cpu", torch.bfloat16):
        raise RuntimeError
    assert torch.backends.mkldnn.matmul.fp32_precision == flag


# ---------------------------------------------------------------- memory
def _saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of distinct storages autograd saves for backward while ``fn`` runs (parameters
    excluded: both paths keep the same ones)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def test_fused_saves_far_less_than_naive_32k_vocab(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "v32k", vocab_size=32768, num_hidden_layers=1)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(3, 32768, (4, 16 + 256))
    mask = torch.ones_like(ids)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def run(cs):
        return lambda: response_log_probs(m, ids, mask, 256, with_entropy=True, chunk_size=cs)

    # the decoder's own activations: the same forward with one position's logits
    body = _saved_bytes(lambda: m(input_ids=ids, attention_mask=mask, logits_to_keep=1), params)
    naive, fused = _saved_bytes(run(None), params), _saved_bytes(run("auto"), params)
    logits_bytes = 4 * 256 * 32768 * 4  # one float32 [4, 256, V] tensor: 128 MiB
    assert naive - body >= 3 * logits_bytes  # log_softmax out, softmax out, logits (entropy)
    # fused extra: the [1024, 128] hidden states and 3 per-row vectors, nothing of size V
    assert fused - body <= 4 * 256 * (128 + 3) * 4 + 4 * 257 * 128 * 4
    assert fused < naive / 10


# ---------------------------------------------------------------- wrappers and fallbacks
def test_output_head_through_wrappers_and_fallback_on_postprocessed_logits(model):
    assert output_head(model) is model.lm_head
    assert output_head(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    assert output_head(Wrapper(Wrapper(model))) is model.lm_head

    ids, mask = _batch(4)
    with torch.no_grad():
        naive = response_log_probs(model, ids, mask, T, with_entropy=True, chunk_size=None)
        handle = model.register_forward_hook(
            lambda mod, args, out: out.__setitem__("logits", out["logits"] * 1.0) or out
        )  # a model that transforms its head's output (like logit soft-capping)
        try:
            with pytest.warns(UserWarning, match="naive path"):
                got = response_log_probs(model, ids, mask, T, with_entropy=True)
        finally:
            handle.remove()
    torch.testing.assert_close(got[0], naive[0])
    torch.testing.assert_close(got[1], naive[1])


def test_naive_path_when_no_linear_head_or_head_forward_is_hooked(model, monkeypatch):
    ids, mask = _batch(6)
    with torch.no_grad():
        naive = response_log_probs(model, ids, mask, T, chunk_size=None)[0]
        fused = response_log_probs(model, ids, mask, T, chunk_size=2)[0]
        assert not torch.equal(fused, naive)  # the paths differ in float32 rounding
        with monkeypatch.context() as mp:
            mp.setattr(model, "get_output_embeddings", lambda: None)
            assert output_head(model) is None
            assert torch.equal(response_log_probs(model, ids, mask, T, chunk_size=2)[0], naive)
        with monkeypatch.context() as mp:  # an instance forward, like accelerate's offload hook
            mp.setattr(model.lm_head, "forward", model.lm_head.forward)
            assert torch.equal(response_log_probs(model, ids, mask, T, chunk_size=2)[0], naive)
            assert "forward" in vars(model.lm_head)  # left in place
    assert "forward" not in vars(model.lm_head)


def test_grads_under_ddp_and_fsdp2_equal_naive(tiny_checkpoint, tmp_path, monkeypatch):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import dapo_lightning.logprobs as lp

    fused_calls = []  # the fused head must really run inside the wrapped forward (no fallback)
    real = lp.fused_linear_log_probs
    monkeypatch.setattr(
        lp, "fused_linear_log_probs", lambda *a, **k: fused_calls.append(1) or real(*a, **k)
    )
    ids, mask = _batch(5)
    gen = torch.Generator().manual_seed(6)
    w1, w2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)

    def fresh():
        return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).train()

    _, _, ref = _loss_grads(fresh(), ids, mask, w1, w2, temperature=0.7, chunk_size=None)
    with one_process_group(tmp_path / "pg"):  # or the group an in-process vLLM left
        ddp = torch.nn.parallel.DistributedDataParallel(fresh())
        _, _, got = _loss_grads(ddp, ids, mask, w1, w2, temperature=0.7, chunk_size=4)
        _assert_grads_close(got, ref, prefix="module.")
        assert len(fused_calls) == 1

        sharded = fresh()
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        _, _, got = _loss_grads(sharded, ids, mask, w1, w2, temperature=0.7, chunk_size=4)
        assert isinstance(got["model.embed_tokens.weight"], DTensor)
        _assert_grads_close(got, ref)
        assert len(fused_calls) == 2
        assert isinstance(sharded.lm_head.weight, DTensor)  # sharded again after the step


# ---------------------------------------------------------------- shared prompts
@pytest.fixture(scope="module")
def model64(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).train()


def _grouped(response_lengths=None):
    """3 prompts of different lengths (left padding) x 4 responses (right padding)."""
    return make_random_rollout_batch(
        num_groups=3, group_size=4, prompt_lengths=[5, 9, 3], response_lengths=response_lengths
    )


@pytest.mark.parametrize("chunk_size", [None, "auto"], ids=["naive", "fused"])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_shared_prompts_give_the_log_probs_and_gradients_of_whole_rows(model64, chunk_size, tau):
    """Each prompt once, then the responses against its keys and values: the same numbers as
    every row run whole (float64 model; the tiny Qwen2's RMSNorm computes in float32, so the
    gradients agree to float32 rounding)."""
    b = _grouped()
    gen = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(b.response_mask.shape, generator=gen, dtype=torch.float64) for _ in "12")
    out = {}
    for share in (False, True):
        model64.zero_grad(set_to_none=True)
        run = shared_prompt_log_probs if share else response_log_probs
        logp, ent = run(
            model64, b.input_ids, b.attention_mask, b.response_width, temperature=tau,
            with_entropy=True, chunk_size=chunk_size,
        )  # fmt: skip
        m = b.response_mask
        (w1 * logp * m + w2 * ent * m).sum().backward()
        grads = {n: p.grad.clone() for n, p in model64.named_parameters()}
        out[share] = (logp * m, ent * m, grads)
    (logp, ent, grads), (logp_s, ent_s, grads_s) = out[False], out[True]
    # the first response token comes from the prompt pass's logits (naive), the rest from the
    # response pass (fused where the head is): the paths' own float32-level difference
    atol = 1e-12 if chunk_size is None else 2e-6
    torch.testing.assert_close(logp_s, logp, atol=atol, rtol=0)
    torch.testing.assert_close(ent_s, ent, atol=atol, rtol=0)
    for name, g in grads.items():
        # the tiny model's RMSNorm rounds to float32 (module docstring): a sum over its 128-wide
        # hidden state in another order, relative to the gradient's scale
        bound = float32_reorder_bound(128) * float(g.abs().max())
        torch.testing.assert_close(grads_s[name], g, atol=bound, rtol=0)


def test_shared_prompts_run_each_prompt_once_and_fall_back_where_none_repeats(model64):
    b = _grouped()
    seen = []
    hook = model64.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        with torch.no_grad():
            got = shared_prompt_log_probs(model64, b.input_ids, b.attention_mask, b.response_width)
            assert got is not None and got[0].shape == b.response_mask.shape
            # prompt pass: the 3 distinct prompts; response pass: the 12 responses
            assert seen == [(3, b.prompt_width), (12, b.response_width)]
            distinct = b.select([0, 4, 8]).trim()  # one row of each group
            assert shared_prompt_log_probs(
                model64, distinct.input_ids, distinct.attention_mask, distinct.response_width
            ) is None  # fmt: skip
            one = _grouped(response_lengths=[1]).trim()  # one response token: the prompt pass
            logp, _ = shared_prompt_log_probs(
                model64, one.input_ids, one.attention_mask, one.response_width
            )
            whole, _ = response_log_probs(
                model64, one.input_ids, one.attention_mask, one.response_width, chunk_size=None
            )
            torch.testing.assert_close(logp, whole, atol=1e-12, rtol=0)
    finally:
        hook.remove()


def test_no_shared_prompts_under_gradient_checkpointing(tiny_checkpoint):
    """Hugging Face turns the cache off under gradient checkpointing: every row runs whole."""
    m = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    b = _grouped()
    assert shared_prompt_log_probs(m, b.input_ids, b.attention_mask, b.response_width) is None


# ---------------------------------------------------------------- benchmark smoke
@pytest.mark.timeout(120)
def test_logprob_memory_benchmark_quick():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    png = root / "benchmarks" / "out" / "logprob_memory_quick.png"
    png.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.logprob_memory", "--quick"],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "[naive (old)]: peak RSS" in proc.stdout and "[fused (new)]: peak RSS" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
