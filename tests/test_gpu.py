"""The GPU check (``bash scripts/gpu_check.sh``): the DAPO update on CUDA, with real parts.

``@pytest.mark.gpu`` tests (skipped without CUDA):

1. a bf16-mixed update of a SmolLM2-135M-shaped model (random weights, built in memory) on
   64 x 512 tokens: tokens/s, MFU against a bf16 GEMM peak measured in the same run, peak memory;
2. ``16-mixed`` with a GradScaler clips after unscaling (update norm = lr * clip), and its
   gradient norm is the fp32 run's;
3. FSDP2 (``ModelParallelStrategy``) on one rank gives the single-device update;
4. the HF engine on CUDA samples with log-probs the trainer's forward reproduces (fp32);
5. QLoRA (4-bit base + LoRA adapters) trains, when ``dapo_lightning.lora`` and bitsandbytes are
   there.

Only correctness is asserted, never timings. The numbers go to the JSON file named by
``GPU_CHECK_JSON`` (the script sets it), rewritten after each test so that a run cut short
keeps what it measured. The tests without the marker check the helpers (FLOP counting, the
report, the script's environment step and summary) on the CPU.

FLOPs (the convention of ``benchmarks/_shared/flops.py``, PaLM appendix B): a forward + backward over
``B`` rows of ``L`` tokens is ``6 N B L + 12 n_layers n_heads head_dim L B L`` with ``N`` the
matmul parameters (LM head counted once although tied), a forward alone a third of it. Every
forward the policy runs in an update is counted (a forward hook): the micro-batches' forward +
backward and, if the module takes them, the no-grad old-log-prob forwards. The recomputed logits
of the fused log-prob head in backward are hardware work, not counted.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks._shared.flops import matmul_params, mfu, update_model_flops
from dapo_lightning.batch import RolloutBatch
from dapo_lightning.module import DAPOModule
from dapo_lightning.testing import make_random_rollout_batch
from dapo_lightning.update import BatchingConfig
from tests._module_harness import FixedBatches, UpdateRecorder, fixed_batch, sgd

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run `bash scripts/gpu_check.sh` on a GPU machine",
)

#: SmolLM2-135M's shape (random weights: nothing is downloaded).
SMOLLM2_135M_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
#: Test 1's batch: 64 sequences of 32 prompt + 480 response tokens, 8 per micro-batch.
SEQUENCES, PROMPT_LEN, RESPONSE_LEN, MICRO = 64, 32, 480, 8
#: Test 1's rollout steps: one untimed warm-up, then the timed ones.
STEPS = 6
#: bf16 dense tensor-core peaks from the vendor's data sheets (TFLOP/s), for reference only.
SPEC_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


# ====================================================================== helpers (CPU-tested)
class GpuReport:
    """Named sections of numbers merged into the JSON file at ``path`` under ``"tests"``.

    The file is read and rewritten (atomically) on every :meth:`record`, so what the script
    wrote before (``env``) is kept and a run stopped half-way leaves the sections it finished.
    ``path`` None keeps the sections in memory only.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self.sections: dict[str, dict[str, Any]] = {}

    def record(self, section: str, **values: Any) -> None:
        self.sections.setdefault(section, {}).update({k: _plain(v) for k, v in values.items()})
        if self.path is None:
            return
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        data.setdefault("tests", {})[section] = self.sections[section]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self.path)


def _plain(value: Any) -> Any:
    """A JSON value: tensors to numbers / lists, non-finite floats to strings."""
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ForwardFlops:
    """Counts the model FLOPs of every forward of ``model`` while active (a forward hook).

    A forward with gradients enabled is counted with its backward
    (:func:`~benchmarks._shared.flops.update_model_flops` of its ``[B, L]`` input), one without as a
    third of that. ``forwards_with_grad`` / ``forwards_without_grad`` count the calls, ``tokens``
    the ``B * L`` input positions.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.flops = 0.0
        self.tokens = 0
        self.forwards_with_grad = 0
        self.forwards_without_grad = 0

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, length = ids.shape
        full = update_model_flops(self.config, rows, length)
        if torch.is_grad_enabled():
            self.forwards_with_grad += 1
            self.flops += full
        else:
            self.forwards_without_grad += 1
            self.flops += full / 3
        self.tokens += rows * length

    def __enter__(self) -> ForwardFlops:
        self._handle = self.model.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


def smollm2_batch(policy_version: int = 0) -> RolloutBatch:
    """Test 1's rollout batch (16 groups of 4, fixed tokens), stamped with ``policy_version``."""
    return make_random_rollout_batch(
        num_groups=SEQUENCES // 4,
        group_size=4,
        response_lengths=[RESPONSE_LEN],
        prompt_lengths=[PROMPT_LEN],
        vocab_size=SMOLLM2_135M_SHAPE["vocab_size"],
        seed=0,
        policy_version=policy_version,
    )


class Batches(LightningDataModule):
    """Serves ``batches`` in order, one per training step (one process)."""

    def __init__(self, batches: list[RolloutBatch]) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)


class StepTimer(Callback):
    """Wall time (CUDA synchronised) and counted FLOPs of every training step (= one update)."""

    def __init__(self, counter: ForwardFlops) -> None:
        self.counter = counter
        self.seconds: list[float] = []
        self.flops: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        self._flops0 = self.counter.flops
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, out: Any, b: Any, i: int
    ) -> None:
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._t0)
        self.flops.append(self.counter.flops - self._flops0)


def bf16_gemm_peak(n: int = 8192, repeats: int = 20) -> float:
    """Median FLOP/s of ``n x n @ n x n`` bf16 matmuls on the current CUDA device (CUDA events)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b, c
    torch.cuda.empty_cache()
    return 2.0 * n**3 / statistics.median(times)


def spec_bf16_flops(device_name: str) -> float | None:
    """The data-sheet bf16 dense peak (FLOP/s) of a known device, else None."""
    for key, tflops in SPEC_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def max_rel_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """``max |a - b| / max |a|`` over all entries (as tests/test_module.py)."""
    scale = max(float(v.abs().max()) for v in a.values())
    assert scale > 0, "the update is zero: the comparison would prove nothing"
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def update_norm(delta: dict[str, Tensor]) -> float:
    return float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())))


def gpu_fit(
    checkpoint: Any,
    *,
    precision: str | None = None,
    plugins: tuple = (),
    strategy: Any = "auto",
    batch: RolloutBatch | None = None,
    **module_kwargs: Any,
) -> tuple[dict[str, Tensor], list[dict[str, float]], Trainer]:
    """One rollout step of the fixed batch on one GPU (tests/_module_harness.py's fit_update with
    accelerator="gpu"); returns (parameter delta on the CPU, update metrics, trainer)."""
    from dapo_lightning.weights import full_named_tensors

    torch.manual_seed(0)
    kwargs = dict(optimizer=sgd, optimizer_step=dict(gradient_clip_val=None), parity_check_every=0)
    micro = module_kwargs.pop("micro_batch_size", 4)
    kwargs.update(module_kwargs, batching=BatchingConfig(micro_batch_size=micro))
    module = DAPOModule(str(checkpoint), **kwargs)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    recorder = UpdateRecorder()
    trainer_kwargs: dict[str, Any] = dict(plugins=list(plugins)) if plugins else {}
    if precision is not None:
        trainer_kwargs["precision"] = precision
    trainer = Trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[recorder], **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, datamodule=FixedBatches(batch if batch is not None else fixed_batch()))
    after = dict(full_named_tensors(module.policy))
    delta = {k: after[k].detach().float().cpu() - v.float().cpu() for k, v in before.items()}
    return delta, recorder.updates, trainer


# ====================================================================== fixtures
@pytest.fixture(scope="session")
def gpu_report() -> GpuReport:
    return GpuReport(os.environ.get("GPU_CHECK_JSON"))


@pytest.fixture
def cuda_clean() -> Iterator[None]:
    """Free what a test left on the GPU; matmuls in full fp32 (no TF32) inside."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.set_float32_matmul_precision(saved)
    gc.collect()
    torch.cuda.empty_cache()


# ====================================================================== 1. bf16 SmolLM2 shape
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_bf16_mixed_update_of_a_smollm2_shaped_model(gpu_report, cuda_clean):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPE))  # float32, on the CPU
    params = sum(p.numel() for p in policy.parameters())
    watched = (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    )
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if n in watched}
    peak = bf16_gemm_peak()
    lr = 1e-5
    module = DAPOModule(
        policy=policy, optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
        batching=BatchingConfig(micro_batch_size=MICRO), parity_check_every=0,
    )  # fmt: skip
    # each step's batch is sampled by the current policy version: fresh, like a real run
    batches = [smollm2_batch(policy_version=i) for i in range(STEPS)]
    recorder = UpdateRecorder()
    torch.cuda.reset_peak_memory_stats()
    with ForwardFlops(policy) as counter:
        timer = StepTimer(counter)
        trainer = Trainer(
            accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[timer, recorder],
        )  # fmt: skip
        trainer.fit(module, datamodule=Batches(batches))
    peak_mem = torch.cuda.max_memory_allocated()

    timed_s, timed_flops = timer.seconds[1:], timer.flops[1:]
    seq_len = PROMPT_LEN + RESPONSE_LEN
    tokens = SEQUENCES * seq_len
    name = torch.cuda.get_device_name(0)
    spec = spec_bf16_flops(name)
    result = dict(
        device=name,
        params=params,
        matmul_params=matmul_params(policy.config),
        sequences=SEQUENCES,
        seq_len=seq_len,
        response_tokens=SEQUENCES * RESPONSE_LEN,
        micro_batch_size=MICRO,
        steps=STEPS,
        step_seconds=timer.seconds,
        seconds_per_update=statistics.median(timed_s),
        tokens_per_second=tokens * len(timed_s) / sum(timed_s),
        response_tokens_per_second=SEQUENCES * RESPONSE_LEN * len(timed_s) / sum(timed_s),
        model_flops_per_update=statistics.median(timed_flops),
        achieved_tflops=sum(timed_flops) / sum(timed_s) / 1e12,
        gemm_peak_tflops=peak / 1e12,
        mfu=mfu(sum(timed_flops), sum(timed_s), peak),
        mfu_vs_spec=mfu(sum(timed_flops), sum(timed_s), spec) if spec else None,
        forwards_with_grad_per_update=counter.forwards_with_grad / STEPS,
        forwards_without_grad_per_update=counter.forwards_without_grad / STEPS,
        peak_memory_gib=peak_mem / 2**30,
        loss=[u["loss"] for u in recorder.updates],
        grad_norm=[u["grad_norm"] for u in recorder.updates],
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    )
    gpu_report.record("bf16_update_smollm2_shape", **result)

    assert trainer.precision == "bf16-mixed"
    assert [d.type for d in recorder.devices] == ["cuda"] * STEPS  # fit ends with a .cpu()
    assert len(recorder.updates) == STEPS
    for u in recorder.updates:
        assert math.isfinite(u["loss"]) and u["skipped_nonfinite"] == 0.0
        assert math.isfinite(u["grad_norm"]) and u["grad_norm"] > 0
        assert u["tokens"] == SEQUENCES * RESPONSE_LEN
    assert counter.forwards_with_grad == STEPS * SEQUENCES // MICRO  # 8 micro-batches a step
    params_now = dict(policy.named_parameters())
    for n, p in params_now.items():
        assert torch.isfinite(p).all(), n
    for n, p0 in before.items():
        moved = float((params_now[n].detach().cpu() - p0).abs().max())
        assert 0 < moved <= 4 * lr * STEPS, (n, moved)  # AdamW moves a weight <~ lr a step
    assert peak_mem < 40 * 2**30


# ====================================================================== 2. 16-mixed + GradScaler
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_fp16_mixed_with_a_grad_scaler_clips_after_unscaling(
    tiny_checkpoint, gpu_report, cuda_clean
):
    """With the GradScaler's scale 2**12 the clip must see the true gradient: the update has the
    clipped norm lr * clip, not lr * clip / scale as when scaled gradients are clipped."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    clip, lr = 1e-3, 0.1
    kw = dict(
        optimizer=lambda p: torch.optim.SGD(p, lr=lr), optimizer_step=dict(gradient_clip_val=clip)
    )
    d32, u32, _ = gpu_fit(tiny_checkpoint, **kw)
    dbf, ubf, _ = gpu_fit(tiny_checkpoint, precision="bf16-mixed", **kw)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    d16, u16, trainer = gpu_fit(
        tiny_checkpoint, plugins=(MixedPrecision("16-mixed", "cuda", scaler=scaler),), **kw
    )
    norms = {k: u[0]["grad_norm"] for k, u in (("fp32", u32), ("bf16", ubf), ("fp16", u16))}
    gpu_report.record(
        "fp16_scaler_clip",
        clip=clip,
        lr=lr,
        grad_norm=norms,
        grad_norm_ratio_fp16=norms["fp16"] / norms["fp32"],
        grad_norm_ratio_bf16=norms["bf16"] / norms["fp32"],
        update_norm_ratio_fp32=update_norm(d32) / (lr * clip),
        update_norm_ratio_bf16=update_norm(dbf) / (lr * clip),
        update_norm_ratio_fp16=update_norm(d16) / (lr * clip),
        scale_after=scaler.get_scale(),
    )
    assert trainer.precision == "16-mixed"
    assert scaler.get_scale() == 2.0**12  # no overflow: the step ran at the scale it started
    assert u16[0]["skipped_nonfinite"] == 0.0
    assert norms["fp32"] > 10 * clip  # clipping is active
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=0.05)  # the unscaled norm
    assert update_norm(d32) == pytest.approx(lr * clip, rel=1e-3)
    assert update_norm(dbf) == pytest.approx(lr * clip, rel=1e-2)
    assert update_norm(d16) == pytest.approx(lr * clip, rel=1e-2)


# ====================================================================== 3. FSDP2 on one rank
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_fsdp2_on_one_gpu_gives_the_single_device_update(tiny_checkpoint, gpu_report, cuda_clean):
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dapo_lightning.weights import is_sharded

    single, _, _ = gpu_fit(tiny_checkpoint, micro_batch_size=3)
    try:
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        sharded, updates, trainer = gpu_fit(tiny_checkpoint, micro_batch_size=3, strategy=strategy)
        assert is_sharded(trainer.lightning_module.policy)  # real DTensor parameters
        assert trainer.strategy.root_device.type == "cuda"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # later tests run without a process group
    rel = max_rel_diff(single, sharded)
    gpu_report.record("fsdp2_one_rank", max_rel_diff=rel, grad_norm=updates[0]["grad_norm"])
    assert rel <= 1e-5


# ====================================================================== 4. HF engine parity
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_hf_engine_on_cuda_samples_the_trainers_log_probs(tiny_checkpoint, gpu_report, cuda_clean):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_lightning.logprobs import response_log_probs
    from dapo_lightning.rollout import HFRolloutEngine, SamplingConfig
    from dapo_lightning.testing import completions_to_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).cuda()
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = ["What is 2+2?", "Hi", "A much longer prompt here, with more tokens in it."]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    worst, tokens, per_temperature = 0.0, 0, {}
    for temperature in (1.0, 0.7):
        engine = HFRolloutEngine(model, tokenizer, seed=1)
        assert engine.generator.device.type == "cuda"  # samples on the GPU
        sampling = SamplingConfig(max_tokens=32, temperature=temperature)
        completions = engine.generate(prompts, n=4, sampling=sampling)
        batch = completions_to_batch(prompts, completions, tokenizer.pad_token_id).to("cuda")
        with torch.no_grad():
            logp, _ = response_log_probs(
                model, batch.input_ids, batch.attention_mask, batch.response_width,
                temperature=temperature,
            )  # fmt: skip
        mask = batch.response_mask.bool()
        diff = (logp.float() - batch.rollout_log_probs.float()).abs()[mask]
        assert mask.sum() > 0 and torch.isfinite(logp[mask]).all()
        per_temperature[str(temperature)] = float(diff.max())
        worst, tokens = max(worst, float(diff.max())), tokens + int(mask.sum())
    gpu_report.record(
        "hf_engine_logprob_parity", max_abs_diff=worst, tokens=tokens,
        max_abs_diff_by_temperature=per_temperature,
    )  # fmt: skip
    assert worst < 1e-4


# ====================================================================== 4b. one-step-off on CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_one_step_off_on_cuda_samples_with_the_weights_before_each_update(
    tiny_checkpoint, gpu_report, cuda_clean, tmp_path
):
    """dynamic_sampling.pipeline one_step_off with the HF engine's own copy on the GPU: batch
    k + 1 is sampled on the rollout thread with the weights from before update k (the engine's
    log-probs against each step's weights, on the CPU in float32)."""
    from tests.test_datamodule import trainer
    from tests.test_pipeline import PIPELINED, ChangingModule, hf_dm, token_log_probs

    dm = hf_dm(tiny_checkpoint, **PIPELINED)
    module = ChangingModule(tiny_checkpoint)
    start = time.perf_counter()
    trainer(tmp_path, 4, accelerator="gpu").fit(module, datamodule=dm)
    seconds = time.perf_counter() - start
    assert dm.engine.model is not module.policy
    assert next(dm.engine.model.parameters()).is_cuda  # the engine's copy sits on the GPU
    probe = ChangingModule(tiny_checkpoint).policy
    worst, newer_min = 0.0, float("inf")
    for step, batch in enumerate(module.batches):
        batch = batch.to("cpu")
        mask = batch.response_mask.bool()
        sampled_with = max(step - 1, 0)
        assert batch.sample_version.tolist() == [sampled_with] * batch.batch_size
        weights = {k: v.cpu() for k, v in module.weights_at_step[sampled_with].items()}
        gap = (token_log_probs(probe, weights, batch) - batch.rollout_log_probs)[mask]
        worst = max(worst, float(gap.abs().max()))
        if step >= 1:
            later = {k: v.cpu() for k, v in module.weights_at_step[step].items()}
            other = (token_log_probs(probe, later, batch) - batch.rollout_log_probs)[mask]
            newer_min = min(newer_min, float(other.abs().max()))
    gpu_report.record(
        "one_step_off_cuda", max_abs_diff=worst, newer_weights_min_gap=newer_min,
        fit_seconds=seconds,
    )  # fmt: skip
    assert worst < 1e-3 and newer_min > 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_one_step_off_with_the_engine_on_the_gpu_and_the_update_on_the_cpu(
    tiny_checkpoint, gpu_report, cuda_clean, tmp_path
):
    """The disaggregated layout: the update on one device (here the CPU), the HF engine's own
    copy on another (``engine_kwargs.device: cuda``); pushes cross devices, batch k + 1 still
    has the log-probs of the weights from before update k."""
    from tests.test_datamodule import trainer
    from tests.test_pipeline import PIPELINED, ChangingModule, hf_dm, token_log_probs

    dm = hf_dm(tiny_checkpoint, engine_kwargs={"device": "cuda"}, **PIPELINED)
    module = ChangingModule(tiny_checkpoint)
    trainer(tmp_path, 4).fit(module, datamodule=dm)  # accelerator cpu
    assert next(module.policy.parameters()).device.type == "cpu"
    assert next(dm.engine.model.parameters()).is_cuda
    probe = ChangingModule(tiny_checkpoint).policy
    worst = 0.0
    for step, batch in enumerate(module.batches):
        sampled_with = max(step - 1, 0)
        assert batch.sample_version.tolist() == [sampled_with] * batch.batch_size
        mask = batch.response_mask.bool()
        gap = token_log_probs(probe, module.weights_at_step[sampled_with], batch)
        worst = max(worst, float((gap - batch.rollout_log_probs)[mask].abs().max()))
    gpu_report.record("one_step_off_engine_on_gpu", max_abs_diff=worst)
    assert worst < 1e-3


# ====================================================================== 5. QLoRA
def qlora_unavailable() -> str | None:
    """Why the QLoRA test cannot run here, or None."""
    if importlib.util.find_spec("dapo_lightning.lora") is None:
        return "dapo_lightning/lora.py does not exist"
    from dapo_lightning.lora import LoraSettings

    if "quantize_4bit" not in {f.name for f in dataclasses.fields(LoraSettings)}:
        return "LoraSettings has no quantize_4bit option"
    if "lora" not in inspect.signature(DAPOModule.__init__).parameters:
        return "DAPOModule takes no lora= argument"
    for module in ("peft", "bitsandbytes"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_qlora_4bit_update_on_cuda(tiny_checkpoint, gpu_report, cuda_clean):
    reason = qlora_unavailable()
    if reason is not None:
        gpu_report.record("qlora_4bit", skipped=reason)
        pytest.skip(reason)
    from dapo_lightning.lora import LoraSettings

    torch.manual_seed(0)
    module = DAPOModule(
        str(tiny_checkpoint), lora=LoraSettings(r=8, alpha=16.0, quantize_4bit=True),
        torch_dtype="bfloat16", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        batching=BatchingConfig(micro_batch_size=4), parity_check_every=0,
    )  # fmt: skip
    module.configure_model()
    packed = {
        n: p.detach().clone()
        for n, p in module.policy.named_parameters()
        if hasattr(p, "quant_state")
    }
    adapters = {
        n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad
    }
    assert packed, "the base is not 4-bit (no bitsandbytes Params4bit)"
    assert adapters and all("lora_" in n for n in adapters)
    recorder = UpdateRecorder()
    trainer = Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(module, datamodule=FixedBatches(fixed_batch(), steps=2))  # B moves, then A too
    now = dict(module.policy.named_parameters())
    gpu_report.record(
        "qlora_4bit",
        loss=[u["loss"] for u in recorder.updates],
        grad_norm=[u["grad_norm"] for u in recorder.updates],
        trainable_params=sum(p.numel() for p in adapters.values()),
        quantized_tensors=len(packed),
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
    )
    assert len(recorder.updates) == 2
    assert all(math.isfinite(u["loss"]) and u["skipped_nonfinite"] == 0.0 for u in recorder.updates)
    for n, p0 in adapters.items():
        assert torch.isfinite(now[n]).all() and not torch.equal(now[n].detach(), p0), n
    for n, p0 in packed.items():
        assert torch.equal(now[n].detach(), p0), n  # the 4-bit base is frozen


# ====================================================================== CPU checks of the helpers
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True,
)  # fmt: skip


def test_flop_counter_counts_every_forward_and_the_report_merges(tmp_path):
    """Pinned by hand: matmul params 2 * (64*64 + 2*64*32 + 64*64 + 3*64*128) + 300*64 = 92928;
    a [2, 10] forward + backward 6 * 92928 * 20 + 12 * 2 * 4 * 16 * 10 * 20 = 11,458,560 FLOPs,
    a forward alone a third (3,819,520)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dapo_lightning.logprobs import response_log_probs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    assert matmul_params(model.config) == 92928
    ids = torch.randint(3, 300, (2, 10))
    mask = torch.ones_like(ids)
    with ForwardFlops(model) as counter:
        logp, _ = response_log_probs(model, ids, mask, 4)
        logp.sum().backward()
        with torch.no_grad():
            response_log_probs(model, ids, mask, 4)
    assert (counter.forwards_with_grad, counter.forwards_without_grad) == (1, 1)
    assert counter.tokens == 40
    assert counter.flops == 11_458_560 + 3_819_520
    assert mfu(counter.flops, 2.0, 1e7) == pytest.approx(15_278_080 / 2e7)

    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"env": {"cuda": False}, "tests": {}}))
    report = GpuReport(path)
    report.record("a", x=torch.tensor(1.5), ys=[torch.tensor([1, 2])], bad=math.inf)
    report.record("b", y=2)
    report.record("a", z="kept with x")
    data = json.loads(path.read_text())
    assert data["env"] == {"cuda": False}  # the script's part is kept
    assert data["tests"] == {
        "a": {"x": 1.5, "ys": [[1, 2]], "bad": "inf", "z": "kept with x"},
        "b": {"y": 2},
    }
    assert not list(tmp_path.glob("*.tmp"))
    assert GpuReport(None).sections == {}


def test_smollm2_shape_sizes_and_update_flops():
    """The model test 1 trains is SmolLM2-135M's size (134,515,008 parameters, tied); one update
    over 64 x 512 tokens is 6 * 134,479,872 * 32768 + 12 * 30 * 9 * 64 * 512 * 32768 FLOPs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPE))
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert matmul_params(model.config) == 134_479_872
    expected = 6 * 134_479_872 * 32768 + 12 * 30 * 9 * 64 * 512 * 32768
    assert update_model_flops(model.config, SEQUENCES, PROMPT_LEN + RESPONSE_LEN) == expected
    batch = smollm2_batch(policy_version=3)
    assert tuple(batch.input_ids.shape) == (SEQUENCES, PROMPT_LEN + RESPONSE_LEN)
    assert int(batch.response_mask.sum()) == SEQUENCES * RESPONSE_LEN
    assert bool((batch.sample_version == 3).all())
    assert spec_bf16_flops("NVIDIA H200") == 989.4e12 and spec_bf16_flops("cpu") is None


#: Optional packages the GPU machine may lack: the check must import without them.
OPTIONAL = ",".join(
    ("jsonargparse", "math_verify", "datasets", "pyarrow", "tensorboard", "rich", "matplotlib")
    + ("peft", "bitsandbytes", "vllm", "deepspeed")
)


@pytest.mark.timeout(180)
def test_gpu_check_env_step_maps_callbacks_without_optional_packages(tmp_path):
    """The script's environment step with this Python, the optional packages hidden: the tree
    imports through setup.cfg's package_dir mapping (callbacks/ -> dapo_lightning.callbacks)
    with nothing installed, and the JSON says so."""
    env = dict(
        os.environ, OUT=str(tmp_path), GPU_CHECK_PYTHON=sys.executable, DAPO_GPU_CHECK_HIDE=OPTIONAL
    )
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--env-only"], env=env, capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["status"] == "env_ok" and data["problems"] == []
    env_info = data["env"]
    assert env_info["cuda"] == torch.cuda.is_available()
    assert set(env_info["imports"]) >= {
        "dapo_lightning",
        "dapo_lightning.callbacks",
        "tests._module_harness",
    }
    assert {k: v for k, v in env_info["imports"].items() if k != "dapo_lightning.lora"} == {
        k: "ok" for k in env_info["imports"] if k != "dapo_lightning.lora"
    }
    assert env_info["package_files"]["dapo_lightning.callbacks"] == str(
        (ROOT / "callbacks" / "__init__.py").resolve()
    )
    assert set(OPTIONAL.split(",")) <= set(env_info["missing_optional"])  # hidden = missing
    assert "package_dir mapping (setup.cfg): dapo_lightning.callbacks -> " in proc.stdout


def test_gpu_check_summary_prints_the_recorded_numbers(tmp_path):
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({
        "status": "passed",
        "env": {"device_name": "NVIDIA H200", "torch": "2.11.0", "torch_cuda": "13.0"},
        "pytest": {"rc": 0, "passed": 4, "failed": 0, "errors": 0, "skipped": 1, "seconds": 93.0,
                   "cases": [{"name": "tests.test_gpu::test_qlora_4bit_update_on_cuda",
                              "outcome": "skipped", "message": "bitsandbytes is not installed"}]},
    }))  # fmt: skip
    report = GpuReport(path)
    report.record(
        "bf16_update_smollm2_shape", sequences=64, seq_len=512, seconds_per_update=0.125,
        tokens_per_second=262144.0, mfu=0.3141, gemm_peak_tflops=750.0, peak_memory_gib=9.5,
    )  # fmt: skip
    report.record("fsdp2_one_rank", max_rel_diff=3e-7)
    report.record("hf_engine_logprob_parity", max_abs_diff=2e-6, tokens=600)
    report.record("qlora_4bit", skipped="bitsandbytes is not installed")
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--summary", str(path)],
        env=dict(os.environ, GPU_CHECK_PYTHON=sys.executable), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "status: passed" in out and "device: NVIDIA H200" in out
    assert "pytest: 4 passed, 0 failed, 0 errors, 1 skipped in 93.0 s (rc 0)" in out
    assert "skipped: tests.test_gpu::test_qlora_4bit_update_on_cuda: bitsandbytes" in out
    assert (
        "bf16 update (SmolLM2-135M shape, 64 x 512 tokens): 0.125 s/update, 262,144 tokens/s, "
        "MFU 0.314 of 750 TFLOP/s measured bf16 GEMM, peak memory 9.50 GiB"
    ) in out
    assert "FSDP2 one rank vs single device: max rel diff 3.00e-07" in out
    assert "HF engine parity (fp32): max abs diff 2.00e-06 over 600 tokens" in out
    assert "QLoRA 4-bit: skipped (bitsandbytes is not installed)" in out
