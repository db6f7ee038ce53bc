"""Tests of dapo_lightning.loss against an independent float64 loop implementation."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_lightning.loss import LOSS_AGG_MODES, aggregate_loss
from dapo_lightning.policy_loss import compute_policy_loss

# ---------------------------------------------------------------------------------------------
# Independent reference: plain Python floats, one token at a time.


def _ref_token(lp, old, a, eps_lo, eps_hi, c, roll, cap, ent, ent_coef, ref, kl_coef):
    lr = min(max(lp - old, -20.0), 20.0)
    ratio = math.exp(lr)
    clipped = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
    pg = -min(ratio * a, clipped * a)
    if c is not None and a < 0:
        pg = min(pg, -c * a)
    if cap is not None:
        pg *= min(math.exp(old - roll), cap)
    out = pg
    if ent is not None:
        out -= ent_coef * ent
    if ref is not None:
        d = min(max(ref - lp, -20.0), 20.0)
        out += kl_coef * (math.exp(d) - d - 1)
    return out


def _ref_aggregate(v, m, mode, N=None, S=None, L=None):
    B, T = len(v), len(v[0])
    if mode == "token-mean":
        total = sum(v[b][t] * m[b][t] for b in range(B) for t in range(T))
        n = N if N is not None else sum(sum(r) for r in m)
        return total / max(n, 1)
    if mode == "seq-mean-token-sum-norm":
        total = sum(v[b][t] * m[b][t] for b in range(B) for t in range(T))
        return total / (max(S if S is not None else B, 1) * L)
    rows = []
    nonempty = 0
    for b in range(B):
        n_b = sum(m[b])
        s_b = sum(v[b][t] * m[b][t] for t in range(T))
        nonempty += n_b > 0
        rows.append(s_b / max(n_b, 1) if mode == "seq-mean-token-mean" else s_b)
    return sum(rows) / max(S if S is not None else nonempty, 1)


def _ref_loss(lp, old, adv, mask, *, mode, clip_low=0.2, clip_high=0.28, c=None, rollout=None,
              cap=None, ent=None, ent_coef=0.0, ref=None, kl_coef=0.0, N=None, S=None, L=None):  # fmt: skip
    B, T = lp.shape
    vals = []
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                row.append(0.0)
                continue
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            row.append(
                _ref_token(
                    float(lp[b, t]),
                    float(old[b, t]),
                    a,
                    clip_low,
                    clip_high,
                    c,
                    None if rollout is None else float(rollout[b, t]),
                    cap,
                    None if ent is None else float(ent[b, t]),
                    ent_coef,
                    None if ref is None else float(ref[b, t]),
                    kl_coef,
                )
            )
        vals.append(row)
    return _ref_aggregate(vals, mask.double().tolist(), mode, N, S, L)


def _random_batch(B=5, T=7, seed=0, adv_2d=False):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv_shape = (B, T) if adv_2d else (B,)
    adv = torch.randn(*adv_shape, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0  # one fully masked row (e.g. an overlong-filtered response)
    lengths[2] = 1  # one single-token response
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    extra = {
        "rollout": old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "ent": torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
        "ref": lp.detach() + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
    }
    return lp, old, adv, mask, extra


OPTION_SETS = {
    "plain": {},
    "dual_clip": {"c": 1.5},
    "tis": {"cap": 1.2},
    "entropy": {"ent_coef": 0.01},
    "kl": {"kl_coef": 0.1},
    "all": {"c": 1.5, "cap": 1.2, "ent_coef": 0.01, "kl_coef": 0.1},
}


def _kwargs(opts, extra, mode):
    """Translate an option set into compute_policy_loss and _ref_loss keyword arguments."""
    kw = {"loss_agg_mode": mode, "clip_ratio_c": opts.get("c")}
    ref_kw = {"mode": mode, "c": opts.get("c")}
    if "cap" in opts:
        kw.update(rollout_log_probs=extra["rollout"], tis_cap=opts["cap"])
        ref_kw.update(rollout=extra["rollout"], cap=opts["cap"])
    if "ent_coef" in opts:
        kw.update(entropy=extra["ent"], entropy_coef=opts["ent_coef"])
        ref_kw.update(ent=extra["ent"], ent_coef=opts["ent_coef"])
    if "kl_coef" in opts:
        kw.update(ref_log_probs=extra["ref"], kl_coef=opts["kl_coef"])
        ref_kw.update(ref=extra["ref"], kl_coef=opts["kl_coef"])
    if mode == "seq-mean-token-sum-norm":
        kw["max_response_length"] = 9
        ref_kw["L"] = 9
    return kw, ref_kw


# ---------------------------------------------------------------------------------------------
# Formulas against the reference.


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("opts", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("adv_2d", [False, True], ids=["adv_B", "adv_BT"])
def test_loss_matches_loop_reference(mode, opts, adv_2d):
    lp, old, adv, mask, extra = _random_batch(
        seed=10 * LOSS_AGG_MODES.index(mode) + list(OPTION_SETS).index(opts), adv_2d=adv_2d
    )
    kw, ref_kw = _kwargs(OPTION_SETS[opts], extra, mode)
    loss, _ = compute_policy_loss(lp, old, adv, mask, **kw)
    expected = _ref_loss(lp.detach(), old, adv, mask, **ref_kw)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_metrics_match_loop_reference():
    lp, old, _, mask, extra = _random_batch(B=6, T=9, seed=3)
    adv = torch.tensor([0.7, -1.2, 0.9, -0.5, 1.3, -2.0], dtype=torch.float64)
    shift = torch.rand(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    old = old + torch.where(shift < 0.3, 1.0, torch.where(shift > 0.7, -1.0, 0.0))  # clip often
    loss, met = compute_policy_loss(
        lp, old, adv, mask, clip_ratio_c=1.3, rollout_log_probs=extra["rollout"], tis_cap=1.1,
        entropy=extra["ent"], ref_log_probs=extra["ref"],
    )  # fmt: skip
    lp = lp.detach()
    tokens = [(b, t) for b in range(6) for t in range(9) if mask[b, t]]
    n = len(tokens)
    ratios, k1, k3, hi, lo, dual, w, ents, kls, pgs, gaps = ([] for _ in range(11))
    for b, t in tokens:
        d = float(lp[b, t]) - float(old[b, t])
        r = math.exp(d)
        a = float(adv[b])
        ratios.append(r)
        k1.append(-d)
        k3.append(r - 1 - d)
        hi.append(a > 0 and r > 1.28)
        lo.append(a < 0 and r < 0.8)
        dual.append(a < 0 and r > 1.3)
        w.append(min(math.exp(float(old[b, t]) - float(extra["rollout"][b, t])), 1.1))
        gaps.append(abs(float(old[b, t]) - float(extra["rollout"][b, t])))
        ents.append(float(extra["ent"][b, t]))
        dr = float(extra["ref"][b, t]) - float(lp[b, t])
        kls.append(math.exp(dr) - dr - 1)
        pgs.append(
            _ref_token(
                float(lp[b, t]),
                float(old[b, t]),
                a,
                0.2,
                0.28,
                1.3,
                float(extra["rollout"][b, t]),
                1.1,
                None,
                0.0,
                None,
                0.0,
            )  # fmt: skip
        )
    assert sum(hi) > 0 and sum(lo) > 0 and sum(dual) > 0  # the example exercises every clip
    expected = {
        "token_count": n,
        "pg_loss": sum(pgs) / n,
        "clipfrac_high": sum(hi) / n,
        "clipfrac_low": sum(lo) / n,
        "dual_clipfrac": sum(dual) / n,
        "approx_kl_k1": sum(k1) / n,
        "approx_kl_k3": sum(k3) / n,
        "ratio_mean": sum(ratios) / n,
        "ratio_max": max(ratios),
        "entropy": sum(ents) / n,
        "tis_weight_mean": sum(w) / n,
        "tis_weight_min": min(w),
        "kl_ref": sum(kls) / n,
        # the rollout correction's, under TRL's names too (token level: over the tokens)
        "tis_masked_frac": 0.0,
        "sampling/sampling_logp_difference/mean": sum(gaps) / n,
        "sampling/sampling_logp_difference/max": max(gaps),
        "sampling/importance_sampling_ratio/min": min(w),
        "sampling/importance_sampling_ratio/mean": sum(w) / n,
        "sampling/importance_sampling_ratio/max": max(w),
    }
    assert set(met) == set(expected)
    for key, value in expected.items():
        assert not met[key].requires_grad and met[key].dim() == 0, key
        assert met[key].item() == pytest.approx(value, rel=1e-12, abs=1e-14), key
    # loss with entropy_coef = kl_coef = 0 is the aggregated pg term alone
    assert loss.item() == pytest.approx(sum(pgs) / n, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Worked examples.


def _tokens(ratios, advs, **kw):
    """One token per row with the given ratio and advantage; returns loss, metrics, grad."""
    old = torch.zeros(len(ratios), 1, dtype=torch.float64)
    lp = torch.log(torch.tensor(ratios, dtype=torch.float64)).unsqueeze(-1).requires_grad_()
    adv = torch.tensor(advs, dtype=torch.float64)
    loss, met = compute_policy_loss(lp, old, adv, torch.ones_like(old), **kw)
    loss.backward()
    return loss, met, lp.grad.squeeze(-1)


def test_asymmetric_clipping_worked_example():
    # ratio, A -> token loss (eps_low 0.2, eps_high 0.28):
    #   1.5, +1 -> -min(1.5, 1.28) = -1.28   (clipped high, no gradient)
    #   0.5, +1 -> -min(0.5, 0.8)  = -0.5    (not clipped: the min keeps the ratio)
    #   0.5, -1 -> -min(-0.5, -0.8) = 0.8    (clipped low, no gradient)
    #   1.5, -1 -> -min(-1.5, -1.28) = 1.5   (not clipped)
    #   1.25, +1 -> -1.25 (inside [0.8, 1.28]: an eps_high of 0.2 would have clipped it)
    #   0.9, -2 -> 1.8
    ratios = [1.5, 0.5, 0.5, 1.5, 1.25, 0.9]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0, -2.0]
    per_token = [-1.28, -0.5, 0.8, 1.5, -1.25, 1.8]
    loss, met, grad = _tokens(ratios, advs)
    assert loss.item() == pytest.approx(sum(per_token) / 6, rel=1e-12)
    # d/dlogp of -ratio * A is -ratio * A where unclipped, 0 where clipped; token-mean / 6
    expected_grad = [0.0, -0.5, 0.0, 1.5, -1.25, 1.8]
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64) / 6)
    assert met["clipfrac_high"].item() == pytest.approx(1 / 6)
    assert met["clipfrac_low"].item() == pytest.approx(1 / 6)
    assert met["dual_clipfrac"].item() == 0.0
    assert met["ratio_max"].item() == pytest.approx(1.5)
    # symmetric clipping (0.2 / 0.2) clips the 1.25 token
    loss_sym, _, grad_sym = _tokens(ratios, advs, clip_ratio_high=0.2)
    assert loss_sym.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 - 1.2 + 1.8) / 6, rel=1e-12)
    assert grad_sym[4].item() == 0.0


def test_dual_clip_engages_only_for_negative_advantages_above_c():
    # c = 3: A < 0 token loss = min(pg, 3 |A|)
    ratios = [5.0, 5.0, 2.0, 5.0]
    advs = [-1.0, -2.0, -1.0, 1.0]
    # 5, -1 -> min(5, 3) = 3 (dual clip, no grad); 5, -2 -> min(10, 6) = 6 (dual clip)
    # 2, -1 -> 2 (< 3, not engaged); 5, +1 -> -1.28 (ordinary high clip)
    loss, met, grad = _tokens(ratios, advs, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3 + 6 + 2 - 1.28) / 4, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.float64) / 4)
    assert met["dual_clipfrac"].item() == pytest.approx(2 / 4)
    # without dual clip the first two tokens are unbounded
    loss_off, met_off, _ = _tokens(ratios, advs)
    assert loss_off.item() == pytest.approx((5 + 10 + 2 - 1.28) / 4, rel=1e-12)
    assert met_off["dual_clipfrac"].item() == 0.0


def test_entropy_bonus_and_k3_kl_worked_example():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach().clone()  # ratio 1 -> pg = -A
    ent = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    loss, met = compute_policy_loss(
        lp, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2),
        entropy=ent, entropy_coef=0.1, ref_log_probs=ref, kl_coef=0.5,
    )  # fmt: skip
    # kl = e^d - d - 1 with d = ref - logp = -0.5, 1.0
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    tok = [-2.0 - 0.1 * 0.5 + 0.5 * kl[0], -2.0 - 0.1 * 1.5 + 0.5 * kl[1]]
    assert loss.item() == pytest.approx(sum(tok) / 2, rel=1e-12)
    assert met["kl_ref"].item() == pytest.approx(sum(kl) / 2, rel=1e-12)
    assert met["entropy"].item() == pytest.approx(1.0)
    # gradient w.r.t. logp: pg -A*ratio = -2, kl: d/dlogp (e^d - d - 1) = -(e^d - 1)
    loss.backward()
    expected = [(-2.0 - 0.5 * (math.exp(-0.5) - 1)) / 2, (-2.0 - 0.5 * (math.exp(1.0) - 1)) / 2]
    torch.testing.assert_close(lp.grad, torch.tensor([expected], dtype=torch.float64))


def test_entropy_gradient_flows_to_entropy():
    lp, old, adv, mask, extra = _random_batch(seed=7)
    ent = extra["ent"].clone().requires_grad_()
    loss, _ = compute_policy_loss(lp, old, adv, mask, entropy=ent, entropy_coef=0.2)
    loss.backward()
    torch.testing.assert_close(ent.grad, -0.2 * mask / mask.sum())


def test_aggregation_modes_differ_as_documented_on_unequal_lengths():
    # Row 0: one token, A = -2; row 1: 50 tokens, A = -1; ratio 1 so pg_t = -A.
    T = 50
    lp = torch.full((2, T), -1.0, dtype=torch.float64, requires_grad=True)
    old = lp.detach().clone()
    adv = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    mask = torch.zeros(2, T)
    mask[0, 0] = 1
    mask[1, :] = 1
    expected = {
        # loss, gradient weight of row 0's token, of each row-1 token (d pg / d logp = -A)
        "token-mean": ((2 + 50) / 51, 2 / 51, 1 / 51),
        "seq-mean-token-mean": ((2 / 1 + 50 / 50) / 2, 2 / 2, 1 / (2 * 50)),
        "seq-mean-token-sum": ((2 + 50) / 2, 2 / 2, 1 / 2),
        "seq-mean-token-sum-norm": ((2 + 50) / (2 * 64), 2 / 128, 1 / 128),
    }
    values = torch.where(mask.bool(), -adv[:, None], 0.0)
    for mode, (value, g0, g1) in expected.items():
        lp.grad = None
        loss, _ = compute_policy_loss(
            lp, old, adv, mask, loss_agg_mode=mode, max_response_length=64
        )
        assert loss.item() == pytest.approx(value, rel=1e-12), mode
        assert aggregate_loss(values, mask, mode, max_response_length=64).item() == pytest.approx(
            value, rel=1e-12
        )
        loss.backward()
        assert lp.grad[0, 0].item() == pytest.approx(g0, rel=1e-12), mode
        torch.testing.assert_close(lp.grad[1], torch.full((T,), g1, dtype=torch.float64))
        assert (lp.grad[0, 1:] == 0).all()
    # the numbers in words: token-mean 1.0196, seq-mean-token-mean 1.5, token-sum 26, Dr.GRPO 0.40625


def test_masked_tokens_do_not_matter_even_if_inf_or_nan():
    lp, old, adv, mask, extra = _random_batch(seed=11)
    kw = dict(
        clip_ratio_c=2.0, rollout_log_probs=extra["rollout"], tis_cap=1.5, entropy=extra["ent"],
        entropy_coef=0.01, ref_log_probs=extra["ref"], kl_coef=0.1,
    )  # fmt: skip
    loss, met = compute_policy_loss(lp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    pad = ~mask.bool()
    garbage = {k: v.masked_fill(pad, float("nan")) for k, v in extra.items()}
    lp2 = lp.detach().masked_fill(pad, -float("inf")).requires_grad_()
    loss2, met2 = compute_policy_loss(
        lp2, old.masked_fill(pad, float("inf")), adv, mask,
        **{**kw, "rollout_log_probs": garbage["rollout"], "entropy": garbage["ent"],
           "ref_log_probs": garbage["ref"]},
    )  # fmt: skip
    (grad2,) = torch.autograd.grad(loss2, lp2)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-14)
    torch.testing.assert_close(grad2, grad)
    assert (grad2[pad] == 0).all()
    for key in met:
        assert met2[key].item() == pytest.approx(met[key].item(), rel=1e-14), key


def test_bool_mask_equals_float_mask():
    lp, old, adv, mask, _ = _random_batch(seed=5)
    for mode in LOSS_AGG_MODES:
        a, _ = compute_policy_loss(lp, old, adv, mask, loss_agg_mode=mode, max_response_length=9)
        b, _ = compute_policy_loss(
            lp, old, adv, mask.bool(), loss_agg_mode=mode, max_response_length=9
        )
        assert a.item() == b.item()


def test_single_token_responses():
    lp = torch.tensor([[-0.5], [-1.0], [-2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.7], [-1.0], [-1.5]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.ones(3, 1)
    for mode in LOSS_AGG_MODES:
        loss, _ = compute_policy_loss(lp, old, adv, mask, loss_agg_mode=mode, max_response_length=1)
        expected = _ref_loss(lp.detach(), old, adv, mask, mode=mode, L=1)
        assert loss.item() == pytest.approx(expected, rel=1e-12)
    # with one token per row and L = 1, all four modes coincide
    values = {
        compute_policy_loss(lp, old, adv, mask, loss_agg_mode=m, max_response_length=1)[0].item()
        for m in LOSS_AGG_MODES
    }
    assert max(values) - min(values) < 1e-15


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_micro_batch_gives_zero_loss_with_graph(mode):
    lp, old, adv, _, extra = _random_batch(seed=2)
    mask = torch.zeros_like(old)
    loss, met = compute_policy_loss(
        lp, old, adv, mask, loss_agg_mode=mode, max_response_length=9, clip_ratio_c=3.0,
        rollout_log_probs=extra["rollout"], tis_cap=2.0, entropy=extra["ent"],
        ref_log_probs=extra["ref"], kl_coef=0.1,
    )  # fmt: skip
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (lp.grad == 0).all()
    for key, value in met.items():
        assert torch.isfinite(value), key
    assert met["token_count"].item() == 0 and met["pg_loss"].item() == 0
    assert met["ratio_max"].item() == 0.0 and met["tis_weight_min"].item() == 2.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_stay_finite(mode, dtype):
    # log-ratios of +-1e4 (and extreme rollout / reference gaps) in both signs of advantage
    lp = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, -3.0]], dtype=dtype, requires_grad=True)
    old = torch.zeros(2, 3, dtype=dtype)
    rollout = torch.tensor([[-1e4, 1e4, 0.0], [1e4, -1e4, 0.0]], dtype=dtype)
    ref = torch.tensor([[-1e4, 1e4, 0.0], [1e4, -1e4, 0.0]], dtype=dtype)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]], dtype=dtype)
    for c in (None, 3.0):
        lp.grad = None
        loss, met = compute_policy_loss(
            lp, old, adv, torch.ones(2, 3), loss_agg_mode=mode, max_response_length=3,
            clip_ratio_c=c, rollout_log_probs=rollout, tis_cap=2.0, ref_log_probs=ref, kl_coef=0.1,
        )  # fmt: skip
        loss.backward()
        assert torch.isfinite(loss), (mode, c)
        assert torch.isfinite(lp.grad).all(), (mode, c)
        assert all(torch.isfinite(v) for v in met.values()), (mode, c)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("opts", ["plain", "all"])
def test_gradcheck_wrt_log_probs(mode, opts):
    lp, old, adv, mask, extra = _random_batch(B=4, T=5, seed=13)
    kw, _ = _kwargs(OPTION_SETS[opts], extra, mode)

    def f(x):
        return compute_policy_loss(x, old, adv, mask, **kw)[0]

    assert torch.autograd.gradcheck(f, (lp.detach().requires_grad_(),), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Partition property: shares of micro-batches sum to the whole-batch loss and gradient.


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_shares_sum_to_whole_batch(mode):
    B, T = 7, 12
    lp, old, adv, mask, extra = _random_batch(B=B, T=T, seed=21)
    kw = dict(
        loss_agg_mode=mode, max_response_length=16, clip_ratio_c=2.0, tis_cap=1.5,
        entropy_coef=0.01, kl_coef=0.05,
    )  # fmt: skip
    full = {
        "rollout_log_probs": extra["rollout"],
        "entropy": extra["ent"],
        "ref_log_probs": extra["ref"],
    }
    whole, _ = compute_policy_loss(lp, old, adv, mask, **kw, **full)
    (g_whole,) = torch.autograd.grad(whole, lp)

    N = mask.sum()
    S = B if mode == "seq-mean-token-sum-norm" else int((mask.sum(-1) > 0).sum())
    total = 0.0
    g = torch.zeros_like(lp)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 7)):
        # each micro-batch is trimmed to its own widest response, as the module would
        width = max(1, int(mask[rows].sum(-1).max()))
        sub = lp[rows, :width].detach().requires_grad_()
        share, _ = compute_policy_loss(
            sub, old[rows, :width], adv[rows], mask[rows, :width],
            global_token_count=N, global_seq_count=S, **kw,
            **{k: v[rows, :width] for k, v in full.items()},
        )  # fmt: skip
        share.backward()
        total = total + share.item()
        g[rows, :width] = sub.grad
    assert total == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(g, g_whole, rtol=1e-12, atol=1e-15)


def test_without_global_normaliser_micro_batches_do_not_add_up():
    """The reason the module passes the global token count: local means are biased."""
    lp, old, adv, mask, _ = _random_batch(B=6, T=8, seed=4)
    whole, _ = compute_policy_loss(lp, old, adv, mask)
    local = sum(compute_policy_loss(lp[r], old[r], adv[r], mask[r])[0].item() / 2
                for r in (slice(0, 3), slice(3, 6)))  # fmt: skip
    assert abs(local - whole.item()) > 1e-6


def test_global_normaliser_accepts_int_float_and_tensor():
    lp, old, adv, mask, _ = _random_batch(seed=8)
    values = [
        compute_policy_loss(lp, old, adv, mask, global_token_count=n)[0].item()
        for n in (40, 40.0, torch.tensor(40), torch.tensor([40.0]))
    ]
    assert len(set(values)) == 1


# ---------------------------------------------------------------------------------------------
# Truncated importance sampling.


def test_tis_weight_is_truncated_ratio_and_detached():
    lp, old, adv, mask, extra = _random_batch(seed=9)
    old = old.clone().requires_grad_()
    rollout = extra["rollout"].clone().requires_grad_()
    cap = 1.1
    loss, met = compute_policy_loss(lp, old, adv, mask, rollout_log_probs=rollout, tis_cap=cap)
    w = torch.clamp(torch.exp(old.detach() - rollout.detach()), max=cap)
    assert (w < cap).any() and (w == cap).any()  # both regimes occur
    valid = mask.bool()
    assert met["tis_weight_min"].item() == pytest.approx(w[valid].min().item(), rel=1e-14)
    assert met["tis_weight_mean"].item() == pytest.approx(w[valid].mean().item(), rel=1e-14)
    # no gradient flows into the weight (nor into old / rollout log-probs)
    g_lp, g_old, g_roll = torch.autograd.grad(loss, (lp, old, rollout), allow_unused=True)
    assert g_old is None and g_roll is None
    # and the gradient w.r.t. logp is exactly w times the uncorrected gradient
    plain, _ = compute_policy_loss(lp, old.detach(), adv, mask)
    (g_plain,) = torch.autograd.grad(plain, lp)
    torch.testing.assert_close(g_lp, w * g_plain, rtol=1e-12, atol=1e-15)


def test_rollout_log_probs_without_tis_cap_change_nothing():
    lp, old, adv, mask, extra = _random_batch(seed=10)
    a, met = compute_policy_loss(lp, old, adv, mask, rollout_log_probs=extra["rollout"])
    b, _ = compute_policy_loss(lp, old, adv, mask)
    assert a.item() == b.item() and "tis_weight_mean" not in met


# ---------------------------------------------------------------------------------------------
# Validation.


def _args(B=2, T=3):
    lp = torch.zeros(B, T)
    return lp, torch.zeros(B, T), torch.zeros(B), torch.ones(B, T)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"old_log_probs": torch.zeros(2, 4)}, "old_log_probs"),
        (lambda a: {"response_mask": torch.ones(3, 3)}, "response_mask"),
        (lambda a: {"advantages": torch.zeros(3)}, "advantages"),
        (lambda a: {"advantages": torch.zeros(2, 2)}, "advantages"),
        (lambda a: {"log_probs": torch.zeros(6), "old_log_probs": torch.zeros(6)}, "log_probs"),
        (lambda a: {"loss_agg_mode": "seq-mean"}, "token-mean, seq-mean-token-mean"),
        (lambda a: {"clip_ratio_low": 1.0}, "clip_ratio_low"),
        (lambda a: {"clip_ratio_low": -0.1}, "clip_ratio_low"),
        (lambda a: {"clip_ratio_high": -0.1}, r"^model\.loss\.clip_ratio_high \(eps_high\)"),
        (lambda a: {"clip_ratio_c": 1.0}, "clip_ratio_c"),
        (lambda a: {"tis_cap": 2.0}, "rollout_log_probs"),
        (lambda a: {"tis_cap": 0.0, "rollout_log_probs": torch.zeros(2, 3)}, "tis_cap"),
        (lambda a: {"rollout_log_probs": torch.zeros(2, 2), "tis_cap": 2.0}, "rollout_log_probs"),
        (lambda a: {"entropy_coef": 0.1}, r"^model\.loss\.entropy_coef=0\.1 needs the token"),
        (lambda a: {"entropy": torch.zeros(2)}, "entropy"),
        (lambda a: {"kl_coef": 0.1}, r"^model\.loss\.kl_coef=0\.1 needs the reference"),
        (lambda a: {"ref_log_probs": torch.zeros(1, 3), "kl_coef": 0.1}, "ref_log_probs"),
        (lambda a: {"loss_agg_mode": "seq-mean-token-sum-norm"}, "max_response_length"),
        (lambda a: {"global_token_count": -1}, "global_token_count"),
        (
            lambda a: {"global_seq_count": torch.ones(2), "loss_agg_mode": "seq-mean-token-sum"},
            "global_seq_count",
        ),  # fmt: skip
    ],
)
def test_bad_input_raises_clear_error(change, match):
    lp, old, adv, mask = _args()
    kwargs = {"log_probs": lp, "old_log_probs": old, "advantages": adv, "response_mask": mask}
    kwargs.update(change(None))
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(**kwargs)


def test_integer_log_probs_rejected():
    with pytest.raises(TypeError, match="log_probs"):
        compute_policy_loss(torch.zeros(2, 3, dtype=torch.long), *_args()[1:])


def test_aggregate_loss_ignores_non_finite_values_under_the_mask():
    values = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for mode in LOSS_AGG_MODES:
        out = aggregate_loss(values, mask, mode, max_response_length=2)
        (grad,) = torch.autograd.grad(out, values)
        assert torch.isfinite(out) and torch.isfinite(grad).all(), mode
        assert (grad[:, 1] == 0).all(), mode
