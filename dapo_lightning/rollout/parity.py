"""Engine / trainer log-probability parity: is the engine sampling from the weights we train?

After a weight push the engine's log-probabilities of its sampled tokens should equal the
trainer's for the same tokens (docs/design.md invariant 3). A silent mismatch (a wrong or partial
push, tied embeddings left stale, dtype drift) shows up here and nowhere else. The module compares
every ``parity_check_every`` rollout steps, on the tokens the current weights sampled
(:func:`~dapo_lightning.data.sampling.metrics.rollout_step_metrics`: ``parity/*``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def logprob_parity(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Agreement of trainer and engine log-probs on the masked tokens.

    With ``d = trainer_logp - engine_logp`` over tokens where ``mask`` is nonzero::

        parity/mean_abs_diff  = mean |d|
        parity/max_abs_diff   = max |d|
        parity/tis_ratio_mean = mean exp(d)   (truncated-importance-sampling ratio pi_train / pi_engine)
        parity/tis_ratio_max  = max exp(d)
        parity/tokens         = number of tokens compared

    All ``[B, T]`` tensors of one shape. With no masked tokens the diffs are 0 and the ratios 1.
    """
    if not (trainer_logp.shape == engine_logp.shape == mask.shape):
        raise ValueError(
            "logprob_parity needs trainer_logp, engine_logp and mask of one shape, got "
            f"{tuple(trainer_logp.shape)}, {tuple(engine_logp.shape)}, {tuple(mask.shape)}."
        )
    keep = mask.bool()
    d = (trainer_logp.detach().float() - engine_logp.detach().float())[keep]
    if d.numel() == 0:
        return {
            "parity/mean_abs_diff": 0.0,
            "parity/max_abs_diff": 0.0,
            "parity/tis_ratio_mean": 1.0,
            "parity/tis_ratio_max": 1.0,
            "parity/tokens": 0.0,
        }
    ratio = torch.exp(d)
    return {
        "parity/mean_abs_diff": d.abs().mean().item(),
        "parity/max_abs_diff": d.abs().max().item(),
        "parity/tis_ratio_mean": ratio.mean().item(),
        "parity/tis_ratio_max": ratio.max().item(),
        "parity/tokens": float(d.numel()),
    }
