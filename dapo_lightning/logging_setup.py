"""Known noise in a run's terminal output, and :func:`quiet_known_warnings` to silence it.

Every entry of :data:`KNOWN_NOISE` is a message that a normal DAPO run prints and that asks
nothing of the user; its ``why`` says why it is safe to hide. Anything not listed still shows.
Call :func:`quiet_known_warnings` once, early (before vLLM is imported: its log level is read
at import), e.g. at the CLI entry and before building a vLLM engine. Calling it again is harmless.

Example::

    from dapo_lightning.logging_setup import quiet_known_warnings

    quiet_known_warnings()
    trainer.fit(module, datamodule=dm)
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Where ``KnownNoise.source`` names Python's ``warnings`` module instead of a logger.
WARNINGS = "warnings"


@dataclass(frozen=True)
class KnownNoise:
    """One known, harmless message.

    Args:
        source: :data:`WARNINGS` for a ``warnings.warn`` message, else the name of the logger
            that emits it.
        pattern: Regular expression matched at the start of the message text.
        why: Why hiding it loses nothing.
        example: A message as it is printed (the tests check that ``pattern`` matches it).
    """

    source: str
    pattern: str
    why: str
    example: str


KNOWN_NOISE: tuple[KnownNoise, ...] = (
    KnownNoise(
        WARNINGS,
        r"Using ModelCheckpoint with manual optimization",
        "DAPOModule runs all updates of a rollout step inside training_step; the state after "
        "them is exactly what a resume needs. The 14-line warning and code sample ask for a "
        "pre-update snapshot no DAPO run wants.",
        "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
        "pre-optimization state was saved.",
    ),
    KnownNoise(
        WARNINGS,
        r"It is recommended to use `self\.log\('(rollout|val|time|data|update|parity)/",
        "The library logs every metric with sync_dist=True. vLLM's in-process engine opens a "
        "one-process torch.distributed group that Lightning's single-device strategy does not "
        "own, so Lightning drops sync_dist and then warns about it: there is nothing to sync.",
        "It is recommended to use `self.log('val/acc', ..., sync_dist=True)` when logging on epoch "
        "level in distributed setting to accumulate the metric across devices.",
    ),
    KnownNoise(
        WARNINGS,
        r"Your `IterableDataset` has `__len__` defined",
        "The rollout and validation loaders run in the main process (num_workers=0); the "
        "caveat is about worker processes.",
        "Your `IterableDataset` has `__len__` defined. In combination with multi-process data "
        "loading (when num_workers > 1), `__len__` could be inaccurate",
    ),
    KnownNoise(
        WARNINGS,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; nothing a user can "
        "change.",
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
        "treespec.is_leaf()` instead.",
    ),
    KnownNoise(
        "lightning.pytorch.utilities.rank_zero",
        r"💡 Tip:",
        "Advertises Lightning's cloud services (litlogger, litmodels) at every start.",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
    ),
    KnownNoise(
        "DeepSpeed",
        r"Setting accelerator to CPU",
        "Logged when deepspeed is imported on a machine without a GPU (transformers imports "
        "it when installed), whether or not the DeepSpeed strategy is used.",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    ),
    KnownNoise(
        "vllm.engine.arg_utils",
        r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLMRolloutEngine runs vLLM inside the training process on purpose (weights are pushed "
        "in place); the run seeds that process itself and its checkpoints restore the RNGs.",
        "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
        "False, this may affect the random state of the Python process that launched vLLM.",
    ),
    KnownNoise(
        "vllm.config.vllm",
        r"Enforce eager set, disabling|Inductor compilation was disabled by user settings",
        "On CPU VLLMRolloutEngine sets enforce_eager on purpose (no compile warm-up); these "
        "lines only restate it.",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
    ),
    KnownNoise(
        "vllm.model_executor.models.utils",
        r"Attempted to load weight \S+ with dtype",
        "One line per tensor (122 for SmolLM2-135M) when a float32 checkpoint is loaded into a "
        "bfloat16/float16 engine: the cast is what engine_kwargs.dtype asks for.",
        "Attempted to load weight layers.0.mlp.down_proj.weight with dtype torch.float32 into "
        "parameter with dtype torch.bfloat16",
    ),
    KnownNoise(
        "vllm.model_executor.model_loader.reload.layerwise",
        r"RotaryEmbedding: Failed to load weights",
        "Rotary embeddings hold a computed cos/sin cache, never a checkpoint weight: on every "
        "weight push vLLM finds nothing to load for them and keeps the cache, as it should.",
        "RotaryEmbedding: Failed to load weights",
    ),
)

#: What vLLM logs for every layer that one ``reload_weights`` call did not carry. A push of
#: several buckets (:meth:`~dapo_lightning.rollout.vllm.VLLMRolloutEngine.load_weights`)
#: leaves most layers out of each call by design (they keep their values, and the other buckets
#: carry them), so during such a push these lines are hidden (:func:`quiet_partial_reload`);
#: in a one-call push they still show, where they mean a layer got no weights at all.
PARTIAL_RELOAD_NOISE: tuple[KnownNoise, ...] = (
    KnownNoise(
        "vllm.model_executor.model_loader.reload.layerwise",
        r"\w+: Failed to load weights",
        "The layer was in another bucket of the same push; vLLM keeps its current values.",
        "RMSNorm: Failed to load weights",
    ),
    KnownNoise(
        "vllm.model_executor.model_loader.reload.inplace",
        r"Following weights were not loaded from checkpoint",
        "Lists every parameter the other buckets of the same push carry.",
        "Following weights were not loaded from checkpoint: {'model.layers.0.mlp.down_proj.weight'}",
    ),
)

#: vLLM's log level unless the user set ``VLLM_LOGGING_LEVEL``: its INFO lines (engine
#: configuration, KV-cache size, every weight reload) drown the training progress.
VLLM_DEFAULT_LOG_LEVEL = "WARNING"


class _DropKnown(logging.Filter):
    """Drops the records of one logger whose message matches one of ``patterns``."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.regex = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.regex.match(record.getMessage()) is None


#: One filter per logger, so a second :func:`quiet_known_warnings` adds nothing.
_FILTERS: dict[str, _DropKnown] = {}


def quiet_known_warnings() -> None:
    """Hide the messages of :data:`KNOWN_NOISE` and default vLLM's log level to WARNING.

    ``VLLM_LOGGING_LEVEL`` is only set when the environment does not set it already, so
    ``VLLM_LOGGING_LEVEL=INFO dapo-lightning fit ...`` shows vLLM's configuration again.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_DEFAULT_LOG_LEVEL)
    by_logger: dict[str, list[str]] = {}
    for noise in KNOWN_NOISE:
        if noise.source == WARNINGS:
            warnings.filterwarnings("ignore", message=noise.pattern)
        else:
            by_logger.setdefault(noise.source, []).append(noise.pattern)
    for name, patterns in by_logger.items():
        flt = _FILTERS.setdefault(name, _DropKnown(patterns))
        logging.getLogger(name).addFilter(flt)  # no-op when already added


@contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """Hide :data:`PARTIAL_RELOAD_NOISE` while the block runs (a push of several buckets).

    Example::

        with quiet_partial_reload():
            for bucket in buckets:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})
    """
    by_logger: dict[str, list[str]] = {}
    for noise in PARTIAL_RELOAD_NOISE:
        by_logger.setdefault(noise.source, []).append(noise.pattern)
    added = [(logging.getLogger(n), _DropKnown(p)) for n, p in by_logger.items()]
    for logger, flt in added:
        logger.addFilter(flt)
    try:
        yield
    finally:
        for logger, flt in added:
            logger.removeFilter(flt)
