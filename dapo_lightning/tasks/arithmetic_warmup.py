"""The quickstart's starting point: a tiny checkpoint warmed up on the arithmetic task
(:mod:`dapo_lightning.tasks.arithmetic`) so that it knows the sums but rarely answers in the form
the strict reward accepts, and is sometimes slightly off.

Used by ``--create_model_if_missing tiny-arithmetic`` (see ``configs/quickstart.yaml``).

A DAPO run needs a base model whose samples are sometimes right (a group with no correct sample
carries no signal), and the quickstart measures ``val/acc`` on problems RL never trains on, so
what RL teaches must carry over to them. A randomly initialised model writes random bytes, so
:func:`~dapo_lightning.testing.make_tiny_checkpoint` is warmed up ("pre-trained") by
:func:`make_quickstart_checkpoint` in two full-batch supervised stages on every problem:

1. ``sums_steps`` AdamW steps of cross-entropy on the exact answers: the model learns the sums.
2. ``steps`` AdamW steps of the expected cross-entropy ``-sum_s P(s) log pi(s | prompt)`` over
   the answer strings ``s`` of :func:`quickstart_answer_distribution`: mostly the right number
   behind a hedge mark (``"~7"``, which the strict reward scores wrong), sometimes the bare right
   answer, sometimes a bare number near it.

The target is right (bare answer, exact value) ``exact_frac + (1 - hedge_frac - exact_frac) /
(2 * noise + 1)`` of the time (0.06 with the defaults); the fitted model's sampled held-out
accuracy was measured at 0.04-0.06 for five seeds. RL then has to learn, from the reward alone,
to drop the hedge (a decision at the first response token, the same for every problem, so it
carries over to held-out problems) and to stop giving near misses, without losing the sums of
the problems it never trains on. (A hedge mark *after* the digits, ``"7?"``, was measured to be
worse: penalising it pushed a seed into repeating digits, ``"999999"``.) Both stages are
deterministic full-batch fits (the exact expected loss, no sampled labels), so every seed
starts from about the same accuracy. The stages report progress with an estimate from their
measured rate (:class:`WarmupProgress`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dapo_lightning.prompts import encode_prompt
from dapo_lightning.tasks.arithmetic import make_arithmetic_rows
from dapo_lightning.tasks.warmup_cache import cache_key, cached_build
from dapo_lightning.testing import make_tiny_checkpoint, make_tiny_tokenizer

#: The modules whose code computes the warmed-up model (the warm-up cache's key reads them).
WARMUP_MODULES = (
    __name__,
    "dapo_lightning.prompts",
    "dapo_lightning.tasks.arithmetic",
    "dapo_lightning.testing",
)


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

    Args:
        truth: The problem's answer ``t``.
        noise: Half-width of the near-miss window.
        exact_frac: Probability of the bare right answer on top of its share of the window.
        hedge_frac: Probability of the right number behind the hedge mark.
        nonneg: Clip the window at 0 (no negative near misses).

    Returns:
        ``(answer string, probability)`` pairs with positive probabilities.

    Example::

        dict(quickstart_answer_distribution(7, noise=2, exact_frac=0.06, hedge_frac=0.84))["~7"]
        # 0.84
    """
    low = max(0, truth - noise) if nonneg else truth - noise
    window = range(low, truth + noise + 1)
    spread = (1.0 - hedge_frac - exact_frac) / len(window)
    dist = [(f"~{truth}", hedge_frac)] if hedge_frac > 0 else []
    dist += [(str(v), spread + (exact_frac if v == truth else 0.0)) for v in window]
    return [(text, p) for text, p in dist if p > 0]


def _answer_batch(
    tokenizer: Any, prompts: list[list[int]], targets: list[list[tuple[str, float]]]
) -> tuple[torch.Tensor, ...]:
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


class WarmupProgress:
    """Progress lines of the warm-up with an estimate from its measured rate: one after
    ``first`` steps, then one every ``every_s`` seconds, and one at the end.

    The stages cost differently per step (stage 2 fits several answer strings per problem: 6x
    the tokens of stage 1 with the quickstart's settings), so the estimate counts work, not
    steps: each step reports its ``cost`` (the tokens of its batch), the rate is cost per
    second so far, and what is left is the cost of the steps left (``stage_costs``: the steps
    and cost per step of each stage). Per token, the two stages' steps were measured to cost the
    same within 5%; counted in steps, stage 1's rate overstated stage 2's 5-7x.

    Example line: ``warm-up step 120/450 (2.4 steps/s): about 2 min 18 s left``.
    """

    def __init__(
        self,
        stage_costs: list[tuple[int, int]],
        report: Callable[[str], None] | None,
        every_s: float = 10.0,
    ) -> None:
        self.total = sum(max(n, 0) for n, _ in stage_costs)
        self.total_cost = sum(max(n, 0) * c for n, c in stage_costs)
        self.report, self.every_s, self.first = report, every_s, 10
        self.done, self.done_cost, self.start = 0, 0, time.monotonic()
        self.last = self.start

    def step(self, cost: int = 1) -> None:
        """Count one full-batch step of ``cost`` tokens; report when it is time."""
        self.done += 1
        self.done_cost += cost
        now = time.monotonic()
        due = self.done == self.first or now - self.last >= self.every_s
        if self.report is None or not (due or self.done == self.total):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        left = (self.total_cost - self.done_cost) * elapsed / max(self.done_cost, 1)
        when = f"about {_duration(left)} left" if self.done < self.total else "done"
        rate = self.done / elapsed
        self.report(f"warm-up step {self.done}/{self.total} ({rate:.1f} steps/s): {when}")


def _duration(seconds: float) -> str:
    """``"42 s"``, ``"2 min 18 s"``."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _fit_expected_nll(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, ...],
    num_problems: int,
    num_steps: int,
    lr: float,
    progress: WarmupProgress,
) -> None:
    """Minimise sum_s P(s) * NLL(s), averaged over problems, with full-batch AdamW (10-step
    warm-up, cosine decay)."""
    if num_steps <= 0:
        return
    ids, mask, lab, weight = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / num_steps)),
    )
    target = lab[:, 1:]
    cost = int(mask.sum())
    for _ in range(num_steps):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])
        nll = -(logp.squeeze(-1) * (target != -100)).sum(-1)
        loss = (weight * nll).sum() / num_problems
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.step(cost)


def _check_fractions(noise: int, exact_frac: float, hedge_frac: float) -> None:
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


#: A warm-up stage: the answer strings and their weights per problem, and its number of steps.
WarmupStage = tuple[list[list[tuple[str, float]]], int]


def _warmup_stages(
    truths: list[int],
    sums_steps: int,
    steps: int,
    *,
    noise: int,
    exact_frac: float,
    hedge_frac: float,
) -> list[WarmupStage]:
    """The two stages (module docstring): each problem's exact answer (weight 1) for
    ``sums_steps``, then its :func:`quickstart_answer_distribution` for ``steps``."""
    nonneg = all(t >= 0 for t in truths)
    dists = [
        quickstart_answer_distribution(
            t, noise=noise, exact_frac=exact_frac, hedge_frac=hedge_frac, nonneg=nonneg
        )
        for t in truths
    ]
    return [([[(str(t), 1.0)] for t in truths], sums_steps), (dists, steps)]


def _warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    stages: list[WarmupStage],
    *,
    lr: float,
    seed: int,
    report: Callable[[str], None] | None,
) -> None:
    """Fit ``model`` (in train mode) to each stage in turn with :func:`_fit_expected_nll`,
    under a forked torch RNG seeded with ``seed`` (the caller's RNG is left as it was)."""
    model.train()
    batches = [_answer_batch(tokenizer, prompts, targets) for targets, _ in stages]
    costs = [(n, int(batch[1].sum())) for (_, n), batch in zip(stages, batches)]
    progress = WarmupProgress(costs, report)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for batch, (_, num_steps) in zip(batches, stages):
            _fit_expected_nll(model, batch, len(prompts), num_steps, lr, progress)


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
    report: Callable[[str], None] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write the quickstart's starting point at ``path``: a tiny checkpoint warmed up in two
    full-batch AdamW stages (module docstring) on the task's problems. With
    ``DAPO_LIGHTNING_WARMUP_CACHE`` set, a folder warmed up once per settings is copied
    (:mod:`~dapo_lightning.tasks.warmup_cache`).

    Args:
        path: Folder to write (same layout as ``make_tiny_checkpoint``).
        seed: Seeds the weights.
        level, num_prompts, operand_range, ops: The task (``make_arithmetic_rows``).
        task_seed: Seed of the task's problem list (the data module's ``seed``); default ``seed``.
        apply_chat_template: Encode prompts with the chat template, as the data module will.
        noise, exact_frac, hedge_frac: Stage 2's answer distribution
            (:func:`quickstart_answer_distribution`).
        sums_steps: Steps of stage 1 (exact answers); 0 skips it.
        steps: Steps of stage 2 (the answer distribution).
        lr: AdamW peak learning rate of both stages (10-step warm-up, cosine decay).
        report: Called with each progress line (:class:`WarmupProgress`); None: silent.
        **config_overrides: Model shape overrides passed to ``make_tiny_checkpoint``.

    Raises:
        ValueError: ``noise < 0``, a fraction outside [0, 1], or ``exact_frac + hedge_frac > 1``.

    Example::

        path = make_quickstart_checkpoint("runs/quickstart/model", seed=0, report=print)
    """
    _check_fractions(noise, exact_frac, hedge_frac)
    task_seed = seed if task_seed is None else task_seed  # before the key: None and seed agree
    settings = {k: v for k, v in locals().items() if k not in ("path", "report")}
    build = partial(_write_quickstart_checkpoint, settings=settings, report=report)
    return cached_build(path, cache_key(settings, WARMUP_MODULES), build, report)


def _write_quickstart_checkpoint(
    folder: Path, settings: dict[str, Any], report: Callable[[str], None] | None
) -> None:
    """What :func:`make_quickstart_checkpoint` writes, for its ``settings`` (its arguments)."""
    s = settings
    make_tiny_checkpoint(folder, seed=s["seed"], **s["config_overrides"])
    tokenizer = make_tiny_tokenizer()
    rows = make_arithmetic_rows(
        s["num_prompts"], level=s["level"], seed=s["task_seed"],
        operand_range=s["operand_range"], ops=s["ops"],
    )  # fmt: skip
    prompts = [encode_prompt(tokenizer, r["prompt"], s["apply_chat_template"]) for r in rows]
    truths = [int(r["answer"]) for r in rows]
    stages = _warmup_stages(
        truths, s["sums_steps"], s["steps"],
        noise=s["noise"], exact_frac=s["exact_frac"], hedge_frac=s["hedge_frac"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder)
    _warm_up(model, tokenizer, prompts, stages, lr=s["lr"], seed=s["seed"], report=report)
    model.save_pretrained(folder)
