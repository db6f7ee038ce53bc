"""vLLM requests and what comes back: the ``SamplingParams`` of a group, the requests the
scheduler has not started (aborted on a drain), and a finished request's completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo_lightning.rollout.base import Completion, SamplingConfig


def sampling_params(n: int, sampling: SamplingConfig) -> Any:
    """vLLM ``SamplingParams`` for one group of ``n`` samples: sampled log-probs, token ids only,
    no per-request seed, and the group's outputs once all ``n`` are done."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        logprobs=0,
        detokenize=False,
        seed=None,  # never per request: it would make identical prompts identical
        output_kind=RequestOutputKind.FINAL_ONLY,  # a group's outputs once, all n done
    )


def not_started(unfinished: Sequence[str], n: int, capacity: int) -> list[str]:
    """The requests of ``unfinished`` (oldest first) the scheduler has not started: all but the
    first ``ceil(capacity / n)``. vLLM schedules first come, first served, ``capacity``
    (``max_num_seqs``) sequences at a time, each request ``n`` of them, so the oldest
    unfinished requests are the running ones (an estimate: a full KV cache runs fewer)."""
    running = -(-capacity // n)  # ceil(capacity / n)
    return list(unfinished[running:])


def completions(request: Any) -> list[Completion]:
    """The ``n`` samples of a finished vLLM ``RequestOutput``, in sample order."""
    group = []
    for out in sorted(request.outputs, key=lambda o: o.index):
        token_ids = list(out.token_ids)
        log_probs = [float(out.logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)]
        if out.finish_reason not in ("length", "stop"):
            raise RuntimeError(
                f"vLLM finished a sample with reason {out.finish_reason!r} "
                "(expected 'stop' or 'length'); the request was aborted."
            )
        group.append(
            Completion(token_ids=token_ids, log_probs=log_probs, finish_reason=out.finish_reason)
        )
    return group
