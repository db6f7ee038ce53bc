"""Tiny on-disk checkpoints for tests, benchmarks and the quickstart.

Nothing here downloads anything: the tokenizer is a character-level vocabulary
built in memory and the model is a randomly initialised Qwen2-style causal LM,
both written with ``save_pretrained`` so that ``AutoTokenizer``,
``AutoModelForCausalLM`` and ``vllm.LLM`` load them like any hub checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.rollout.base import Completion

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
    cfg = dict(TINY_CONFIG)
    cfg["vocab_size"] = len(tokenizer)
    cfg.update(config_overrides)
    if cfg["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"vocab_size={cfg['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} "
            "tokens: pass a vocab_size of at least that, or leave it unset."
        )
    config = Qwen2Config(
        **cfg,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
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
        max_response_length=max(resp),
        policy_version=policy_version,
    )
    return RolloutBatch.from_rollouts(rollouts, group_size=group_size, pad_token_id=0)


def quickstart_answer_distribution(
    truth: int, *, noise: int, exact_frac: float, hedge_frac: float, nonneg: bool = True
) -> list[tuple[str, float]]:
    """The warm-up's target distribution over answer strings for one problem with answer ``t``.

    Three kinds of answer, with probabilities that sum to 1:

    * ``f"~{t}"`` with probability ``hedge_frac``: the right number behind a hedge mark ("about
      t"). The strict arithmetic reward rejects it (the response must be the integer alone).
    * ``f"{t}"`` with probability ``exact_frac``: the right answer.
    * ``f"{v}"`` with probability ``(1 - hedge_frac - exact_frac) / |W|`` for every ``v`` in the
      noise window ``W = {t - noise, ..., t + noise}`` (clipped at 0 when ``nonneg``; ``t``
      included, so ``P("t") = exact_frac + (1 - hedge_frac - exact_frac) / |W|``).
    """
    low = max(0, truth - noise) if nonneg else truth - noise
    window = range(low, truth + noise + 1)
    spread = (1.0 - hedge_frac - exact_frac) / len(window)
    dist = [(f"~{truth}", hedge_frac)] if hedge_frac > 0 else []
    dist += [(str(v), spread + (exact_frac if v == truth else 0.0)) for v in window]
    return [(text, p) for text, p in dist if p > 0]


def make_quickstart_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    level: int = 1,
    num_prompts: int = 100,
    operand_range: tuple[int, int] | None = None,
    ops: list[str] | tuple[str, ...] | None = None,
    task_seed: int | None = None,
    apply_chat_template: bool = False,
    noise: int = 2,
    exact_frac: float = 0.04,
    hedge_frac: float = 0.84,
    sums_steps: int = 150,
    steps: int = 300,
    lr: float = 3e-3,
    **config_overrides: Any,
) -> Path:
    """The quickstart's starting point: a tiny checkpoint that knows every answer of the task
    but rarely gives it in the form the verifier accepts, and is sometimes slightly off.

    A DAPO run needs a base model whose samples are sometimes right (a group with no correct
    sample carries no signal), and the quickstart measures ``val/acc`` on problems RL never
    trains on, so what RL teaches must carry over to them. A randomly initialised model writes
    random bytes, so :func:`make_tiny_checkpoint` is warmed up ("pre-trained") in two full-batch
    supervised stages on every problem of the task:

    1. ``sums_steps`` AdamW steps of cross-entropy on the exact answers: the model learns the sums.
    2. ``steps`` AdamW steps of the expected cross-entropy
       ``-sum_s P(s) log pi(s | prompt)`` over the answer strings ``s`` of
       :func:`quickstart_answer_distribution`: mostly the right number behind a hedge mark
       (``"~7"``, which the strict reward scores wrong), sometimes the bare right answer,
       sometimes a bare number near it.

    The target is right (bare answer, exact value) ``exact_frac + (1 - hedge_frac - exact_frac)
    / (2 * noise + 1)`` of the time (0.06 with the defaults); the fitted model's sampled
    held-out accuracy was measured at 0.04-0.06 for five seeds. RL then has to learn, from the
    reward alone, to drop the hedge (a decision at the first response token, the same for
    every problem, so it carries over to held-out problems) and to stop giving near misses,
    without losing the sums of the problems it never trains on. (A hedge mark *after* the
    digits, ``"7?"``, was measured to be worse: penalising it pushed a seed into repeating
    digits, ``"999999"``.) Both stages are deterministic full-batch fits (the exact expected
    loss, no sampled labels), so every seed starts from about the same accuracy; about 25 s
    on 2 idle cores.

    Args:
        path: Folder to write (same layout as :func:`make_tiny_checkpoint`).
        seed: Seeds the weights.
        level: Arithmetic level of the task (see :mod:`dapo_lightning.data.arithmetic`).
        num_prompts: Problems of the task in the warm-up (all of level 1 is 100).
        operand_range: The task's operand range override (as in ``make_arithmetic_rows``).
        ops: The task's operator override (as in ``make_arithmetic_rows``).
        task_seed: Seed of the task's problem list (the data module's ``seed``); default ``seed``.
        apply_chat_template: Encode prompts with the chat template, as the data module will.
        noise: Half-width of the near-miss window.
        exact_frac: Probability of the bare right answer on top of its share of the window.
        hedge_frac: Probability of the right number with the hedge mark.
        sums_steps: Full-batch steps of stage 1 (exact answers); 0 skips it.
        steps: Full-batch steps of stage 2 (the answer distribution).
        lr: AdamW peak learning rate of both stages (10-step warm-up, cosine decay).
        **config_overrides: Model shape overrides passed to :func:`make_tiny_checkpoint`.
    """
    import math

    from transformers import AutoModelForCausalLM

    from dapo_lightning.data.arithmetic import make_arithmetic_rows
    from dapo_lightning.data.sources import encode_prompt

    if noise < 0:
        raise ValueError(f"noise must be >= 0 (half-width of the near-miss window), got {noise}.")
    for name, value in (("exact_frac", exact_frac), ("hedge_frac", hedge_frac)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
    if exact_frac + hedge_frac > 1.0:
        raise ValueError(
            f"exact_frac + hedge_frac must be <= 1 (the rest is near misses), got "
            f"{exact_frac} + {hedge_frac}."
        )
    path = make_tiny_checkpoint(path, seed=seed, **config_overrides)
    tokenizer = make_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    rows = make_arithmetic_rows(
        num_prompts,
        level=level,
        seed=seed if task_seed is None else task_seed,
        operand_range=operand_range,
        ops=ops,
    )
    prompts = [encode_prompt(tokenizer, r["prompt"], apply_chat_template) for r in rows]
    truths = [int(r["answer"]) for r in rows]
    nonneg = all(t >= 0 for t in truths)

    def full_batch(targets: list[list[tuple[str, float]]]) -> tuple[torch.Tensor, ...]:
        """Padded (ids, mask, labels, weight) rows: one per (problem, answer string)."""
        seqs, labels, weights = [], [], []
        for prompt, answers in zip(prompts, targets):
            for text, p in answers:
                answer = tokenizer(text, add_special_tokens=False)["input_ids"]
                answer = answer + [tokenizer.eos_token_id]
                seqs.append(prompt + answer)
                labels.append([-100] * len(prompt) + answer)
                weights.append(p)
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
        lab = torch.tensor([t + [-100] * (width - len(t)) for t in labels])
        mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        return ids, mask, lab, torch.tensor(weights)

    def fit(targets: list[list[tuple[str, float]]], num_steps: int) -> None:
        """Minimise sum_s P(s) * NLL(s), averaged over problems, with full-batch AdamW."""
        if num_steps <= 0:
            return
        ids, mask, lab, weight = full_batch(targets)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / num_steps)),
        )
        target = lab[:, 1:]
        for _ in range(num_steps):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])
            nll = -(logp.squeeze(-1) * (target != -100)).sum(-1)
            loss = (weight * nll).sum() / len(prompts)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fit([[(str(t), 1.0)] for t in truths], sums_steps)
        dists = [
            quickstart_answer_distribution(
                t, noise=noise, exact_frac=exact_frac, hedge_frac=hedge_frac, nonneg=nonneg
            )
            for t in truths
        ]
        fit(dists, steps)
    model.save_pretrained(path)
    return path


def completions_to_batch(
    prompts: list[list[int]], completions: list[list[Completion]], pad_token_id: int = 0
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
        max_response_length=max(len(c.token_ids) for c in flat),
    )
    return RolloutBatch.from_rollouts(rollouts, group_size=n, pad_token_id=pad_token_id)
