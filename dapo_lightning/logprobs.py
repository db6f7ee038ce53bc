"""Token log-probabilities and entropies of a causal LM on ``[prompt | response]`` rows.

Two paths compute the same numbers:

* **fused** (default): the model's output head is applied chunk by chunk of response positions
  inside :class:`LinearLogProbs`, which keeps only per-row statistics and recomputes each chunk's
  logits in backward, so no ``[B, T, V]`` tensor is ever held;
* **naive** (``chunk_size=None``): the model returns float logits for the response positions
  and ``log_softmax`` over them is kept for backward.

Memory of the vocabulary-sized part of :func:`response_log_probs`, with ``N = B * T`` response
positions, vocabulary ``V``, hidden size ``H`` and ``c`` rows per chunk:

* fused (``chunk_size`` = rows, or ``"auto"`` = :func:`auto_chunk_rows`, ~32 MiB chunks): kept
  for backward ``N * H`` hidden states (model dtype) + ``3 * N`` floats (``lse``, entropy,
  targets); transient ``~3 * c * V * 4`` bytes per chunk, plus in backward one float32
  ``[V, H]`` accumulator for the head's weight gradient. The output head's own forward is
  replaced for the call (:func:`_fused_head`), so wrappers' hooks (FSDP2, DDP, ZeRO-3) still run
  and tied embeddings get both gradient contributions.
* naive (``chunk_size=None``): kept for backward ``N * V * 4`` bytes (the ``log_softmax``
  output), ``3 * N * V * 4`` with a differentiable entropy (plus the softmax and the logits);
  transient on top: the model-dtype logits ``B * (T + 1) * V`` and their float32 copy.
  (Measured with ``saved_tensors_hooks`` for N = 1024, V = 32768: 128 / 385 MiB naive, 0.2 MiB
  fused, see ``tests/test_logprobs.py``.)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dapo_lightning.linear_log_probs import auto_chunk_rows, fused_linear_log_probs


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: ``cumsum(mask) - 1``, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of ``logits`` over the last dim: ``logsumexp(z) - sum(p * z)``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


# ============================================================================ model plumbing
def output_head(model: nn.Module) -> nn.Linear | None:
    """The causal LM's output embedding (``get_output_embeddings()``) if it is an ``nn.Linear``,
    looking through wrappers that hold the model as ``.module`` (DDP, Lightning, DeepSpeed);
    None otherwise (then only the naive path applies)."""
    m: Any = model
    for _ in range(8):
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            head = get()
            return head if isinstance(head, nn.Linear) else None
        m = getattr(m, "module", None)
        if not isinstance(m, nn.Module):
            return None
    return None


def _is_plain(t: Tensor) -> bool:
    """Not a tensor subclass (a DTensor of tensor parallelism, a quantised weight, ...)."""
    return type(t) in (Tensor, nn.Parameter)


@contextlib.contextmanager
def _fused_head(
    head: nn.Linear,
    targets: Tensor,
    state: dict[str, Tensor],
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> Iterator[None]:
    """While active, ``head``'s forward turns its input ``[B, K, H]`` (K >= T + 1 last positions)
    into ``[B, T, 2]`` = stacked ``(logp, entropy)`` of ``targets [B, T]`` instead of logits, and
    records that tensor in ``state["packed"]``.

    Only ``forward`` is replaced, so ``head.__call__`` and every wrapper's hooks still run (FSDP2
    unshards the weight around it and registers its backward hooks on the returned tensor;
    DeepSpeed ZeRO-3 gathers it). An input it cannot handle goes to the original forward.
    """
    B, T = targets.shape
    original = head.forward

    def forward(hidden_states: Tensor) -> Tensor:
        shape_ok = hidden_states.dim() == 3 and hidden_states.shape[0] == B
        if not (shape_ok and hidden_states.shape[1] > T and _is_plain(head.weight)):
            return original(hidden_states)
        h = hidden_states[:, -T - 1 : -1].reshape(B * T, -1)
        logp, ent = fused_linear_log_probs(
            h,
            head.weight,
            targets.reshape(-1),
            head.bias,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
        if ent is None:
            ent = torch.zeros_like(logp)
        elif not entropy_grad:
            ent = ent.detach()
        # stacked from [B, T] views so that the result is not itself a view (FSDP2 hooks it)
        state["packed"] = torch.stack([logp.view(B, T), ent.view(B, T)], dim=-1)
        return state["packed"]

    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def _from_logits(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The naive path on the model's logits ``[B, >= T + 1, V]``: the ``T`` positions before
    the last predict ``targets [B, T]`` (:func:`log_probs_at`)."""
    T = targets.shape[1]
    return log_probs_at(logits[:, -T - 1 : -1], targets, temperature, with_entropy, entropy_grad)


def log_probs_at(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(logits / temperature)[targets]`` for ``logits [B, T, V]``: float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
    return logp, entropy


def _response_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_width: int
) -> Any:
    """One forward of ``model`` over the rows (left padding ignored by the positions) that
    keeps only the last ``response_width + 1`` positions' logits."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=response_width + 1,
    )


def _fusable_head(model: nn.Module) -> nn.Linear | None:
    """``model``'s output head for the fused path, or None: no ``nn.Linear`` head, or one whose
    ``forward`` is an instance attribute (e.g. accelerate's offload hook: kept as it is)."""
    head = output_head(model)
    return None if head is not None and "forward" in vars(head) else head


def _fused_forward(
    run: Callable[[], Any],
    head: nn.Linear,
    targets: Tensor,
    temperature: float,
    chunk_size: int,
    *,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """``run()`` under :func:`_fused_head`: ``(the output's logits, the packed [B, T, 2]
    statistics)``; the packed tensor is None when the head fell back to its own forward."""
    state: dict[str, Tensor] = {}
    with _fused_head(
        head,
        targets,
        state,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    ):
        logits = run().logits
    return logits, state.get("packed")


def _packed_entropy(packed: Tensor, with_entropy: bool, entropy_grad: bool) -> Tensor | None:
    """The entropy half of the fused path's ``[B, T, 2]``: None without ``with_entropy``,
    detached without ``entropy_grad``."""
    if not with_entropy:
        return None
    return packed[..., 1] if entropy_grad else packed[..., 1].detach()


def response_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int | Literal["auto"] | None = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the response tokens under ``model`` at ``temperature``.

    For row b and response position t (token ``y_t = input_ids[b, P + t]``)::

        logp[b, t] = log_softmax(logits[b, P + t - 1] / temperature)[y_t]

    where ``P = input_ids.shape[1] - response_width``. The model runs with
    ``logits_to_keep=response_width + 1``, so a long prompt costs no vocab-sized memory.
    ``entropy_grad=False`` returns the entropy without a graph (for metrics).

    Memory: see the module docstring (fused: no ``[B, T, V]`` tensor is kept).

    Models without an ``nn.Linear`` output head use the naive path; a model that changes its
    head's output (logit soft-capping or scaling) is detected and recomputed on the naive path.
    The fused path requires the head to run once per forward, not under a checkpoint of the
    whole model (per-layer gradient checkpointing is fine).

    Returns:
        ``(logp [B, T], entropy [B, T] or None)``, float32.
    """
    targets = input_ids[:, input_ids.shape[1] - response_width :]
    run = partial(_response_forward, model, input_ids, attention_mask, response_width)
    return log_probs_of_run(
        model, run, targets, temperature, with_entropy, entropy_grad, chunk_size
    )


def log_probs_of_run(
    model: nn.Module,
    run: Callable[[], Any],
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_size: int | Literal["auto"] | None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``targets [B, T]`` from the forward ``run()``, whose
    output's last ``T + 1`` positions predict them: fused where the head allows, else naive."""
    naive = partial(
        _from_logits,
        targets=targets,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    head = _fusable_head(model) if chunk_size is not None else None
    if head is None:
        return naive(run().logits)
    rows = auto_chunk_rows(head.out_features) if chunk_size == "auto" else int(chunk_size)
    logits, packed = _fused_forward(
        run, head, targets, temperature, rows, with_entropy=with_entropy, entropy_grad=entropy_grad
    )
    if packed is None:  # the head fell back to its own forward: these are logits
        return naive(logits)
    if logits is not packed:  # the model post-processes its head's output
        warnings.warn(
            f"{type(model).__name__} transforms its output head's result (e.g. logit "
            "soft-capping); recomputing on the naive path. Pass chunk_size=None to skip the "
            "fused attempt.",
            stacklevel=3,
        )
        return naive(run().logits)
    return packed[..., 0], _packed_entropy(packed, with_entropy, entropy_grad)
