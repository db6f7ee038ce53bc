"""What the ranks tell each other during a rollout step, summed over ranks field by field.

The producer keeps ranks in lockstep: before its first round every rank reports its
:class:`Shortfall`, after every round its :class:`RoundReport`; ``summed(sync)`` sends the
fields as one list of integers through ``sync`` (a sum over ranks: one collective) and reads
the sums back by field. A full rank still reports (zeros), so no collective can hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import TypeVar

from dapo_lightning.interrupt import request_stop

#: Sums a list of integers over ranks, element by element (``ranks.sum_over_ranks``).
SumOverRanks = Callable[[list[int]], list[int]]

#: Stop reasons the ranks agree on by name (the signals a run guard turns into exit codes).
STOP_NAMES = ("SIGTERM", "SIGINT")

_Report = TypeVar("_Report", "Shortfall", "RoundReport")


def _summed(report: _Report, sync: SumOverRanks) -> _Report:
    return type(report)(*(int(v) for v in sync(list(astuple(report)))))


@dataclass(frozen=True)
class Shortfall:
    """Groups a rank still needs before a step's first round (summed: over all ranks).

    Args:
        missing: Groups missing for the batch.
        short: 1 if this rank is short (summed: the number of short ranks).
    """

    missing: int
    short: int

    def summed(self, sync: SumOverRanks) -> Shortfall:
        """Every field summed over ranks (one call of ``sync``)."""
        return _summed(self, sync)


@dataclass(frozen=True)
class RoundReport:
    """One rank's outcome of a generation round (summed: over all ranks).

    Args:
        short: 1 if the rank still lacks groups (summed: short ranks).
        failed: 1 if the round raised on this rank.
        out_of_prompts: 1 if no eligible prompt was left to draw.
        missing: Groups the rank still needs.
        kept: Groups the round kept (the round-sizing estimate).
        generated: Groups the round generated.
        sigterm: 1 if a SIGTERM stop is requested here.
        sigint: 1 if a SIGINT stop is requested here.
        other_stop: 1 if a stop for another reason is requested here.
    """

    short: int
    failed: int
    out_of_prompts: int
    missing: int
    kept: int
    generated: int
    sigterm: int = 0
    sigint: int = 0
    other_stop: int = 0

    @classmethod
    def stop_fields(cls, reason: str | None) -> dict[str, int]:
        """The stop fields of a rank whose stop request is ``reason`` (None: none)."""
        return {
            "sigterm": int(reason == "SIGTERM"),
            "sigint": int(reason == "SIGINT"),
            "other_stop": int(reason is not None and reason not in STOP_NAMES),
        }

    @property
    def stopped(self) -> bool:
        """A stop was requested on some rank."""
        return bool(self.sigterm or self.sigint or self.other_stop)

    def summed(self, sync: SumOverRanks) -> RoundReport:
        """Every field summed over ranks (one call of ``sync``)."""
        return _summed(self, sync)

    def agreed_stop(self, reason: str | None) -> str:
        """The stop every rank reports: this rank's own ``reason``, else a signal seen on
        another rank (recorded here too, so this rank exits as that one does)."""
        if reason is not None:
            return reason
        for name, seen in zip(STOP_NAMES, (self.sigterm, self.sigint)):
            if seen:
                request_stop(name)
                return name
        return "a stop was requested on another rank"
