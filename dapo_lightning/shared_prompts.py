"""Log-probs of rows that share prompts, each prompt run once (``BatchingConfig.share_prompts``).

A GRPO group's rows repeat one prompt: a forward over the distinct prompts keeps their keys and
values, then every response runs against its row's copy of them, at the positions of the whole
row. The log-probs, entropies and gradients are those of :func:`~dapo_lightning.logprobs.
response_log_probs` on whole rows (tests/test_logprobs.py), for fewer tokens.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from dapo_lightning.logprobs import log_probs_at, log_probs_of_run, position_ids_from_mask


def _can_share_prompts(model: nn.Module) -> bool:
    """The model keeps a key/value cache in this forward: not under gradient checkpointing
    (Hugging Face turns the cache off there)."""
    return not getattr(model, "is_gradient_checkpointing", False)


def _prompt_pass(model: nn.Module, prompts: Tensor, mask: Tensor) -> tuple[Tensor, Any] | None:
    """``(the distinct prompt of each row, the model's output on the distinct prompts: the
    last position's logits and a cache)``; None where no prompt repeats or no cache comes back."""
    rows = torch.cat([prompts, mask.to(prompts)], 1)
    unique, of_row = torch.unique(rows, dim=0, return_inverse=True)
    if unique.shape[0] == prompts.shape[0]:
        return None
    width = prompts.shape[1]
    ids, prompt_mask = unique[:, :width], unique[:, width:].to(mask.dtype)
    out = model(
        input_ids=ids,
        attention_mask=prompt_mask,
        position_ids=position_ids_from_mask(prompt_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    return None if cache is None or not hasattr(cache, "batch_select_indices") else (of_row, out)


def shared_prompt_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int | Literal["auto"] | None = "auto",
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`response_log_probs` with each distinct prompt (of ``input_ids[:, :P]``) run once;
    None where none repeats or the model keeps no cache (the caller runs every row)::

        (kv_g, z_g) = model(prompt_g)             # its cache and last position's logits
        logp[b, 0]  = log_softmax(z_g(b) / temperature)[y_b0]
        logp[b, t]  = from model(y_b | kv_g(b)),  t >= 1, positions of the whole row

    The same numbers as whole rows, and the prompt's gradient is the sum of its rows', for
    ``G * P + B * T`` tokens instead of ``B * (P + T)``.
    """
    width = input_ids.shape[1] - response_width
    if width < 1 or response_width < 1 or not _can_share_prompts(model):
        return None
    prompt_pass = _prompt_pass(model, input_ids[:, :width], attention_mask[:, :width])
    if prompt_pass is None:
        return None
    of_row, first = prompt_pass
    cache = first.past_key_values
    targets = input_ids[:, width:]
    logp0, entropy0 = log_probs_at(
        first.logits[of_row], targets[:, :1], temperature, with_entropy, entropy_grad
    )
    if response_width == 1:
        return logp0, entropy0
    cache.batch_select_indices(of_row)
    positions = position_ids_from_mask(attention_mask)[:, width:]

    def run() -> Any:  # the cache cropped back to the prompt: a second run sees the same
        extra = cache.get_seq_length() - width
        if extra > 0:
            cache.crop(-extra)
        return model(
            input_ids=targets,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=response_width,
        )

    rest_logp, rest_entropy = log_probs_of_run(
        model, run, targets[:, 1:], temperature, with_entropy, entropy_grad, chunk_size
    )
    logp = torch.cat([logp0, rest_logp], 1)
    entropy = None if entropy0 is None else torch.cat([entropy0, rest_entropy], 1)
    return logp, entropy
