"""Test fixtures: tiny on-disk checkpoints (also the quickstart's base) and synthetic batches.

Nothing here downloads anything: the tokenizer is a character-level vocabulary
built in memory and the model is a randomly initialised Qwen2-style causal LM,
both written with ``save_pretrained`` so that ``AutoTokenizer``,
``AutoModelForCausalLM`` and ``vllm.LLM`` load them like any hub checkpoint.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.rollout.base import Completion, SamplingConfig

#: Special tokens, in id order (ids 0..2).
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN)

#: A chat template in the Qwen/ChatML style, written with the tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: The tiny model's shape. head_dim 32 is the smallest vLLM's CPU attention takes.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    initializer_range=0.02,
)


def make_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level Qwen2 tokenizer with no merges: every byte is one token.

    The vocabulary is the special tokens (``<|pad|>`` = 0, ``<|im_end|>`` = 1 is EOS,
    ``<|im_start|>`` = 2) followed by the 256 byte-level symbols, so any text encodes and
    decodes losslessly and one character of ASCII is one token. It is a real
    ``Qwen2Tokenizer`` (what ``AutoTokenizer`` builds for a ``qwen2`` checkpoint), with a
    ChatML chat template.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        padding_side="left",
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens([AddedToken(BOS_TOKEN, special=True)])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_config(tokenizer: PreTrainedTokenizerBase, overrides: dict[str, Any]) -> Qwen2Config:
    """:data:`TINY_CONFIG` with ``overrides``, the vocabulary and special ids of ``tokenizer``."""
    cfg = dict(TINY_CONFIG)
    cfg["vocab_size"] = len(tokenizer)
    cfg.update(overrides)
    if cfg["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"vocab_size={cfg['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} "
            "tokens: pass a vocab_size of at least that, or leave it unset."
        )
    return Qwen2Config(
        **cfg,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def tiny_num_parameters(**config_overrides: Any) -> int:
    """Parameters of the model :func:`make_tiny_checkpoint` writes with ``config_overrides``
    (counted on the meta device: nothing is allocated; tied weights once)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(_tiny_config(make_tiny_tokenizer(), config_overrides))
    return sum(p.numel() for p in model.parameters())


def make_tiny_checkpoint(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tokenizer and a randomly initialised tiny Qwen2 causal LM to ``path``.

    Args:
        path: Folder to write (created if missing). Loadable afterwards with
            ``AutoTokenizer.from_pretrained(path)``, ``AutoModelForCausalLM.from_pretrained(path)``
            and ``vllm.LLM(model=str(path))``.
        seed: Seeds the weight initialisation; the same seed writes the same weights.
        **config_overrides: Replace entries of :data:`TINY_CONFIG` (for example SmolLM2-135M's
            shape: ``hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152``).
            A ``vocab_size`` larger than the tokenizer's pads the embedding (those ids are never
            produced by the tokenizer but exist in the model, as in real checkpoints).

    Returns:
        The folder as a :class:`~pathlib.Path`.

    Example::

        path = make_tiny_checkpoint(tmp_path / "tiny")
        model = AutoModelForCausalLM.from_pretrained(path)
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    config = _tiny_config(tokenizer, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_random_rollout_batch(
    *,
    num_groups: int,
    group_size: int,
    response_lengths: list[int] | None = None,
    prompt_lengths: list[int] | None = None,
    vocab_size: int = 259,
    seed: int = 0,
    policy_version: int = 0,
    temperature: float = 1.0,
) -> RolloutBatch:
    """A synthetic :class:`RolloutBatch` with random tokens, rewards and log-probs.

    ``response_lengths`` / ``prompt_lengths`` (one per sequence, cycled if shorter) let tests
    build batches whose lengths differ a lot between micro-batches and ranks. Rewards are
    +-1 with both values in every group (no zero-variance group). Token ids avoid the special
    tokens 0..2.
    """
    gen = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    resp = response_lengths or [int(x) for x in torch.randint(1, 33, (b,), generator=gen)]
    prom = prompt_lengths or [int(x) for x in torch.randint(3, 12, (b,), generator=gen)]
    group_index = torch.arange(num_groups).repeat_interleave(group_size)
    score = torch.where(torch.rand(b, generator=gen) < 0.5, 1.0, -1.0)
    score[::group_size] = 1.0
    score[1::group_size] = -1.0
    prompts: list[list[int]] = []
    for g in range(num_groups):
        prompt = torch.randint(3, vocab_size, (prom[(g * group_size) % len(prom)],), generator=gen)
        prompts += [prompt.tolist()] * group_size
    responses = [
        torch.randint(3, vocab_size, (resp[i % len(resp)],), generator=gen).tolist()
        for i in range(b)
    ]
    rollouts = ScoredRollouts(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_log_probs=[(-torch.rand(len(r), generator=gen) * 5).tolist() for r in responses],
        finish_reason=["stop"] * b,
        group_index=group_index,
        prompt_uid=[f"p{g}" for g in group_index.tolist()],
        score=score,
        acc=(score > 0).float(),
        sampling=SamplingConfig(max_tokens=max(resp), temperature=temperature),
        policy_version=policy_version,
    )
    return RolloutBatch.from_rollouts(rollouts, group_size=group_size, pad_token_id=0)


def completions_to_batch(
    prompts: list[list[int]],
    completions: list[list[Completion]],
    pad_token_id: int = 0,
    sampling: SamplingConfig | None = None,
) -> RolloutBatch:
    """Pad an engine's ``generate`` output exactly as the data module does (rewards zero):
    what parity checks compare the trainer's forward against."""
    n = len(completions[0])
    flat = [c for group in completions for c in group]
    rollouts = ScoredRollouts(
        prompt_ids=[list(p) for p in prompts for _ in range(n)],
        response_ids=[c.token_ids for c in flat],
        rollout_log_probs=[c.log_probs for c in flat],
        finish_reason=[c.finish_reason for c in flat],
        group_index=torch.arange(len(prompts)).repeat_interleave(n),
        prompt_uid=[str(i) for i in range(len(flat))],
        score=torch.zeros(len(flat)),
        acc=torch.zeros(len(flat)),
        sampling=sampling or SamplingConfig(max_tokens=max(len(c.token_ids) for c in flat)),
    )
    return RolloutBatch.from_rollouts(rollouts, group_size=n, pad_token_id=pad_token_id)


def free_port() -> int:
    """A free TCP port on localhost (for a test's ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def one_process_group(path: str | Path) -> Iterator[None]:
    """A world-size-1 gloo process group for the block (file store at ``path``).

    An in-process vLLM engine leaves its own one-process default group behind (a later test
    cannot create another); that one is used as it is and left in place.

    Raises:
        RuntimeError: a default group of more than one process is already up.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("one_process_group: a multi-process group is already initialised.")
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
