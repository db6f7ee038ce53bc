"""Rollouts with the training module itself: a batched KV-cache sampling loop on a HF causal LM.

The engine holds a reference to the policy module, so it always samples with the current
weights (``load_weights`` is a no-op). When the policy is sharded (FSDP2), the engine session
gives it an unsharded copy instead (``owns_model=True``) and ``load_weights`` copies the
gathered weights into it. Sampling is a hand-written loop over
``past_key_values`` rather than ``model.generate`` for two reasons: the returned
log-probabilities must be those of the *processed* sampling distribution (after
temperature / top-k / top-p, renormalised), and the randomness must come from one
``torch.Generator`` owned by the engine (so it can be checkpointed and so identical prompts
draw different samples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dapo_lightning import interrupt
from dapo_lightning.logprobs import position_ids_from_mask
from dapo_lightning.rollout.base import Completion, EngineSetup, RolloutEngine, SamplingConfig


def process_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Sampling-distribution log-probabilities from raw next-token ``logits`` ``[B, V]``.

    Applied in vLLM's order::

        z = logits / temperature
        z[v] = -inf  where v is not among the top_k largest z           (top_k > 0)
        z[v] = -inf  where the mass of tokens strictly more likely than v,
                     sum_{u: p_u > p_v} p_u, is already >= top_p         (top_p < 1)
        logp = log_softmax(z)                                            (renormalised)

    The most likely token is always kept. Returns float32 ``[B, V]``.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


class HFRolloutEngine(RolloutEngine):
    """Samples completions from a Hugging Face causal LM that is also the policy being trained.

    Args:
        model: The policy (``AutoModelForCausalLM``-like: accepts ``input_ids``,
            ``attention_mask``, ``position_ids``, ``past_key_values``, ``use_cache``,
            ``logits_to_keep`` and returns ``.logits`` / ``.past_key_values``). Shared, not copied.
        tokenizer: Optional; supplies ``eos_token_id`` / ``pad_token_id`` when they are not given.
        eos_token_id: Token id(s) that end a response (included in ``token_ids``, finish reason
            ``"stop"``). Default: the tokenizer's, else ``model.generation_config``'s.
        pad_token_id: Id fed for left padding and for rows that already stopped. Default:
            the tokenizer's, else the model config's, else the first EOS id.
        max_batch_size: Most sequences (prompts x n) sampled in one batch; ``None`` = all at once.
        seed: Seeds the engine's single ``torch.Generator`` (use a base seed + rank under DDP).
            ``None`` draws a seed from torch's global RNG.
        owns_model: ``model`` is the engine's own copy (not the policy being trained):
            ``load_weights`` copies pushed weights into it.
        should_stop: Polled between decode steps; when it returns True the round is abandoned
            with :class:`~dapo_lightning.interrupt.StopRequested` (default: a SIGTERM / SIGINT
            stop request, :func:`dapo_lightning.interrupt.should_stop`).
        device: Where the engine's own copy sits and samples (``data.engine_kwargs.device``,
            e.g. ``"cuda:1"``: generation on a device of its own while the update runs on
            another, with ``dynamic_sampling.pipeline: one_step_off``). None: where the model
            is. Only for an own copy (``owns_model``).

    Raises:
        ValueError: no EOS id; ``max_batch_size`` < 1; ``device`` for the shared policy.
    """

    #: Called before each decode step on the sampling thread to fit its intra-op threads (the
    #: one-step-off rollout thread's share of the cores, set by the engine session:
    #: :meth:`~dapo_lightning.shared_cores.SharedCores.fit_rollout`); None: nothing.
    fit_threads: Callable[[], object] | None = None

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> HFRolloutEngine:
        """An engine sampling with ``setup.sampling_module()`` (the policy, or its own unsharded
        copy when the policy is sharded), seeded with ``seed + rank``."""
        if setup.sampling_module is None:
            raise ValueError(
                f"{cls.__name__} samples with the policy module: create_engine('hf') needs "
                "model=<the policy module>."
            )
        module, owned = setup.sampling_module()
        seed = setup.seed + setup.rank
        return cls(module, setup.tokenizer, seed=seed, owns_model=owned, **setup.kwargs)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int | None = None,
        seed: int | None = None,
        owns_model: bool = False,
        should_stop: Callable[[], bool] = interrupt.should_stop,
        device: str | torch.device | None = None,
    ) -> None:
        if device is not None:
            if not owns_model:
                raise ValueError(
                    f"data.engine_kwargs.device={device!r}: the 'hf' engine samples with the "
                    "policy module itself, which sits where the trainer puts it; a device of its "
                    "own needs its own copy: set data.dynamic_sampling.pipeline: one_step_off."
                )
            model = model.to(device)
        self.model = model
        self.should_stop = should_stop
        self.owns_model = owns_model
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        if eos_token_id is None:
            gen_cfg = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen_cfg, "eos_token_id", None)
        if eos_token_id is None:
            raise ValueError(
                "HFRolloutEngine needs an EOS id: pass eos_token_id= or a tokenizer with one."
            )
        self.eos_token_ids: tuple[int, ...] = (
            (int(eos_token_id),)
            if isinstance(eos_token_id, int)
            else tuple(int(e) for e in eos_token_id)
        )
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id: int = int(
            pad_token_id if pad_token_id is not None else self.eos_token_ids[0]
        )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(
                f"HFRolloutEngine.max_batch_size must be >= 1 or None, got {max_batch_size}."
            )
        self.max_batch_size = max_batch_size
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = int(seed)
        self.generator = torch.Generator(device=self._device)
        self.generator.manual_seed(self.seed)

    @property
    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    @property
    def max_context_tokens(self) -> int | None:
        """The model config's ``max_position_embeddings`` (None when it has none)."""
        context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(context) if isinstance(context, int) else None

    # ------------------------------------------------------------------ protocol
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint-named tensors into the engine's own model (``owns_model``); a no-op
        when the engine samples with the training module itself (it is always current).

        Raises:
            KeyError: a name the model does not have (the push is not of this architecture).
        """
        if not self.owns_model:
            return
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"HFRolloutEngine.load_weights: the model has no {name!r}.")
                state[name].copy_(tensor)

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt; see :class:`~dapo_lightning.rollout.base.RolloutEngine`."""
        if n < 1:
            raise ValueError(f"generate(n=...) must be >= 1, got {n}.")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"Prompt {i} is empty: every prompt needs at least one token.")
        seqs = [list(p) for p in prompts for _ in range(n)]
        chunk = self.max_batch_size or max(1, len(seqs))
        flat: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(seqs), chunk):
                    flat.extend(self._sample_batch(seqs[start : start + chunk], sampling))
        finally:
            self.model.train(was_training)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ RNG state
    def state_dict(self) -> dict[str, Any]:
        """The sampling RNG state (put it in checkpoints to resume exactly)."""
        return {"seed": self.seed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.seed = int(state.get("seed", self.seed))
        self.generator.set_state(state["generator"])

    # ------------------------------------------------------------------ sampling
    def _before_decode_step(self) -> None:
        """A stop within one decode step, not after the round; the rollout thread's cores
        (one-step-off: :attr:`fit_threads`)."""
        if self.should_stop():
            interrupt.raise_stop()
        if self.fit_threads is not None:
            self.fit_threads()

    def _sample_batch(self, seqs: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        device = self._device
        B = len(seqs)
        input_ids, attention_mask = left_padded(seqs, self.pad_token_id, device)
        position_ids = position_ids_from_mask(attention_mask)
        eos = torch.as_tensor(self.eos_token_ids, dtype=torch.long, device=device)

        tokens: list[Tensor] = []
        logps: list[Tensor] = []
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.full((B,), sampling.max_tokens, dtype=torch.long, device=device)
        past = None
        step_ids = input_ids
        for t in range(sampling.max_tokens):
            self._before_decode_step()
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
            past = out.past_key_values
            logp = process_logits(
                out.logits[:, -1], sampling.temperature, sampling.top_k, sampling.top_p
            )
            token = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            token_logp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            tokens.append(token)
            logps.append(token_logp)
            stopped = ~finished & torch.isin(token, eos)
            lengths = torch.where(stopped, torch.full_like(lengths, t + 1), lengths)
            finished |= stopped
            if bool(finished.all()):
                break
            step_ids = token.unsqueeze(-1)
            position_ids = position_ids[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((B, 1))], dim=1)

        return completions(torch.stack(tokens, 1), torch.stack(logps, 1), lengths, finished)


def left_padded(seqs: list[list[int]], pad_token_id: int, device: Any) -> tuple[Tensor, Tensor]:
    """``seqs`` as ``[B, P]`` ids and attention mask, padded on the left to the longest."""
    B, P = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, P), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((B, P), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        input_ids[i, P - len(s) :] = torch.as_tensor(s, dtype=torch.long, device=device)
        attention_mask[i, P - len(s) :] = 1
    return input_ids, attention_mask


def completions(
    tokens: Tensor, log_probs: Tensor, lengths: Tensor, finished: Tensor
) -> list[Completion]:
    """One :class:`Completion` per row of the sampled ``[B, T]`` ``tokens`` and their
    ``log_probs``, cut at its length (``"stop"`` where it sampled an end token, else
    ``"length"``)."""
    tok, lp, done = tokens.tolist(), log_probs.tolist(), finished.tolist()
    return [
        Completion(
            token_ids=tok[i][: int(k)],
            log_probs=lp[i][: int(k)],
            finish_reason="stop" if done[i] else "length",
        )
        for i, k in enumerate(lengths.tolist())
    ]
