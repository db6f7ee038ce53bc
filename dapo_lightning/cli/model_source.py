"""The model a run trains: ``create_model_if_missing`` (a tiny model written on first use,
atomically) and the check that ``model.model_name_or_path`` can be loaded at all (a local
folder, or a hub model in the cache or on a reachable hub).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from huggingface_hub import HfApi, constants, try_to_load_from_cache
from huggingface_hub.errors import RepositoryNotFoundError
from jsonargparse import Namespace

from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.run_setup import run_path
from dapo_lightning.export import atomic_folder
from dapo_lightning.interrupt import exit_at_once_on_stop_signals
from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
from dapo_lightning.testing import make_tiny_checkpoint


@dataclass
class CreateModel:
    """``create_model_if_missing``: write a tiny model folder when it does not exist yet.

    Args:
        kind: ``tiny`` (random weights) or ``tiny-arithmetic`` (the quickstart's warmed-up model).
        path: The folder; relative: under ``trainer.default_root_dir``. When
            ``model.model_name_or_path`` is unset or this same string, it becomes this folder;
            when it names anything else, nothing is written. None: ``model.model_name_or_path``
            itself (it must be a local-looking path, never a hub id).
    """

    kind: Literal["tiny", "tiny-arithmetic"]
    path: str | None = None


#: ``org/name`` as the hub spells model ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _refuse_hub_id(value: str) -> None:
    if _HUB_ID.fullmatch(value) and not Path(value).exists():
        raise ConfigError(
            f"create_model_if_missing: {value!r} looks like a Hugging Face hub id, not a folder "
            f"to write a tiny model into. To load that model, drop create_model_if_missing; to "
            f"write a tiny model into a local folder of that name, write './{value}'."
        )


def _model_target(config: Namespace, option: Any) -> Path | None:
    """Where ``create_model_if_missing`` writes (setting ``model_name_or_path`` to it when the
    config names the same folder), or None when the model path names another one."""
    model_args = config.model.init_args
    given = model_args.get("model_name_or_path")
    if isinstance(option, str) or option.path is None:
        if given is None:
            return None  # DAPOModule reports the missing model path
        _refuse_hub_id(str(given))
        return Path(given)
    _refuse_hub_id(option.path)
    target = run_path(config.trainer.get("default_root_dir"), option.path)
    if given not in (None, option.path, target):
        print(
            f"create_model_if_missing: nothing written, model.model_name_or_path is {given!r}, "
            f"not the folder it creates ({target!r}).",
            file=sys.stderr,
        )
        return None
    model_args.model_name_or_path = target
    data_args = (config.get("data") or Namespace()).get("init_args")
    if isinstance(data_args, Namespace):
        data_args.model_name_or_path = target
    return Path(target)


def model_to_create(config: Namespace) -> tuple[str, Path] | None:
    """``(kind, folder)`` when ``create_model_if_missing`` asks for a folder that does not exist
    yet (``model.model_name_or_path`` set to it), else None."""
    option = config.get("create_model_if_missing")
    if option is None:
        return None
    target = _model_target(config, option)
    if target is None or target.exists():
        return None
    return (option if isinstance(option, str) else option.kind), target


def write_model(config: Namespace, kind: str, target: Path) -> None:
    """Write the tiny ``kind`` model at ``target`` atomically (a temporary folder beside it,
    renamed when complete), one progress line per stage."""
    seed = config.get("seed_everything")
    # not `seed in (None, True, False)`: 1 == True would map seed 1 to 0
    seed = 0 if seed is None or isinstance(seed, bool) else int(seed)
    say = lambda line: print(f"create_model_if_missing: {line}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.monotonic()
    for stale in remove_stale_temp_folders(target):
        say(f"removed {stale}, left by an interrupted write")
    say(f"{target} does not exist: writing the {kind!r} model (seed {seed}; nothing is downloaded)")
    # SIGTERM / SIGINT: the temporary folder is removed, the next run writes the model again
    stopped = f"{target} was not written (the next run writes it)"
    with exit_at_once_on_stop_signals(stopped), atomic_folder(target) as tmp:
        if kind == "tiny":
            make_tiny_checkpoint(tmp, seed=seed)
        else:
            say(f"warming it up on the task's problems in {tmp}")
            make_quickstart_checkpoint(tmp, seed=seed, report=say, **_warmup_task_kwargs(config))
    say(f"done in {time.monotonic() - t0:.1f} s: {target}")


def remove_stale_temp_folders(target: Path) -> list[Path]:
    """Delete the temporary folders an interrupted (killed) write of ``target`` left beside it
    (``.NAME.tmp-PID-*`` of :func:`~dapo_lightning.export.atomic_folder` whose process is gone);
    returns them."""
    removed = []
    for tmp in sorted(target.parent.glob(f".{target.name}.tmp-*")):
        pid = tmp.name.removeprefix(f".{target.name}.tmp-").split("-")[0]
        if tmp.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from before (this process writes a new one)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _warmup_task_kwargs(config: Namespace) -> dict[str, Any]:
    """The warm-up sees the problems the data module will serve."""
    data = (config.get("data") or Namespace()).get("init_args") or Namespace()
    prompts = data.get("prompts") or Namespace()
    task_kwargs = dict(prompts.get("task_kwargs") or {})
    task_kwargs.setdefault("task_seed", task_kwargs.pop("seed", data.get("seed") or 0))
    chat = prompts.get("apply_chat_template")
    if chat is not None:
        task_kwargs["apply_chat_template"] = bool(chat)
    return task_kwargs


def check_model_source(value: str | None) -> None:
    """Raise :class:`ConfigError` when ``model.model_name_or_path`` can be neither a local
    folder nor a reachable hub model: a path that does not exist, or a hub id that is not in
    the local cache while the hub cannot be reached (or has no such model). Without this the
    first sign was three chained tracebacks from the tokenizer's loader."""
    if value is None or Path(value).expanduser().exists():
        return  # None: DAPOModule says what is missing
    fix = (
        "Fix: give the folder of a model written by save_pretrained, or a hub id "
        "such as Qwen/Qwen2.5-0.5B-Instruct; --create_model_if_missing tiny writes the tiny "
        "test model."
    )
    if value.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(value):
        raise ConfigError(f"model.model_name_or_path: {value} does not exist. {fix}")
    problem = hub_problem(value)
    if problem is not None:
        raise ConfigError(
            f"model.model_name_or_path: {value!r} is no local folder and {problem}. Fix: correct "
            f"the path, or download the model where there is network (`hf download {value} "
            "--local-dir DIR`) and give DIR."
        )


def hub_problem(repo_id: str) -> str | None:
    """Why the hub model ``repo_id`` cannot be loaded here, or None when it can (it is in the
    local cache, or the hub answers that it exists, or says something this check cannot judge,
    such as a gated model)."""
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "it is not in the local hub cache (HF_HUB_OFFLINE is set)"
    host = constants.ENDPOINT.split("://", 1)[-1].split("/", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        return f"the hub ({constants.ENDPOINT}) cannot be reached ({error})"
    try:
        HfApi().model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        return f"the hub ({constants.ENDPOINT}) has no such model"
    except Exception:  # noqa: BLE001 - gated, rate limited...: the loader will say
        return None
    return None
