"""Prompt sources: JSONL, Parquet and Hugging Face ``datasets`` files with a field mapping.

Rows become :class:`PromptRecord` s (uid, prompt, answer, data_source). The DAPO-Math-17k
schema is read as is: ``prompt`` is a list of chat messages, the answer sits at
``reward_model.ground_truth`` (a dotted path), ``data_source`` names the source. Then
:func:`deduplicate` removes repeated prompts (the public DAPO-Math-17k file repeats each ~100x),
:func:`split_train_val` holds out a validation share, and :func:`tokenize_records` applies the
chat template and enforces ``max_prompt_length``.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dapo_lightning.data.prompts.progress import StageProgress
from dapo_lightning.prompts import (
    ROW_META_KEYS,
    Prompt,
    PromptDataError,
    PromptRecord,
    encode_prompts,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldMap:
    """Where each field lives in a row (dotted paths walk nested dicts: ``reward_model.ground_truth``).

    Args:
        prompt_key: The prompt: a string or a list of ``{"role", "content"}`` chat messages.
        answer_key: The ground-truth answer (numbers are converted to strings).
        uid_key: A stable prompt id; None derives one from a hash of the prompt.
        data_source_key: Where the row came from (passed to the reward as ``data_source``);
            None or a missing field leaves it empty.
    """

    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    uid_key: str | None = None
    data_source_key: str | None = "data_source"


def get_field(row: dict[str, Any], path: str) -> Any:
    """``row[a][b]...`` for ``path = "a.b..."``; raises KeyError naming the missing part."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def prompt_text(prompt: Prompt) -> str:
    """A canonical string of a prompt (for hashing and de-duplication)."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps([[m["role"], m["content"]] for m in prompt], ensure_ascii=False)


def prompt_uid(prompt: Prompt) -> str:
    """Stable id of a prompt: the first 16 hex digits of the SHA-1 of its canonical text."""
    return hashlib.sha1(prompt_text(prompt).encode("utf-8")).hexdigest()[:16]


#: File endings that mark a ``train_files`` entry as a local path, never a hub dataset name.
LOCAL_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt", ".gz")


def looks_like_local_path(source: str) -> bool:
    """True when ``source`` names a local file or folder rather than a hub dataset.

    A hub name is exactly ``org/name`` (optionally ``:split``); anything with a leading ``.``,
    ``/`` or ``~``, a backslash, no slash or more than one, a data-file ending
    (:data:`LOCAL_FILE_SUFFIXES`), or a first part that is an existing local folder is a path.
    """
    name = source.partition(":")[0]
    return (
        source.startswith((".", "/", "~"))
        or "\\" in source
        or name.count("/") != 1
        or Path(name).suffix.lower() in LOCAL_FILE_SUFFIXES
        or Path(name.split("/")[0]).is_dir()
    )


def _not_utf8(path: Path, data: bytes, start: int, line: int, reason: str) -> PromptDataError:
    """The error of a prompt file that is not UTF-8: byte ``start`` (on ``line``) of it is
    ``data[0]``."""
    return PromptDataError(
        f"{path} is not UTF-8 text: byte {start} (line {line}) is {data[:1]!r} ({reason}). "
        f"Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path.name} > "
        f"fixed{path.suffix}`, or your editor's save-with-encoding)."
    )


def read_text(path: Path) -> str:
    """The text of a UTF-8 file; a UTF-8 byte-order mark is dropped.

    Raises:
        PromptDataError: The file is not UTF-8 (names the byte offset and the line).
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise _not_utf8(path, data[e.start :], e.start, line, e.reason) from None


def _iter_jsonl(path: Path) -> Iterator[Any]:
    """The rows of a JSONL file, one line at a time (a 200 MB file never sits in memory as text
    and as rows at once), with progress lines while a large one is read
    (:class:`~dapo_lightning.data.prompts.progress.StageProgress`)."""
    progress = StageProgress(f"reading {path}", path.stat().st_size, "MB")
    offset = 0
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            start = 3 if i == 0 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                line = raw[start:].decode("utf-8")
            except UnicodeDecodeError as e:
                at = offset + start + e.start
                raise _not_utf8(path, raw[start + e.start :], at, i + 1, e.reason) from None
            offset += len(raw)
            if i % 8192 == 0:
                progress.update(offset)
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(
                    f"{path}: line {i + 1} is not valid JSON ({e}): fix or delete it."
                ) from e
    progress.finish()


def _read_file(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return list(_iter_jsonl(path))
    if suffix == ".json":
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path} is not valid JSON ({e}): fix it.") from e
        if not isinstance(data, list):
            raise PromptDataError(f"{path}: a .json prompt file must hold a list of rows.")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise PromptDataError(
        f"{path}: unknown prompt file type {suffix!r}: use .jsonl, .json or .parquet."
    )


#: Files ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write at a folder's top.
_SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def _read_dataset_dir(path: Path) -> list[Any]:
    import datasets

    if not any((path / name).is_file() for name in _SAVED_DATASET_FILES):
        raise PromptDataError(
            f"train_files / validation.files: {path} is a folder but not one written by "
            f"datasets' save_to_disk (it has no {' / '.join(_SAVED_DATASET_FILES)}). Fix: "
            "list the prompt files inside it (.jsonl, .json or .parquet), e.g. "
            f"train_files: [{path}/train.jsonl]."
        )
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise PromptDataError(
                f"{path}: a DatasetDict without a 'train' split: point at one split's folder."
            )
        ds = ds["train"]
    return list(ds.to_list())


def read_rows(source: str | Path | Any) -> list[dict[str, Any]]:
    """Rows of a prompt file as dicts.

    ``source`` is a ``.jsonl``/``.json``/``.parquet`` file (UTF-8, a byte-order mark is
    accepted), a folder written by ``datasets.Dataset.save_to_disk``, a ``datasets.Dataset``,
    or a Hugging Face hub name (``"org/name"`` or ``"org/name:split"``, loaded with
    ``datasets.load_dataset``; needs network). What :func:`looks_like_local_path` calls a path
    is never looked up on the hub.

    Raises:
        FileNotFoundError: A path that does not exist.
        PromptDataError: A file that cannot be read as prompts (names the file and the fix).
    """
    if not isinstance(source, (str, Path)):
        if hasattr(source, "to_list"):
            return list(source.to_list())
        raise TypeError(f"cannot read prompts from a {type(source).__name__}.")
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path)
    if path.is_dir():
        return _read_dataset_dir(path)
    if isinstance(source, Path) or looks_like_local_path(str(source)):
        raise FileNotFoundError(
            f"no such file: prompt file {str(source)!r} does not exist (relative paths start "
            f"at {Path.cwd()}): check the path in train_files / validation.files."
        )
    import datasets

    name, _, split = str(source).partition(":")
    return list(datasets.load_dataset(name, split=split or "train").to_list())


def iter_rows(source: str | Path | Any) -> Iterable[dict[str, Any]]:
    """The rows of :func:`read_rows`, a JSONL file's read one line at a time."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.is_file() and path.suffix.lower() == ".jsonl":
            return _iter_jsonl(path)
    return read_rows(source)


def check_text(text: str, where: str, key: str) -> str:
    """``text`` if it can be written as UTF-8; a :class:`PromptDataError` naming ``where`` (the
    file and row) and the field otherwise: a lone UTF-16 surrogate (a JSON ``"\\ud83d"`` escape
    without its pair) is not text and would fail later, in hashing or tokenizing, unnamed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptDataError(
            f"{where}: field {key!r} holds the lone surrogate {text[e.start]!r} at character "
            f"{e.start} (half of a UTF-16 pair, e.g. a JSON \\ud83d escape without its "
            "partner), which is not text: fix the escape or remove the row."
        ) from None
    return text


def _clean_prompt(value: Any, where: str, key: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: field {key!r} is an empty prompt: remove the row.")
        return check_text(value, where, key)
    if isinstance(value, (list, tuple)) and value:
        msgs = []
        for j, m in enumerate(value):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise PromptDataError(
                    f"{where}: field {key!r} message {j} must be a dict with string 'role' and "
                    f"'content', got {m!r}."
                )
            field_j = f"{key} message {j}"
            role, content = check_text(m["role"], where, field_j), m["content"]
            msgs.append({"role": role, "content": check_text(content, where, field_j)})
        if not any(m["content"].strip() for m in msgs):
            raise PromptDataError(
                f"{where}: field {key!r} has only empty messages: remove the row."
            )
        return msgs
    raise PromptDataError(
        f"{where}: field {key!r} must be a non-empty string or a list of chat messages, got "
        f"{value!r}; fix the row or point prompts.prompt_key at the prompt field."
    )


def _clean_answer(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool):
        raise PromptDataError(
            f"{where}: field {key!r} is a bool ({value}): answers must be strings or numbers."
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PromptDataError(
                f"{where}: field {key!r} is {value} (how pandas and Parquet store a missing "
                "value): fill in the answer or drop the row."
            )
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: field {key!r} is an empty answer: remove the row.")
        return check_text(value.strip(), where, key)
    raise PromptDataError(
        f"{where}: field {key!r} must be a string or a number, got {type(value).__name__} "
        f"{value!r}; store the ground truth as a string (or point prompts.answer_key at it)."
    )


def records_from_rows(
    rows: Iterable[dict[str, Any]], fields: FieldMap = FieldMap(), name: str = "prompts"
) -> list[PromptRecord]:
    """Turn rows into records, checking each; errors name the row number (1-based) and field."""
    out = []
    for i, row in enumerate(rows):
        where = f"{name} row {i + 1}"
        if not isinstance(row, dict):
            raise PromptDataError(f"{where} is a {type(row).__name__}, not a dict of fields.")
        values = {}
        for attr in ("prompt_key", "answer_key"):
            key = getattr(fields, attr)
            try:
                values[attr] = get_field(row, key)
            except KeyError as e:
                raise PromptDataError(
                    f"{where}: missing field {key!r} (no {str(e)!r}; row keys: {sorted(row)}): "
                    f"set prompts.{attr} to the field that holds it (dotted paths reach nested fields)."
                ) from None
            if values[attr] is None:
                raise PromptDataError(f"{where}: field {key!r} is null: fill it or drop the row.")
        prompt = _clean_prompt(values["prompt_key"], where, fields.prompt_key)
        answer = _clean_answer(values["answer_key"], where, fields.answer_key)
        if fields.uid_key is not None:
            try:
                uid = check_text(str(get_field(row, fields.uid_key)), where, fields.uid_key)
            except KeyError:
                raise PromptDataError(
                    f"{where}: missing uid field {fields.uid_key!r}: set prompts.uid_key: null to derive "
                    "ids from the prompt text."
                ) from None
        else:
            uid = prompt_uid(prompt)
        source = None
        if fields.data_source_key is not None:
            try:
                source = get_field(row, fields.data_source_key)
            except KeyError:
                source = None
        meta = {k: v for k, v in row.items() if k in ROW_META_KEYS}
        out.append(
            PromptRecord(uid, prompt, answer, None if source is None else str(source), meta=meta)
        )
    return out


def deduplicate(records: Sequence[PromptRecord]) -> tuple[list[PromptRecord], int]:
    """Keep the first record of each prompt text; returns (records, number removed).

    Two copies of one prompt with different answers keep the first answer (a warning counts them).
    """
    seen: dict[str, PromptRecord] = {}
    conflicts = 0
    progress = StageProgress("removing duplicates", len(records), "prompts")
    for i, r in enumerate(records):
        if i % 65536 == 0:
            progress.update(i)
        key = prompt_text(r.prompt)
        if key in seen:
            conflicts += seen[key].answer != r.answer
            continue
        seen[key] = r
    if conflicts:
        log.warning("%d duplicate prompts had a different answer; kept the first.", conflicts)
    kept = list(seen.values())
    progress.finish(f"{len(kept):,} distinct")
    uids = [r.uid for r in kept]
    if len(set(uids)) != len(uids):
        raise PromptDataError(
            "distinct prompts share a uid: make prompts.uid_key unique per prompt or set it to null."
        )
    return kept, len(records) - len(kept)


def load_prompt_records(
    sources: str | Path | Sequence[str | Path] | Any,
    fields: FieldMap = FieldMap(),
    *,
    dedup: bool = True,
) -> list[PromptRecord]:
    """Read, check and (by default) de-duplicate the prompts of one or more files."""
    if isinstance(sources, (str, Path)) or not isinstance(sources, Sequence):
        sources = [sources]
    records: list[PromptRecord] = []
    for src in sources:
        name = str(src) if isinstance(src, (str, Path)) else type(src).__name__
        records.extend(records_from_rows(iter_rows(src), fields, name=name))
    if not records:
        raise PromptDataError(f"no prompts found in {[str(s) for s in sources]}.")
    if dedup:
        records, removed = deduplicate(records)
        if removed:
            log.info("removed %d duplicate prompts, %d left.", removed, len(records))
    return records


def split_train_val(
    records: Sequence[PromptRecord], val_fraction: float, seed: int = 0
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Hold out ``round(val_fraction * len)`` records (a seeded random choice) for validation
    (``val_fraction``: the setting ``data.validation.fraction``, named in the errors).

    Raises:
        PromptDataError: ``val_fraction`` outside [0, 1), or too few prompts to hold one out
            and keep one to train on (the fix named).
    """
    if not 0 <= val_fraction < 1:
        raise PromptDataError(f"data.validation.fraction must be in [0, 1), got {val_fraction}.")
    n_val = round(val_fraction * len(records))
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= len(records):
        raise PromptDataError(
            f"data.validation.fraction={val_fraction} holds out {n_val} of the {len(records)} "
            "training prompt(s) (counted after de-duplication), leaving none to train on. Fix: "
            "add prompts, give the held-out prompts in data.validation.files, or set "
            "data.validation.fraction: 0 (no validation)."
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val])
    train = [r for i, r in enumerate(records) if i not in val_idx]
    val = [r for i, r in enumerate(records) if i in val_idx]
    return train, val


#: Prompts tokenized in one batch call by :func:`tokenize_records`.
_ENCODE_BATCH = 1024


def tokenize_records(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    apply_chat_template: bool = True,
    max_prompt_length: int | None = None,
    overlong_prompts: Literal["error", "drop"] = "error",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[PromptRecord], int]:
    """Fill ``prompt_ids``; prompts over ``max_prompt_length`` tokens raise or are dropped
    (``tools``: JSON schemas the chat template renders, :func:`~dapo_lightning.prompts.encode_prompt`).

    Returns (records kept, number dropped).
    """
    if overlong_prompts not in ("error", "drop"):
        raise ValueError(f"overlong_prompts must be 'error' or 'drop', got {overlong_prompts!r}.")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(
            f"prompts.apply_chat_template is true but the tokenizer ({type(tokenizer).__name__}) has no chat "
            "template. Fix: set prompts.apply_chat_template: false to feed plain-text prompts as they are, "
            "or use a tokenizer that defines one (tokenizer.chat_template)."
        )
    kept, dropped = [], 0
    progress = StageProgress("tokenizing", len(records), "prompts")
    encoded: list[list[int]] = []
    for i, r in enumerate(records):
        if i % _ENCODE_BATCH == 0:  # one batch call per _ENCODE_BATCH prompts
            progress.update(i)
            batch = records[i : i + _ENCODE_BATCH]
            encoded = encode_prompts(
                tokenizer, [b.prompt for b in batch], apply_chat_template, tools
            )
        ids = encoded[i % _ENCODE_BATCH]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if overlong_prompts == "drop":
                dropped += 1
                continue
            raise PromptDataError(
                f"prompt {i + 1} (uid {r.uid}) has {len(ids)} tokens, more than "
                f"max_prompt_length={max_prompt_length}: raise prompts.max_prompt_length, or set "
                "prompts.overlong_prompts: drop to skip such prompts."
            )
        r.prompt_ids = ids
        kept.append(r)
    progress.finish(f"{len(kept):,} prompts")
    if dropped:
        log.warning(
            "dropped %d prompts longer than max_prompt_length=%s.", dropped, max_prompt_length
        )
    if not kept:
        raise PromptDataError(
            f"every prompt is longer than max_prompt_length={max_prompt_length}: raise it."
        )
    return kept, dropped
