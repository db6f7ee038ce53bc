"""Token log-probabilities and entropies of a causal LM on ``[prompt | response]`` rows."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: ``cumsum(mask) - 1``, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of ``logits`` over the last dim: ``logsumexp(z) - sum(p * z)``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def response_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the response tokens under ``model`` at ``temperature``.

    For row b and response position t (token ``y_t = input_ids[b, P + t]``)::

        logp[b, t] = log_softmax(logits[b, P + t - 1] / temperature)[y_t]

    where ``P = input_ids.shape[1] - response_width``. Only the last ``response_width + 1``
    positions' logits are turned into distributions, so a long prompt costs no vocab-sized
    memory. ``entropy_grad=False`` computes the entropy without building a graph (for metrics).

    Returns:
        ``(logp [B, T], entropy [B, T] or None)``, float32.
    """
    P = input_ids.shape[1] - response_width
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=response_width + 1,
    )
    logits = out.logits[:, -response_width - 1 : -1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, P:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
    return logp, entropy
