"""The optimizer on resume: the config's hyper-parameters put back over the checkpoint's
(:func:`optimizer_settings`, :func:`apply_optimizer_settings`), and a change of optimizer class
refused in one line (:func:`check_same_optimizer`) instead of a ``KeyError`` inside its first
``step``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dapo_lightning.checkpoint.checks import load_header
from dapo_lightning.checks import ConfigError

#: Param-group keys that are not the optimizer's own (the parameters; a scheduler's peak).
_NOT_OPTIMIZER_KEYS = {"params", "initial_lr"}


def optimizer_settings(trainer: Any) -> list[list[dict[str, Any]]]:
    """The hyper-parameters of every param group of every optimizer of ``trainer`` (everything
    but the parameters), to compare with what a resume restored."""
    return [
        [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for optimizer in trainer.optimizers
    ]


def apply_optimizer_settings(trainer: Any, configured: list[list[dict[str, Any]]]) -> list[str]:
    """Put the configured optimizer hyper-parameters back after a resume restored the
    checkpoint's; returns one line per value changed, e.g.
    ``"lr: 0.001 (checkpoint) -> 0.0005 (config)"``.

    A resumed optimizer keeps its moments (``exp_avg`` ...) from the checkpoint, but its
    hyper-parameters (learning rate, weight decay, betas) follow the config: what the saved
    ``config.yaml`` says is what runs. Under a learning-rate scheduler the configured peak is
    ``initial_lr``; the scheduler's ``base_lrs`` and the current ``lr`` are rescaled to it, so
    the schedule continues where it was, at the new peak.
    """
    changes: list[str] = []
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    for i, (optimizer, groups) in enumerate(zip(trainer.optimizers, configured)):
        if len(groups) != len(optimizer.param_groups):
            continue  # a different model: nothing to compare
        for j, (group, wanted) in enumerate(zip(optimizer.param_groups, groups)):
            name = f"optimizer {i} group {j}: " if len(trainer.optimizers) * len(groups) > 1 else ""
            scheduled = "initial_lr" in group and "initial_lr" in wanted
            for key, value in wanted.items():
                if (scheduled and key == "lr") or key not in group or _same(group[key], value):
                    continue
                shown = "lr" if key == "initial_lr" else key  # the configured (peak) lr
                changes.append(f"{name}{shown}: {group[key]} (checkpoint) -> {value} (config)")
                if scheduled and key == "initial_lr" and group[key]:
                    group["lr"] *= value / group[key]
                    for scheduler in schedulers:
                        if scheduler.optimizer is optimizer:
                            scheduler.base_lrs[j] = value
                group[key] = value
    return changes


def _same(a: Any, b: Any) -> bool:
    """Equal, counting a list and a tuple of the same items as equal (betas come back as either)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. tensors of another shape: not the same
        return False


def check_same_optimizer(trainer: Any, configured: list[list[dict[str, Any]]]) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` when the optimizer a resume restored
    (``trainer.optimizers``, after Lightning loaded the checkpoint's state into them) is of
    another class than the configured one: a configured hyper-parameter (``configured``, read
    before the restore: :func:`optimizer_settings`) is missing from the restored param groups
    (an SGD config over an AdamW checkpoint has no ``momentum``). One line names both classes
    and the fixes: a fresh run, or the checkpoint's weights only (``dapo-lightning export``)."""
    for optimizer, groups in zip(trainer.optimizers, configured):
        for group, wanted in zip(optimizer.param_groups, groups):
            missing = set(wanted) - set(group) - _NOT_OPTIMIZER_KEYS
            if missing:
                raise ConfigError(_changed_optimizer(trainer, optimizer, sorted(missing)))


def _changed_optimizer(trainer: Any, optimizer: Any, missing: list[str]) -> str:
    path, now = trainer.ckpt_path, type(optimizer).__name__
    before = saved_optimizer_class(path, trainer.optimizers.index(optimizer))
    return (
        f"model.optimizer: {path} was saved with the optimizer {before} and the config's is "
        f"{now} (the checkpoint's state has no {', '.join(missing)}): a resume cannot change "
        f"the optimizer class. Fix: keep model.optimizer at {before} to resume, start a fresh "
        f"run with {now} (another trainer.default_root_dir, without --ckpt_path), or take the "
        f"checkpoint's weights only: dapo-lightning export {path} FOLDER, then a fresh run with "
        "--model.init_args.model_name_or_path FOLDER."
    )


def saved_optimizer_class(path: Any, index: int = 0) -> str:
    """The name of the ``torch.optim`` class whose param groups have the keys (and the boolean
    defaults, Adam / AdamW) of optimizer ``index`` in the checkpoint at ``path``, or
    ``"another optimizer"`` when none matches."""
    try:
        saved = load_header(path)["optimizer_states"][index]["param_groups"][0]
    except Exception:  # noqa: BLE001 - unreadable here: it cannot be named
        return "another optimizer"
    keys = set(saved) - _NOT_OPTIMIZER_KEYS
    matches = [
        (name, defaults) for name, defaults in _torch_optimizer_defaults() if set(defaults) == keys
    ]
    exact = [name for name, defaults in matches if all(
        saved[k] == v for k, v in defaults.items() if isinstance(v, bool)
    )]  # fmt: skip
    names = exact or [name for name, _ in matches]
    return " or ".join(names) if names else "another optimizer"


def _torch_optimizer_defaults() -> list[tuple[str, dict[str, Any]]]:
    """Each ``torch.optim`` optimizer class's name and param-group defaults (built on one
    parameter; classes that need more arguments are left out)."""
    found = []
    for name, cls in inspect.getmembers(torch.optim, inspect.isclass):
        if not issubclass(cls, torch.optim.Optimizer) or cls is torch.optim.Optimizer:
            continue
        try:
            group = cls([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
        except Exception:  # noqa: BLE001 - needs arguments we do not guess
            continue
        found.append((name, {k: v for k, v in group.items() if k not in _NOT_OPTIMIZER_KEYS}))
    return found
