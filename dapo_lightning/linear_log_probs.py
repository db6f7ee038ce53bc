"""The fused output head: per-row ``log_softmax((W h + b) / tau)[y]`` and entropy computed
chunk by chunk of rows, without ever holding ``[N, V]`` logits (:class:`LinearLogProbs`, an
autograd function that recomputes each chunk's logits in backward).

:func:`~dapo_lightning.logprobs.response_log_probs` runs a causal LM's output head through it
(its "fused" path; the memory of both paths is in that module's docstring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dapo_lightning.precision import reduced_input_float32_gemm

#: Target size of one chunk's float32 logits in the fused path (``chunk_size="auto"``).
AUTO_CHUNK_BYTES = 32 * 2**20


def auto_chunk_rows(vocab_size: int, chunk_bytes: int = AUTO_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's float32 logits ``[rows, V]`` take ``chunk_bytes``:
    ``max(1, chunk_bytes // (4 * V))`` (170 rows for V = 49152 and 32 MiB)."""
    return max(1, chunk_bytes // (4 * vocab_size))


# ============================================================================ fused head
class _ChunkBuffers:
    """The ``[rows, V]`` buffers that every chunk of one fused call writes into.

    A fresh ``[rows, V]`` tensor per chunk and op is a fresh allocation of ~32 MiB, which the
    CPU allocator takes from (and returns to) the OS, paying a page fault per 4 KiB page on first
    touch: measured here, ``exp`` into a fresh tensor took 6-40x as long as into a reused one,
    more the larger the process. One set per call: ``logits`` (``acc`` dtype: log-softmax
    statistics), ``probs`` (``acc``) and ``product`` (the compute dtype GEMM output, None when
    that is ``acc``).
    """

    def __init__(self, rows: int, vocab: int, compute: torch.dtype, acc: torch.dtype, like: Tensor):
        self.logits = like.new_empty(rows, vocab, dtype=acc)
        self.probs = like.new_empty(rows, vocab, dtype=acc)
        self.product = None if compute == acc else like.new_empty(rows, vocab, dtype=compute)

    def chunk_logits(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
    ) -> Tensor:
        """One chunk's tempered logits ``z = (h W^T + b) / temperature`` in ``self.logits``.

        ``h W^T`` runs in ``weight``'s dtype (the compute dtype, as the model's own head would
        run it, e.g. bf16 under autocast) and is upcast to ``acc`` (float32, or float64 for
        float64 inputs) before the bias, the temperature and every softmax statistic.
        """
        rows = hidden.shape[0]
        z = self.logits[:rows]
        h = hidden.to(weight.dtype)
        if self.product is None:
            torch.mm(h, weight.T, out=z)
        else:
            z.copy_(torch.mm(h, weight.T, out=self.product[:rows]))
        if bias is not None:
            z += bias.to(z.dtype)
        if temperature != 1.0:
            z /= temperature
        return z

    def softmax_sum(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``(m, s)`` with ``m = max_v z`` and ``s = sum_v exp(z - m)`` (``[rows, 1]`` each), the
        unnormalised ``exp(z - m)`` left in ``self.probs``; ``lse = m + log s``."""
        m = z.amax(-1, keepdim=True)
        m.masked_fill_(m.isinf(), 0.0)  # an all -inf (or +inf) row: lse = -inf (+inf)
        e = torch.sub(z, m, out=self.probs[: z.shape[0]]).exp_()
        return m, e.sum(-1, keepdim=True)


class LinearLogProbs(torch.autograd.Function):
    """Fused ``linear -> log_softmax -> gather (+ entropy)`` over rows, in chunks of rows.

    For row ``i`` with hidden state ``h_i``, target ``y_i`` and ``z_i = (W h_i + b) / tau``::

        lse_i   = log sum_v exp(z_iv)
        logp_i  = z_i[y_i] - lse_i
        H_i     = -sum_v p_iv log p_iv,          p_iv = exp(z_iv - lse_i)

    Backward, with upstream gradients ``g_i = dL/dlogp_i`` and ``e_i = dL/dH_i``::

        dL/dz_iv = g_i (1[v = y_i] - p_iv) - e_i p_iv (log p_iv + H_i)
        dL/dh_i  = W^T dL/dz_i / tau,   dL/dW = sum_i dL/dz_i h_i^T / tau,
        dL/db    = sum_i dL/dz_i / tau

    Only ``hidden``, ``W`` in the compute dtype (``weight`` itself when it already is; one cast
    per forward/backward pair), ``bias``, ``targets``, ``lse`` and ``H`` are saved; each chunk's
    logits are recomputed in backward. ``dL/dW`` is accumulated over chunks in float32 by an
    in-place float32 GEMM on the float32 ``dL/dz`` (no bf16 rounding of the chunk products; on
    CPU it also beats a bf16 GEMM followed by a float32 add of its ``[V, H]`` result); with a
    bf16 / fp16 compute dtype that GEMM rounds its inputs (bf16 on CPU, TF32 on CUDA:
    :func:`~dapo_lightning.precision.reduced_input_float32_gemm`). Every ``[rows, V]``
    intermediate lives in one set of :class:`_ChunkBuffers` per call.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        compute_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(compute_dtype, torch.float32)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_zeros(n, dtype=acc)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            buf = _ChunkBuffers(min(n, chunk_size), w.shape[0], compute_dtype, acc, hidden)
            for s in range(0, n, chunk_size):
                e = min(n, s + chunk_size)
                z = buf.chunk_logits(hidden[s:e], w, bias, temperature)
                m, total = buf.softmax_sum(z)
                lse_c = m.add_(total.log())
                lse[s:e] = lse_c.squeeze(-1)
                logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
                if with_entropy:  # H = -sum p log p, the product in place on p
                    log_p = z.sub_(lse_c)
                    p = buf.probs[: e - s].div_(total)
                    entropy[s:e] = -p.mul_(log_p).sum(-1)
        ctx.save_for_backward(hidden, w, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        ctx.weight_dtype = weight.dtype
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:
        hidden, w, bias, targets, lse, entropy = ctx.saved_tensors  # w: compute dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tau, cd = ctx.temperature, ctx.compute_dtype
        acc = lse.dtype
        n = hidden.shape[0]
        if g_logp is None:
            g_logp = lse.new_zeros(n)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # the first chunk's product starts it: no [V, H] zero fill
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            buf = _ChunkBuffers(min(n, ctx.chunk_size), w.shape[0], cd, acc, hidden)
            for s in range(0, n, ctx.chunk_size):
                e = min(n, s + ctx.chunk_size)
                h = hidden[s:e].to(cd)
                z = buf.chunk_logits(h, w, bias, tau)
                z -= lse[s:e, None]  # log p
                p = torch.exp(z, out=buf.probs[: e - s])
                g = g_logp[s:e, None].to(acc)
                if g_ent is not None:  # p * (g + e (log p + H)), in place on z
                    coef = z.add_(entropy[s:e, None]).mul_(g_ent[s:e, None].to(acc)).add_(g)
                    dz = p.mul_(coef).neg_()
                else:
                    dz = p.mul_(-g)
                dz.scatter_add_(-1, targets[s:e, None], g)
                if tau != 1.0:
                    dz /= tau
                if need_w:
                    h_acc = h.to(acc)
                    with reduced_input_float32_gemm(hidden.device.type, cd):
                        grad_w = dz.T @ h_acc if grad_w is None else grad_w.addmm_(dz.T, h_acc)
                if grad_b is not None:
                    grad_b += dz.sum(0)
                if grad_h is not None:
                    dz_c = dz if buf.product is None else buf.product[: e - s].copy_(dz)
                    grad_h[s:e] = dz_c @ w
        if need_w and grad_w is None:  # no rows
            grad_w = torch.zeros(w.shape, dtype=acc, device=w.device)
        grad_w = grad_w.to(ctx.weight_dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def fused_linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-row ``log_softmax((W h + b) / temperature)[y]`` and entropy, without ``[N, V]`` logits.

    Args:
        hidden: ``[N, H]`` hidden states (the inputs of the output head).
        weight: ``[V, H]`` output-embedding weight; ``bias``: ``[V]`` or None.
        targets: ``[N]`` token ids.
        temperature: Logits are divided by it before the softmax.
        chunk_size: Rows per chunk (default :func:`auto_chunk_rows`).
        with_entropy: Also return the entropies (differentiable).
        compute_dtype: Dtype of the matmuls (default: the autocast dtype when autocast is on for
            ``hidden``'s device, else ``promote(hidden, weight)``). Softmax statistics run in
            ``promote(compute_dtype, float32)``.

    Returns:
        ``(logp [N], entropy [N] or None)`` in float32 (float64 for float64 inputs). See
        :class:`LinearLogProbs` for the formulas and the gradients.
    """
    if compute_dtype is None:
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):
            compute_dtype = torch.get_autocast_dtype(dev)
        else:
            compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows = chunk_size if chunk_size is not None else auto_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_size must be >= 1 rows, got {rows}.")
    logp, entropy = LinearLogProbs.apply(
        hidden, weight, bias, targets, float(temperature), rows, with_entropy, compute_dtype
    )
    return logp, entropy if with_entropy else None
