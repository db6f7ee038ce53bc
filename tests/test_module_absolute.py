"""The module's update pinned against an independent computation of the paper's objective.

The reference below shares no code with the library's update path: GRPO advantages from the raw
rewards of each group, one *unpadded* sequence at a time through a float64 copy of the model,
DAPO's token-mean clipped objective written out per token, and plain SGD. Partition invariance
(tests/test_module.py) says nothing about the normaliser; these tests do: the three wrong
normalisers (the sequence count, 7x the token count, GRPO's per-sequence mean) fail them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import dapo_lightning.update_loop as module_lib  # where the update loop calls policy_loss
from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.loss import PolicyLossConfig
from dapo_lightning.module import DAPOModule
from dapo_lightning.update import BatchingConfig
from tests._harness import fit
from tests._module_harness import FixedBatches, fixed_batch

LR = 0.5
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _sequences(batch):
    """(prompt ids, response ids, reward, group) per row, read back from the padded batch."""
    rows = []
    P = batch.prompt_width
    for i in range(batch.batch_size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        n_resp = int(batch.attention_mask[i, P:].sum())  # observation tokens included
        prompt_len = int(batch.attention_mask[i, :P].sum())
        assert len(ids) == prompt_len + n_resp
        rows.append(
            (ids[:prompt_len], ids[prompt_len:], float(batch.reward[i]), int(batch.group_index[i]))
        )
    return rows


def _grpo(rows):
    """A_i = (r_i - mean_g) / (unbiased std_g + 1e-6), by hand."""
    out = []
    for _, _, r, g in rows:
        group = [x for _, _, x, h in rows if h == g]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((r - mean) / (std + 1e-6))
    return out


def _logp(model, prompt, response):
    """log pi(y_t | x, y_<t) of each response token, one unpadded sequence."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def reference_updates(checkpoint, batch, groups_per_update, seq_mean=False, sampled=None):
    """Parameters after SGD on DAPO's token-mean objective, mini-batch after mini-batch; with
    ``seq_mean``, GRPO's: the mean over the mini-batch's rows (fully masked rows included, as in
    verl's trainer) of each response's token mean. ``sampled[i]`` (0/1 per response token of
    row i) keeps only the tokens the policy sampled in a multi-turn episode: observation tokens
    are context for the later ones but no term of the objective and not in its token count."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    rows = _sequences(batch)
    keep = [
        torch.tensor(sampled[i] if sampled is not None else [1] * len(y), dtype=torch.float64)
        for i, (_, y, _, _) in enumerate(rows)
    ]
    adv = _grpo(rows)
    masked = [float(batch.response_mask[i].sum()) == 0 for i in range(batch.batch_size)]
    with torch.no_grad():
        old = [_logp(model, p, y) for p, y, _, _ in rows]
    num_groups = len({g for *_, g in rows})
    for start in range(0, num_groups, groups_per_update):
        members = [i for i, (*_, g) in enumerate(rows) if start <= g < start + groups_per_update]
        model.zero_grad()
        objective = 0.0
        tokens = sum(float(keep[i].sum()) for i in members if not masked[i])
        for i in members:
            if masked[i]:
                continue
            ratio = torch.exp(_logp(model, rows[i][0], rows[i][1]) - old[i])
            clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
            term = (torch.minimum(ratio * adv[i], clipped * adv[i]) * keep[i]).sum()
            objective = objective + (term / keep[i].sum() if seq_mean else term)
        (-objective / (len(members) if seq_mean else tokens)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {k: v.detach() for k, v in model.named_parameters()}


def module_updates(checkpoint, batch, mini_batch_size, micro_batch_size=3, **module_kw):
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    module = DAPOModule(
        policy=policy,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        batching=BatchingConfig(mini_batch_size, micro_batch_size),
        optimizer_step=dict(gradient_clip_val=None),
        parity_check_every=0,
        **module_kw,
    )
    fit(module, FixedBatches(batch))
    return {k: v.detach() for k, v in module.policy.named_parameters()}


def rel_diff(a, b, start):
    scale = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert scale > 1e-4, "the update is zero: the test would prove nothing"
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


@pytest.fixture(scope="module")
def start(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    ("mini_batch_size", "groups_per_update"),
    [(None, 4), (1, 1), (2, 2)],
    ids=["one update per batch", "4 updates, old log-probs", "2 updates, old log-probs"],
)
def test_update_equals_sgd_on_the_token_mean_objective(
    tiny_checkpoint, start, mini_batch_size, groups_per_update
):
    batch = fixed_batch()
    ours = module_updates(str(tiny_checkpoint), batch, mini_batch_size)
    ref = reference_updates(str(tiny_checkpoint), batch, groups_per_update)
    assert rel_diff(ours, ref, start) < 1e-5


def test_seq_mean_counts_fully_masked_rows_as_verl_does(tiny_checkpoint, start):
    """GRPO's sample-level loss with two overlong-filtered responses (response_mask all 0):
    they add nothing but count in the denominator (verl 0.9.1: global_batch_size = rows)."""
    batch = fixed_batch()
    batch.response_mask = batch.response_mask.clone()
    batch.response_mask[[1, 9]] = 0.0
    seq_mean = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    ours = module_updates(str(tiny_checkpoint), batch, 2, loss=seq_mean)
    ref = reference_updates(str(tiny_checkpoint), batch, 2, seq_mean=True)
    assert rel_diff(ours, ref, start) < 1e-5


replace = dataclasses.replace
WRONG_NORMALISERS = {
    "sequence count": lambda i, c: (replace(i, global_token_count=i.global_seq_count), c),
    "7x the token count": lambda i, c: (replace(i, global_token_count=7 * i.global_token_count), c),
    "GRPO's sequence mean": lambda i, c: (i, replace(c, loss_agg_mode="seq-mean-token-mean")),
}


@pytest.mark.parametrize("wrong", list(WRONG_NORMALISERS))
def test_a_wrong_normaliser_fails_the_reference(tiny_checkpoint, start, monkeypatch, wrong):
    """Negative control: the same comparison catches each normaliser bug of the loss call."""
    real = module_lib.policy_loss

    def broken(inputs, config):
        return real(*WRONG_NORMALISERS[wrong](inputs, config))

    monkeypatch.setattr(module_lib, "policy_loss", broken)
    batch = fixed_batch()
    ours = module_updates(str(tiny_checkpoint), batch, None)
    ref = reference_updates(str(tiny_checkpoint), batch, 4)
    assert rel_diff(ours, ref, start) > 1e-2


def _episode_batch(count_observations=False):
    """The fixed batch as multi-turn episodes: in every response of 5+ tokens, tokens
    [1, len // 2) are an observation (token mask 0); they stay in the sequence as context.
    ``count_observations`` builds the wrong batch: the same tokens, every one in the loss."""
    batch = fixed_batch()
    rows = _sequences(batch)
    sampled = [
        [0 if 1 <= t < len(y) // 2 and len(y) >= 5 else 1 for t in range(len(y))]
        for _, y, _, _ in rows
    ]
    rollouts = ScoredRollouts(
        prompt_ids=[p for p, *_ in rows],
        response_ids=[y for _, y, _, _ in rows],
        rollout_log_probs=[[0.0] * len(y) for _, y, _, _ in rows],
        finish_reason=["stop"] * len(rows),
        group_index=batch.group_index,
        prompt_uid=[str(g) for *_, g in rows],
        score=batch.score,
        acc=batch.acc,
        sampling=batch.sampling,
        token_mask=None if count_observations else sampled,
    )
    return RolloutBatch.from_rollouts(
        rollouts, group_size=batch.group_size, pad_token_id=0
    ), sampled


@pytest.mark.parametrize(
    ("mini_batch_size", "groups_per_update"), [(None, 4), (2, 2)], ids=["one update", "2 updates"]
)
def test_update_skips_observation_tokens(
    tiny_checkpoint, start, mini_batch_size, groups_per_update
):
    """Multi-turn episodes: observation tokens (token mask 0) are neither terms of the
    objective nor counted in its normaliser N; the reference skips them one sequence at a time."""
    batch, sampled = _episode_batch()
    observed = sum(len(m) - sum(m) for m in sampled)
    assert observed >= 40 and float(batch.response_mask.sum()) == sum(map(sum, sampled))
    ours = module_updates(str(tiny_checkpoint), batch, mini_batch_size)
    ref = reference_updates(str(tiny_checkpoint), batch, groups_per_update, sampled=sampled)
    assert rel_diff(ours, ref, start) < 1e-5


def test_counting_observation_tokens_fails_the_reference(tiny_checkpoint, start):
    """Negative control: a batch whose mask counts the observation tokens (the same tokens, no
    token mask) trains differently from the reference that skips them."""
    wrong, sampled = _episode_batch(count_observations=True)
    ours = module_updates(str(tiny_checkpoint), wrong, None)
    ref = reference_updates(str(tiny_checkpoint), wrong, 4, sampled=sampled)
    assert rel_diff(ours, ref, start) > 1e-2
