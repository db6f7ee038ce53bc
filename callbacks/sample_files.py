"""The JSONL files of :class:`~dapo_lightning.callbacks.sample_log.SampleLog`: appended a step at
a time, cut back on resume, and never worth a lost run (a write that fails warns once and the
file is given up for the rest of the fit)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

log = logging.getLogger(__name__)

#: One encoder for every line (no circular-reference check: a row is flat data).
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False)


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a sample file (a torn last line, from a killed writer, skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class SampleFile:
    """One JSONL file of sample rows.

    Args:
        path: The file (its folder is made on the first write).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        #: Set by the first failed write: nothing more is written.
        self.failed = False

    def append(self, rows: Sequence[Row]) -> None:
        """Append ``rows``, one JSON object a line, flushed (a failure warns once)."""
        if self.failed or not rows:
            return
        text = "".join(_ENCODER.encode(r) + "\n" for r in rows)
        self._guarded(lambda: self._write(text, "a"))

    def keep_only(self, keep: Callable[[Row], bool]) -> list[Row]:
        """Rewrite the file with the rows ``keep`` accepts (atomically: a temporary file
        renamed over it); returns them. No file: nothing to do."""
        if self.failed or not self.path.exists():
            return []
        kept: list[Row] = []

        def rewrite() -> None:
            kept.extend(r for r in read_rows(self.path) if keep(r))
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(_ENCODER.encode(r) + "\n" for r in kept))
            os.replace(tmp, self.path)

        self._guarded(rewrite)
        return kept

    def _write(self, text: str, mode: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(text)
            f.flush()

    def _guarded(self, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as e:
            self.failed = True
            log.warning(
                "SampleLog: cannot write %s (%s); training goes on without this sample file. "
                "Fix: a writable, not full SampleLog dir.",
                self.path,
                e.strerror or e,
            )
