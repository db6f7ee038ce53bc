"""Progress lines while the prompts load: a large prompt file (hundreds of MB, millions of rows)
takes minutes to read and tokenize, and a run that says nothing meanwhile looks hung. A stage
that runs past :data:`FIRST_LINE_S` says how far it is every :data:`EVERY_S` seconds, and when
it is done; a quick one says nothing. Rank 0 only (every rank loads the same prompts).
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["EVERY_S", "FIRST_LINE_S", "StageProgress", "is_rank_zero"]

#: Seconds a stage runs before its first progress line.
FIRST_LINE_S = 5.0
#: Seconds between two progress lines of a stage.
EVERY_S = 10.0


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of the run (or the only one), by the launcher's
    environment (the prompts load before the Trainer says which rank is which)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0"


class StageProgress:
    """Lines such as ``prompts: reading data/train.jsonl: 42% (84 of 200 MB, 20 s)`` on stderr,
    the first after :data:`FIRST_LINE_S` seconds, then every :data:`EVERY_S`, and a last
    ``... done`` line when any was printed.

    Args:
        what: The stage (``reading data/train.jsonl``, ``tokenizing``).
        total: Its size, in ``unit`` (0: unknown).
        unit: ``"MB"`` (``done`` counted in bytes) or a noun (``"prompts"``).
    """

    def __init__(self, what: str, total: float, unit: str) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.start = time.monotonic()
        self.next_line = self.start + FIRST_LINE_S
        self.printed = False
        self.quiet = not is_rank_zero()

    def _amount(self, done: float) -> str:
        if self.unit == "MB":
            return f"{done / 1e6:,.0f} of {self.total / 1e6:,.0f} MB"
        return f"{done:,.0f} of {self.total:,.0f} {self.unit}"

    def update(self, done: float) -> None:
        """Say how far the stage is (``done`` of ``total``) when a line is due."""
        now = time.monotonic()
        if now < self.next_line or self.quiet:
            return
        self.next_line = now + EVERY_S
        share = f"{100 * done / self.total:.0f}% " if self.total else ""
        self._say(f"{share}({self._amount(done)}, {now - self.start:.0f} s)")

    def finish(self, summary: str = "") -> None:
        """``... done in N s`` (with ``summary``), when a progress line was printed."""
        if self.printed:
            extra = f": {summary}" if summary else ""
            self._say(f"done in {time.monotonic() - self.start:.0f} s{extra}")

    def _say(self, text: str) -> None:
        self.printed = True
        print(f"prompts: {self.what}: {text}", file=sys.stderr, flush=True)
