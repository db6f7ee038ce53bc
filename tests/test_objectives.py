"""Policy objectives (dapo_lightning/objectives.py) and their registry.

* GSPO, CISPO, SAPO (and DAPO) against TRL 1.16: ``GRPOTrainer._compute_loss`` itself, driven
  on fixed float64 tensors (an instance made without ``__init__`` that holds only the attributes
  the method reads, its model forward replaced by the fixed log-probs), loss and gradient to 1e-6.
* Each objective's absolute update in the real module: SGD, mini-batch after mini-batch, against
  an independent float64 computation one unpadded sequence at a time (as
  tests/test_module_absolute.py does for DAPO).
* The registry: unknown names and parameters fail naming the valid ones; a user's objective in
  its own module runs through the real ``dapo-lightning fit`` by its dotted path.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning import DAPOModule, PolicyLossConfig, compute_policy_loss
from dapo_lightning.objectives import objective_params, policy_objective, register_policy_objective
from tests._module_harness import fixed_batch
from tests.test_module_absolute import LR, _grpo, _logp, _sequences, module_updates, rel_diff

# ---------------------------------------------------------------------------------------------
# TRL 1.16's _compute_loss on fixed tensors.


class _OneProcess:
    """The accelerator calls _compute_loss makes, for one process."""

    num_processes = 1

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _fixed_tensors():
    g = torch.Generator().manual_seed(7)
    B, T = 5, 6
    lengths = torch.tensor([6, 3, 5, 1, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9], dtype=torch.float64)
    return logp, old, adv, mask


def trl_loss(loss_type, level, logp, old, adv, mask, *, eps_low, eps_high, is_ratio=None):
    """(loss, d loss / d logp) from TRL's GRPOTrainer._compute_loss."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    leaf = logp.clone().requires_grad_()
    B, T = logp.shape
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        leaf,
        torch.zeros_like(leaf),
        None,
    )
    trainer.__dict__.update(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=eps_low,
        epsilon_high=eps_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=torch.nn.Linear(1, 1),
        current_gradient_accumulation_steps=1, accelerator=_OneProcess(),
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(
            delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, steps_per_generation=1
        ),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = trainer._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, trainer._metrics["train"]


def ours(logp, old, adv, mask, **settings):
    leaf = logp.clone().requires_grad_()
    loss, metrics = compute_policy_loss(leaf, old, adv, mask, **settings)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


# (our settings, TRL loss_type, TRL importance_sampling_level, TRL epsilon_low / epsilon_high)
TRL_CASES = {
    # GSPO as the GSPO paper runs it in TRL: sequence-level ratio, GRPO's sequence mean
    "gspo": (
        dict(objective="gspo", clip_ratio_low=0.05, clip_ratio_high=0.06,
             loss_agg_mode="seq-mean-token-mean"),
        "grpo", "sequence", 0.05, 0.06,
    ),
    "cispo": (dict(objective="cispo", objective_kwargs={"cap": 1.1}), "cispo", "token", 0.2, 1.1),
    "cispo default cap": (dict(objective="cispo"), "cispo", "token", 0.2, 5.0),
    "sapo": (dict(objective="sapo", loss_agg_mode="seq-mean-token-mean"), "sapo", "token", 0.2, 0.2),
    "sapo default aggregation": (dict(objective="sapo"), "sapo", "token", 0.2, 0.2),
    "sapo sequence": (
        dict(objective="sapo", importance_sampling_level="sequence",
             loss_agg_mode="seq-mean-token-mean"),
        "sapo", "sequence", 0.2, 0.2,
    ),
    "dapo": (dict(objective="dapo"), "dapo", "token", 0.2, 0.28),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_objective_equals_trl_compute_loss(case):
    pytest.importorskip("trl")
    settings, loss_type, level, eps_low, eps_high = TRL_CASES[case]
    logp, old, adv, mask = _fixed_tensors()
    want, want_grad, trl_metrics = trl_loss(
        loss_type, level, logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high
    )
    got, got_grad, metrics = ours(logp, old, adv, mask, **settings)
    # float64 on both sides: equal to the last bit for dapo, gspo and cispo; sapo's loss differs
    # by 3.8e-08 (TRL writes its gate with another formula: a formula difference, the same on
    # every CPU, where float64 reordering moves 1e-16); 1e-6 is 26x that
    assert abs(float(got - want)) <= 1e-6, (float(got), float(want))
    assert float((got_grad - want_grad).abs().max()) <= 1e-6
    assert float(want_grad.abs().max()) > 1e-3  # the comparison is not of zeros
    if loss_type == "cispo":  # the clip engages, and the metric is TRL's cispo_clip_ratio
        assert metrics["cispo_clipfrac"].item() == pytest.approx(trl_metrics["cispo_clip_ratio"][0])
        assert case == "cispo default cap" or metrics["cispo_clipfrac"] > 0
    if loss_type == "dapo":
        assert metrics["clipfrac_high"].item() == pytest.approx(
            trl_metrics["clip_ratio/high_mean"][0]
        )


def _trl_sapo_by_hand(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL 1.16's ``loss_type="sapo"``, written out here (not our code, not TRL's): per token
    ``l_t = -sigmoid(tau (r_t - 1)) * 4 / tau * A`` with ``tau = tau_pos`` where ``A > 0`` else
    ``tau_neg``; the loss is ``mean_b [sum_t m_bt l_bt / max(sum_t m_bt, 1)]`` (GRPOTrainer's
    branch ``if self.loss_type in ["grpo", "sapo"]``). Returns it and the token-mean of ``l``."""
    rows, token_sum, tokens = [], 0.0, 0.0
    for b in range(logp.shape[0]):
        tau = tau_pos if float(adv[b]) > 0 else tau_neg
        terms = []
        for t in range(logp.shape[1]):
            if mask[b, t]:
                r = math.exp(float(logp[b, t]) - float(old[b, t]))
                terms.append(-4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0))) * float(adv[b]))
        rows.append(sum(terms) / max(len(terms), 1))
        token_sum, tokens = token_sum + sum(terms), tokens + len(terms)
    return sum(rows) / len(rows), token_sum / tokens


def test_sapo_aggregates_per_sequence_by_default_as_trl_does():
    """README: ``sapo`` is computed as TRL 1.16 computes it. By default (``loss_agg_mode``
    unset) its loss is TRL's per-sequence mean; an explicit ``loss_agg_mode`` still wins."""
    logp, old, adv, mask = _fixed_tensors()
    per_seq, token_mean = _trl_sapo_by_hand(logp, old, adv, mask)
    assert abs(per_seq - token_mean) > 0.05  # the two aggregations differ on these tensors
    got, _, _ = ours(logp, old, adv, mask, objective="sapo")
    assert float(got) == pytest.approx(per_seq, rel=1e-12, abs=1e-12)
    assert PolicyLossConfig(objective="sapo").loss_agg_mode is None
    chosen, _, _ = ours(logp, old, adv, mask, objective="sapo", loss_agg_mode="token-mean")
    assert float(chosen) == pytest.approx(token_mean, rel=1e-12, abs=1e-12)
    dapo, _, _ = ours(logp, old, adv, mask)  # dapo's own stays the paper's token-mean
    tok, _, _ = ours(logp, old, adv, mask, loss_agg_mode="token-mean")
    assert float(dapo) == float(tok)
    from tests.test_cli import REPO

    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`sapo` averaged per sequence as TRL does unless `loss_agg_mode` is set" in readme


def test_an_objective_declares_its_own_aggregation():
    @register_policy_objective("per_sequence_reinforce", loss_agg_mode="seq-mean-token-sum")
    def per_sequence_reinforce(inputs, config, params):
        return -inputs.advantages * inputs.log_probs, {}

    logp, old, adv, mask = _fixed_tensors()
    got, _, _ = ours(logp, old, adv, mask, objective="per_sequence_reinforce")
    want = (-adv[:, None] * logp * mask).sum() / (mask.sum(-1) > 0).sum()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    with pytest.raises(ValueError, match=r"^register_policy_objective\('bad'\)\.loss_agg_mode="):
        register_policy_objective("bad", loss_agg_mode="token-sum")


def test_gspo_clips_at_the_sequence_level_unlike_token_level_dapo():
    """The fixed tensors clip some sequences: GSPO differs from DAPO's token ratio there."""
    logp, old, adv, mask = _fixed_tensors()
    kw = dict(clip_ratio_low=0.05, clip_ratio_high=0.06, loss_agg_mode="seq-mean-token-mean")
    gspo, _, met = ours(logp, old, adv, mask, objective="gspo", **kw)
    token, _, _ = ours(logp, old, adv, mask, objective="dapo", **kw)
    seq, _, _ = ours(
        logp, old, adv, mask, objective="dapo", importance_sampling_level="sequence", **kw
    )
    assert float(gspo) == float(seq) and abs(float(gspo - token)) > 1e-3
    assert met["clipfrac_high"] + met["clipfrac_low"] > 0


# ---------------------------------------------------------------------------------------------
# One update after another in the module against float64 by hand.


def _row_terms(name, new, old, a):
    """The objective (to maximise) of one row, summed over its tokens; ``new`` has gradients."""
    r = torch.exp(new - old)
    if name == "gspo":  # one ratio per sequence, its term on every token
        rs = torch.exp((new - old).mean())
        term = torch.minimum(rs * a, torch.clamp(rs, 1 - 0.2, 1 + 0.28) * a)
        return term * len(new)
    if name == "cispo":
        return (torch.clamp(r, max=1.05).detach() * a * new).sum()
    if name == "sapo":
        tau = 1.0 if a > 0 else 1.05
        return (torch.sigmoid(tau * (r - 1)) * 4 / tau * a).sum()
    raise AssertionError(name)


def reference(checkpoint, batch, name):
    """SGD on the token-mean objective, one group per update (old log-probs from the start)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    rows = _sequences(batch)
    adv = _grpo(rows)
    with torch.no_grad():
        old = [_logp(model, p, y) for p, y, _, _ in rows]
    for group in sorted({g for *_, g in rows}):
        members = [i for i, (*_, g) in enumerate(rows) if g == group]
        model.zero_grad()
        tokens = sum(len(rows[i][1]) for i in members)
        total = sum(_row_terms(name, _logp(model, *rows[i][:2]), old[i], adv[i]) for i in members)
        (-total / tokens).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def start(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo"])
def test_module_update_equals_sgd_on_the_objective(tiny_checkpoint, start, name):
    batch = fixed_batch()
    kwargs = {"cap": 1.05} if name == "cispo" else {}
    # the reference is the token-mean objective: sapo's own default is the per-sequence mean
    loss = PolicyLossConfig(objective=name, objective_kwargs=kwargs, loss_agg_mode="token-mean")
    got = module_updates(str(tiny_checkpoint), batch, 1, loss=loss)
    want = reference(str(tiny_checkpoint), batch, name)
    assert rel_diff(got, want, start) < 1e-5
    dapo = module_updates(str(tiny_checkpoint), batch, 1)
    assert rel_diff(got, dapo, start) > 1e-3  # the objective changed the update


# ---------------------------------------------------------------------------------------------
# The registry.


def test_unknown_objective_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"^model\.loss\.objective='ppo' .* valid: dapo, gspo, cispo, sapo"
    ):
        DAPOModule("unused", loss=PolicyLossConfig(objective="ppo"))
    with pytest.raises(ValueError, match="module 'no_such_pkg' cannot be imported"):
        DAPOModule("unused", loss=PolicyLossConfig(objective="no_such_pkg.fn"))
    with pytest.raises(
        ValueError, match="was not found: module tests._user_objective has no 'nope'"
    ):
        DAPOModule("unused", loss=PolicyLossConfig(objective="tests._user_objective.nope"))


def test_objective_parameters_are_declared_and_checked():
    cispo = policy_objective("cispo")
    assert objective_params(cispo, {}) == {"cap": 5.0}
    assert objective_params(policy_objective("sapo"), {"temperature_neg": 2}) == {
        "temperature_pos": 1.0,
        "temperature_neg": 2.0,
    }
    with pytest.raises(
        ValueError,
        match=r"^model\.loss\.objective_kwargs has temperature, which objective 'cispo' does "
        "not take; its parameters: cap",
    ):
        objective_params(cispo, {"temperature": 1.0})
    with pytest.raises(
        ValueError, match=r"^model\.loss\.objective_kwargs\.cap of objective 'cispo' must be > 0"
    ):
        DAPOModule("unused", loss=PolicyLossConfig(objective="cispo", objective_kwargs={"cap": 0}))
    with pytest.raises(ValueError, match=r"^model\.loss\.objective_kwargs\.cap=inf is not finite"):
        PolicyLossConfig(objective="cispo", objective_kwargs={"cap": math.inf})


def test_a_second_function_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'dapo' is already registered"):

        @register_policy_objective("dapo")
        def impostor(inputs, config, params):  # pragma: no cover - never registered
            raise AssertionError


def test_dotted_path_selects_a_user_objective():
    from tests import _user_objective

    logp, old, adv, mask = _fixed_tensors()
    path = "tests._user_objective.scaled_reinforce"
    got, grad, met = ours(logp, old, adv, mask, objective=path, objective_kwargs={"scale": 2.0})
    want = (-2.0 * adv[:, None] * logp * mask).sum() / mask.sum()
    assert float(got) == pytest.approx(float(want), rel=1e-12) and float(met["user_scale"]) == 2.0
    assert torch.allclose(grad, -2.0 * adv[:, None] * mask / mask.sum())
    assert policy_objective(path).fn is _user_objective.scaled_reinforce


def test_user_objective_runs_through_the_cli(tmp_path):
    """``dapo-lightning fit`` with the objective of a user's module, by its dotted path: the
    metric only that objective emits reaches metrics.csv at every update."""
    from tests.test_cli import QUICKSTART, TINY, check, read_csv, run_cli, series, write_override

    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", run_dir, tmp_path / "model")
    check(
        run_cli(
            "fit", "--config", QUICKSTART, "--config", str(override), *TINY,
            "--create_model_if_missing", "tiny",
            "--model.init_args.loss.objective", "_user_objective.scaled_reinforce",
            "--model.init_args.loss.objective_kwargs", "{scale: 3.0}",
            timeout=600,
        )
    )  # fmt: skip
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "update/user_scale")] == [3.0, 3.0]
    saved = next(run_dir.rglob("config.yaml")).read_text()
    assert "objective: _user_objective.scaled_reinforce" in saved


def test_readme_example_objective(tmp_path, monkeypatch):
    """README's "Your own objective" code, as written there, registers a working objective."""
    from tests.test_cli import REPO

    text = (REPO / "README.md").read_text()
    section = text.split("### Your own objective", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 15
    (tmp_path / "my_objectives.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    logp, old, adv, mask = _fixed_tensors()
    settings = dict(objective="my_objectives.capped_reinforce", objective_kwargs={"cap": 1.1})
    got, grad, met = ours(logp, old, adv, mask, **settings)
    r = torch.exp(logp - old)
    w = torch.clamp(r, max=1.1)
    n = mask.sum()
    assert float(got) == pytest.approx(float((-w * adv[:, None] * logp * mask).sum() / n))
    assert torch.allclose(grad, -w * adv[:, None] * mask / n)
    assert float(met["capped_frac"]) == pytest.approx(float(((r >= 1.1) * mask).sum() / n))
    assert 0 < float(met["capped_frac"]) < 1
