"""Shared pieces for DAPOModule tests: a data module that serves fixed RolloutBatches and a
runner that fits for a few updates and returns the parameter update.

Also runnable as a script under ``torch.distributed.run`` (2 gloo processes) for the DDP case:
``python -m torch.distributed.run --nproc_per_node 2 tests/_module_harness.py CKPT OUT MICRO
[STRATEGY [MODULE_KWARGS_JSON]]``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from dapo_lightning.callbacks import DAPOCallback
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from dapo_lightning.batch import RolloutBatch
from dapo_lightning.module import DAPOModule
from dapo_lightning.testing import make_random_rollout_batch
from dapo_lightning.update import BatchingConfig

try:
    from tests._harness import make_trainer
except ModuleNotFoundError:  # run as a script (torch.distributed.run): tests/ is sys.path[0]
    from _harness import make_trainer

# Lengths that differ a lot within and across micro-batches and ranks.
RESPONSE_LENGTHS = [1, 40, 3, 2, 35, 1, 5, 30, 2, 1, 28, 4, 6, 1, 33, 2]
NUM_GROUPS, GROUP_SIZE = 4, 4


def fixed_batch(seed: int = 0, stale_groups: tuple[int, ...] = ()) -> RolloutBatch:
    """The fixed batch; ``stale_groups`` were sampled by policy version -1 (stale from the
    first update on: the stale-sample correction applies to them)."""
    batch = make_random_rollout_batch(
        num_groups=NUM_GROUPS,
        group_size=GROUP_SIZE,
        response_lengths=RESPONSE_LENGTHS,
        seed=seed,
    )
    for group in stale_groups:
        batch.sample_version[batch.group_index == group] = -1
    return batch


class FixedBatches(LightningDataModule):
    """Serves the same rollout batch every step; under DDP each rank gets its share of groups."""

    def __init__(self, batch: RolloutBatch, steps: int = 1) -> None:
        super().__init__()
        self.batch, self.steps = batch, steps

    def train_dataloader(self) -> DataLoader:
        world = self.trainer.world_size
        rank = self.trainer.global_rank
        per_rank = self.batch.num_groups // world
        groups = range(rank * per_rank, (rank + 1) * per_rank)
        rows = torch.cat([(self.batch.group_index == g).nonzero().flatten() for g in groups])
        local = self.batch.select(rows)
        local.group_index = local.group_index - local.group_index.min()
        return DataLoader([local] * self.steps, batch_size=None)


class UpdateRecorder(DAPOCallback):
    """Keeps every update's metrics (as the module reduced them over ranks) and the device the
    module was on during it (Lightning moves the module back to the CPU when ``fit`` ends)."""

    def __init__(self) -> None:
        self.updates: list[dict[str, float]] = []
        self.devices: list[torch.device] = []

    def on_dapo_update(self, trainer: Any, pl_module: Any, metrics: dict[str, float]) -> None:
        self.updates.append(dict(metrics))
        self.devices.append(pl_module.device)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def fit_update(
    checkpoint: str,
    *,
    micro_batch_size: int,
    devices: int = 1,
    steps: int = 1,
    strategy: str | None = None,
    batch_seed: int = 0,
    batching: dict[str, Any] | None = None,
    stale_groups: tuple[int, ...] = (),
    **module_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], DAPOModule]:
    """Fit ``steps`` rollout steps on the fixed batch; returns (parameter delta, module).
    ``batching`` holds BatchingConfig fields besides ``micro_batch_size``; ``stale_groups``:
    :func:`fixed_batch`'s."""
    torch.manual_seed(0)
    kwargs = dict(
        optimizer=sgd,
        optimizer_step=dict(gradient_clip_val=None),
        batching=BatchingConfig(micro_batch_size=micro_batch_size, **(batching or {})),
        parity_check_every=0,
    )
    kwargs.update(module_kwargs)
    module = DAPOModule(checkpoint, **kwargs)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = make_trainer(
        devices=devices,
        strategy=strategy or ("ddp" if devices > 1 else "auto"),
        max_steps=-1,
        num_sanity_val_steps=0,
    )
    recorder = UpdateRecorder()
    trainer.callbacks.append(recorder)
    trainer.fit(
        module, datamodule=FixedBatches(fixed_batch(batch_seed, tuple(stale_groups)), steps=steps)
    )
    module.recorded_updates = recorder.updates
    from dapo_lightning.weights import full_named_tensors

    after = dict(full_named_tensors(module.policy))  # gathered when sharded (FSDP2)
    delta = {k: after[k] - v for k, v in before.items()}
    return delta, module


if __name__ == "__main__":
    import json

    ckpt, out, micro = sys.argv[1], sys.argv[2], int(sys.argv[3])
    strategy = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    module_kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    delta, module = fit_update(
        ckpt, micro_batch_size=micro, devices=2, strategy=strategy, **module_kwargs
    )
    if module.trainer.global_rank == 0:
        torch.save(delta, out)
        torch.save(module.recorded_updates, out + ".updates")
    if torch.distributed.is_initialized():  # a clean exit (gloo threads joined)
        torch.distributed.destroy_process_group()
