"""The engine session: the one place that builds the rollout engine and keeps its weights current.

It owns, for one rank:

* building the engine on first use, by name (:data:`~dapo_lightning.rollout.engines.ENGINES`:
  the class's ``from_setup`` gets an :class:`~dapo_lightning.rollout.base.EngineSetup`; ``"hf"``
  samples with the policy module itself, or its own unsharded copy when the policy is sharded;
  ``"vllm"`` is an in-process ``vllm.LLM``), or an engine object given by the user;
* waking a sleep-mode engine for generation and putting it back to sleep after (engines that
  declare the ``sleep`` capability);
* the weight version the engine holds, and the push of the policy's weights when the trainer's
  version is newer: gathered, full, checkpoint-named tensors (tied weights included; see
  docs/design.md, "the tied-embedding trap") from whatever wraps the policy (DDP, FSDP1,
  FSDP2, DeepSpeed ZeRO-3). Nothing else in the library decides what an engine receives.

A LoRA policy (a peft model, :mod:`dapo_lightning.lora`) is pushed as the merged model: base
names, ``W + scaling * B @ A`` per adapted layer, computed beside the training weights
(:func:`~dapo_lightning.lora.merged_named_tensors`). An engine built to serve adapters itself
(the ``adapters`` capability, switched on: vLLM with ``engine_kwargs: {enable_lora: true,
max_lora_rank: R}`` sets its ``lora_enabled``) gets the adapter weights only
(:meth:`~dapo_lightning.rollout.vllm.VLLMRolloutEngine.load_adapter`).
The HF engine sharing the policy needs nothing pushed: peft's forward includes the adapters.

Pushing is a collective when the policy is sharded (every rank gathers every tensor in the
same order), so :meth:`EngineSession.sync` must be called on every rank with the same
version; the rollout producer does so at the start of every batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import TYPE_CHECKING, Any

from torch import nn

from dapo_lightning.lora import adapter_named_tensors, is_peft_model, merged_named_tensors
from dapo_lightning.rollout.base import EngineSetup, RolloutEngine
from dapo_lightning.rollout.engines import check_engine, engine_class
from dapo_lightning.trace import phase
from dapo_lightning.weights import full_named_tensors, is_sharded

if TYPE_CHECKING:
    from dapo_lightning.shared_cores import SharedCores


class EngineSession:
    """One rank's rollout engine: built lazily, awake while generating, with current weights.

    Args:
        engine: ``"hf"``, ``"vllm"``, another registered name or dotted path, or an engine
            object (a
            :class:`~dapo_lightning.rollout.base.RolloutEngine` subclass: the optional
            capabilities the session uses, ``model``, ``sleep_mode`` / ``wake_up`` / ``sleep``,
            ``lora_enabled`` / ``load_adapter``, ``state_dict`` / ``load_state_dict``, have
            defaults there).
        engine_kwargs: Constructor options of an engine given by name.
        model_path: Checkpoint folder or hub id (vLLM loads it; the HF engine loads its own
            copy from it when the policy is sharded).
        tokenizer: Gives the HF engine its EOS / pad ids.
        seed: Base sampling seed (the HF engine uses ``seed + rank``; vLLM adds the rank
            itself under ``torch.distributed``).
        rank: This rank.
        own_copy: The HF engine samples with its own copy of the weights even when the policy
            is not sharded (the one-step-off pipeline: the engine samples while the policy
            updates); pushes copy the policy's weights into it.
        cores: The one-step-off split of the cores (None: sync, the engine's thread keeps its
            count): the engine's ``fit_threads``, called before each decode step, is set to
            :meth:`~dapo_lightning.shared_cores.SharedCores.fit_rollout` (the HF and vLLM
            engines call it; the rollout thread takes the update's cores while it waits).

    Call :meth:`attach` with a function returning the policy module (possibly wrapped or
    sharded) before the first generation.

    Example::

        session = EngineSession("hf", tokenizer=tok)
        session.attach(lambda: module.policy)
        with session.generating(version=module.policy_version) as engine:
            groups = engine.generate(prompts, n=16, sampling=SamplingConfig(max_tokens=512))
    """

    def __init__(
        self,
        engine: str | RolloutEngine = "hf",
        *,
        engine_kwargs: dict[str, Any] | None = None,
        model_path: str | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        rank: int = 0,
        own_copy: bool = False,
        cores: SharedCores | None = None,
    ) -> None:
        check_engine(engine, model_path)
        self.kind = engine if isinstance(engine, str) else None
        self.cores = cores
        self._engine = None if isinstance(engine, str) else self._with_threads(engine)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.own_copy = own_copy
        self._policy: Callable[[], nn.Module] | None = None
        #: Weight version the engine holds (0: the weights it was built from).
        self.version = 0
        #: Weight pushes done.
        self.pushes = 0
        #: Wall seconds of the last push and of all pushes so far (``time.perf_counter``).
        self.last_push_seconds = 0.0
        self.push_seconds_total = 0.0
        self._pending_state: dict[str, Any] | None = None

    def attach(self, policy: Callable[[], nn.Module]) -> None:
        """Where the weights come from: ``policy()`` returns the (possibly wrapped) policy."""
        self._policy = policy

    @property
    def engine(self) -> RolloutEngine:
        """The engine, built on first use (:meth:`build_engine`)."""
        return self.build_engine()

    @property
    def built_engine(self) -> RolloutEngine | None:
        """The engine if it is built already, else None (builds nothing)."""
        return self._engine

    def build_engine(self) -> RolloutEngine:
        """The engine, built now on the calling thread if it is not yet (vLLM starts up there;
        the one-step-off stream builds it on the main thread before its first batch), the
        saved RNG state applied."""
        if self._engine is None:
            self._engine = self._build()
            self.version = 0
            if self._pending_state is not None:
                self.load_state_dict(self._pending_state)
        return self._engine

    def _with_threads(self, engine: RolloutEngine) -> RolloutEngine:
        """``engine``, its ``fit_threads`` set to the rollout thread's share of the cores
        (``cores``; untouched without them)."""
        if self.cores is not None:
            engine.fit_threads = self.cores.fit_rollout
        return engine

    def _build(self) -> RolloutEngine:
        setup = EngineSetup(
            dict(self.engine_kwargs),
            model_path=self.model_path,
            tokenizer=self.tokenizer,
            seed=self.seed,
            rank=self.rank,
            sampling_module=self._sampling_module,
        )
        return self._with_threads(engine_class(str(self.kind)).from_setup(setup))

    def _sampling_module(self) -> tuple[nn.Module, bool]:
        """The module an engine that samples with the policy uses, and whether it is its own:
        the policy itself, or an unsharded copy when the policy is sharded (loaded from
        ``model_path``) or ``own_copy`` is set (a deep copy of the policy; for a LoRA policy the
        base model loaded from ``model_path``, which pushes give the merged weights)."""
        policy = self._policy_module()
        if is_sharded(policy) or (self.own_copy and is_peft_model(policy)):
            return self._unsharded_copy(), True
        if self.own_copy:
            copy = deepcopy(policy).eval()
            copy.requires_grad_(False)
            return copy, True
        return policy, False

    def _policy_module(self) -> nn.Module:
        if self._policy is None:
            raise RuntimeError(
                "EngineSession has no policy attached: call session.attach(lambda: policy) "
                "(the data module does it at fit start)."
            )
        return self._policy()

    def _unsharded_copy(self) -> nn.Module:
        """An unsharded copy of the policy's architecture for the HF engine to sample with."""
        if self.model_path is None:
            raise RuntimeError(
                "the policy is sharded, so the 'hf' engine samples with its own copy, loaded "
                "from model_path: set data.model_name_or_path."
            )
        from transformers import AutoModelForCausalLM

        dtype = next(self._policy_module().parameters()).dtype
        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).eval()

    @property
    def shares_policy(self) -> bool:
        """True when the engine samples with the policy module itself (nothing to push)."""
        engine = self.engine
        return self._policy is not None and engine.model is self._policy()

    def sync(self, version: int) -> bool:
        """Push the policy's weights when the engine holds an older ``version``; True if pushed.

        Call it on every rank with the same version (the gather is a collective when sharded).
        Without a policy attached (an engine used on its own) it only records the version.
        """
        if version == self.version:
            return False
        if self._policy is not None and not self.shares_policy:
            start = time.perf_counter()
            with phase("weight push"):
                self._push(self._policy_module())
            self.last_push_seconds = time.perf_counter() - start
            self.push_seconds_total += self.last_push_seconds
            self.pushes += 1
        self.version = version
        return True

    def _push(self, policy: nn.Module) -> None:
        """Send ``policy``'s weights in the form the engine takes (see the module docstring)."""
        engine = self.engine
        if not is_peft_model(policy):
            engine.load_weights(full_named_tensors(policy))
        elif engine.capabilities.adapters and engine.lora_enabled:
            config = policy.peft_config[policy.active_adapter]
            engine.load_adapter(adapter_named_tensors(policy), config)
        else:
            engine.load_weights(merged_named_tensors(policy))

    @contextlib.contextmanager
    def generating(self, version: int) -> Iterator[RolloutEngine]:
        """Wake a sleep-mode engine, bring its weights to ``version``, yield it, sleep again."""
        engine = self.engine
        sleeps = engine.capabilities.sleep and bool(engine.sleep_mode)
        if sleeps:
            engine.wake_up()
        try:
            self.sync(version)
            yield engine
        finally:
            if sleeps:
                engine.sleep()

    def state_dict(self) -> dict[str, Any]:
        """The engine's sampling RNG state, when it has one (checkpointed to resume exactly)."""
        if self._engine is None:
            return dict(self._pending_state or {})
        return self._engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the engine RNG state (applied when the engine is built, if it is not yet)."""
        if self._engine is None:
            self._pending_state = dict(state)
        elif state:
            self._engine.load_state_dict(state)
            self._pending_state = None
