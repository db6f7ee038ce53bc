"""EngineSession: the one push path. Full, checkpoint-named tensors from a plain, DDP-, FSDP1-,
FSDP2- or ZeRO-3-wrapped policy; versions; sleep/wake; the HF engine's own copy under sharding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from dapo_lightning.rollout import EngineCapabilities, RolloutEngine, SamplingConfig
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.testing import free_port, make_tiny_tokenizer, one_process_group
from dapo_lightning.weights import full_named_tensors, is_sharded, strip_wrapper_prefixes


class RecordingEngine(RolloutEngine):
    """A real RolloutEngine whose load_weights keeps what it was given (names, full copies)."""

    capabilities = EngineCapabilities(sleep=True)

    def __init__(self, sleep_mode: bool = False) -> None:
        self.pushed: list[dict[str, torch.Tensor]] = []
        self.sleep_mode = sleep_mode
        self.events: list[str] = []

    def generate(self, prompts, n, sampling):
        self.events.append("generate")
        return [[] for _ in prompts]

    def load_weights(self, named_tensors):
        self.events.append("load")
        self.pushed.append({k: v.detach().clone() for k, v in named_tensors})

    def wake_up(self):
        self.events.append("wake")

    def sleep(self):
        self.events.append("sleep")


def _perturbed(model, seed):
    out = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def test_strip_wrapper_prefixes():
    assert strip_wrapper_prefixes("module._orig_mod.model.norm.weight") == "model.norm.weight"
    assert (
        strip_wrapper_prefixes("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.w")
        == "model.layers.0.mlp.w"
    )


def test_full_named_tensors_plain_ddp_fsdp1_fsdp2(hf_model, tmp_path):
    ref = hf_model.state_dict()
    plain = dict(full_named_tensors(hf_model))
    assert "lm_head.weight" in plain  # checkpoint format, unlike named_parameters()
    assert "lm_head.weight" not in dict(hf_model.named_parameters())
    assert plain.keys() == ref.keys()

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with one_process_group(tmp_path / "pg"):  # or the group an in-process vLLM left
        ddp = torch.nn.parallel.DistributedDataParallel(_perturbed(hf_model, seed=1))
        got = dict(full_named_tensors(ddp))
        assert got.keys() == ref.keys()
        assert torch.equal(got["model.norm.weight"], ddp.module.model.norm.weight)

        # FSDP1 (what Lightning's FSDPStrategy wraps with); world size 1 means NO_SHARD here.
        fsdp1_model = _perturbed(hf_model, seed=4)
        expected1 = {k: v.clone() for k, v in fsdp1_model.state_dict().items()}
        fsdp1 = FSDP(fsdp1_model, device_id=torch.device("cpu"), use_orig_params=True)
        assert next(iter(dict(fsdp1.named_parameters()))).startswith("_fsdp_wrapped_module.")
        got = dict(full_named_tensors(fsdp1))
        assert got.keys() == expected1.keys()
        assert all(torch.equal(got[k], v) for k, v in expected1.items())

        sharded = _perturbed(hf_model, seed=2)
        expected = {k: v.clone() for k, v in sharded.state_dict().items()}
        fully_shard(sharded)
        assert isinstance(sharded.model.norm.weight, DTensor) and is_sharded(sharded)
        got = dict(full_named_tensors(sharded))
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert not isinstance(got[k], DTensor)
            assert torch.equal(got[k], v), k


def test_session_pushes_full_state_once_per_new_version(hf_model):
    engine = RecordingEngine(sleep_mode=True)
    session = EngineSession(engine)
    model = _perturbed(hf_model, seed=7)
    session.attach(lambda: model)
    with session.generating(version=0) as e:  # the engine was built from version 0: no push
        e.generate([[1]], 1, SamplingConfig(max_tokens=2))
    assert engine.events == ["wake", "generate", "sleep"] and session.pushes == 0
    with session.generating(version=3):
        pass
    with session.generating(version=3):
        pass
    assert session.pushes == 1 and session.version == 3
    assert engine.events[3:] == ["wake", "load", "sleep", "wake", "sleep"]  # woken before the push
    pushed = engine.pushed[0]
    assert pushed.keys() == model.state_dict().keys()  # tied lm_head.weight included
    assert all(torch.equal(pushed[k], v) for k, v in model.state_dict().items())


def test_hf_engine_shares_the_policy_and_is_never_pushed_to(hf_model):
    session = EngineSession("hf", tokenizer=make_tiny_tokenizer(), seed=3, rank=1)
    session.attach(lambda: hf_model)
    assert session.engine.model is hf_model and session.shares_policy
    assert session.engine.seed == 4  # seed + rank
    assert session.sync(5) and session.pushes == 0 and session.version == 5


def test_engine_state_waits_for_the_engine(hf_model):
    first = EngineSession("hf", tokenizer=make_tiny_tokenizer(), seed=0)
    first.attach(lambda: hf_model)
    first.engine.generator.manual_seed(123)
    state = first.state_dict()
    later = EngineSession("hf", tokenizer=make_tiny_tokenizer(), seed=0)
    later.load_state_dict(state)  # before the engine exists (as on resume)
    later.attach(lambda: hf_model)
    assert torch.equal(later.engine.generator.get_state(), first.engine.generator.get_state())


def test_session_errors_name_the_fix():
    with pytest.raises(ValueError, match="engine='sglang'"):
        EngineSession("sglang")
    with pytest.raises(ValueError, match="model_path"):
        EngineSession("vllm")
    with pytest.raises(RuntimeError, match="attach"):
        _ = EngineSession("hf").engine


# ------------------------------------------------------------------- 2 real FSDP2 ranks
def _fsdp2_worker(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dapo_lightning.logprobs import response_log_probs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model = _perturbed(model, seed=11)  # the same perturbation on both ranks
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = model.model.embed_tokens.weight.to_local().shape
        recording = RecordingEngine()
        session = EngineSession(recording)
        session.attach(lambda: model)
        session.sync(1)
        pushed = recording.pushed[0]
        full = all(torch.equal(pushed[k], v) for k, v in expected.items())
        # the HF engine under sharding samples with its own unsharded copy, pushed to
        hf = EngineSession("hf", model_path=checkpoint, tokenizer=make_tiny_tokenizer(), rank=rank)
        hf.attach(lambda: model)
        own = hf.engine.model is not model and hf.engine.owns_model
        hf.sync(1)
        prompt = [2, 60, 61, 62]
        out = hf.engine.generate([prompt], 2, SamplingConfig(max_tokens=8))[0]
        gap = 0.0
        for c in out:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logp, _ = response_log_probs(model, ids, torch.ones_like(ids), len(c.token_ids))
            gap = max(gap, (logp[0] - torch.tensor(c.log_probs)).abs().max().item())
        torch.save(
            {
                "keys": sorted(pushed) == sorted(expected),
                "full": full,
                "local": tuple(local),
                "own": own,
                "gap": gap,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_fsdp2_ranks_push_full_tensors_and_keep_parity(tiny_checkpoint, tmp_path):
    mp.spawn(
        _fsdp2_worker, args=(free_port(), str(tiny_checkpoint), str(tmp_path)), nprocs=2,
        join=True,
    )  # fmt: skip
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["local"] == (130, 128) or r["local"] == (129, 128)  # real shards of (259, 128)
        assert r["keys"] and r["full"]  # every checkpoint name, full shape, exact values
        assert r["own"]  # the HF engine did not sample with the sharded policy
        assert r["gap"] < 1e-5, r["gap"]  # parity after the push, on every rank


_ZERO3_SCRIPT = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", LOCAL_RANK="0",
                  WORLD_SIZE="1")
import deepspeed
from transformers import AutoModelForCausalLM
from dapo_lightning.weights import full_named_tensors
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ref = {k: v.clone() for k, v in model.state_dict().items()}
deepspeed.init_distributed(dist_backend="gloo")
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
w = engine.module.model.norm.weight
assert hasattr(w, "ds_id") and w.numel() == 0, "parameters are not ZeRO-3 partitioned"
got = dict(full_named_tensors(engine))
assert got.keys() == ref.keys(), set(got) ^ set(ref)
assert all(torch.equal(got[k], v) for k, v in ref.items())
print("ZERO3-OK")
"""


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_full_named_tensors_deepspeed_zero3(tiny_checkpoint):
    pytest.importorskip("deepspeed")
    # A subprocess: DeepSpeed keeps process-global communication state.
    proc = subprocess.run(
        [sys.executable, "-c", _ZERO3_SCRIPT, str(tiny_checkpoint), str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,  # DeepSpeed may JIT-build its shm op first (minutes on 2 busy cores)
    )
    assert "ZERO3-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
