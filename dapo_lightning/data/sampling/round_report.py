"""What the ranks tell each other during a rollout step, summed over ranks field by field.

The producer keeps ranks in lockstep: before its first round every rank reports its
:class:`Shortfall`, after every round its :class:`RoundReport`; ``summed(sync)`` sends the
fields as one list of integers through ``sync`` (a sum over ranks: one collective) and reads
the sums back by field. A full rank still reports (zeros), so no collective can hang.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import TypeVar

from dapo_lightning.interrupt import STOP_SIGNALS, request_stop

#: Sums a list of integers over ranks, element by element (``ranks.sum_over_ranks``).
SumOverRanks = Callable[[list[int]], list[int]]

#: Stop reasons the ranks agree on by name: the stop signals (a run guard exits 128 + number).
STOP_NAMES = tuple(s.name for s in STOP_SIGNALS)

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
        signalled: 1 if a stop signal's stop is requested here (summed: such ranks).
        signal_sum: That signal's number, else 0 (summed: their sum).
        signal_squares: Its square (summed: the sum of squares; the signalled ranks saw one
            signal exactly when ``signalled * signal_squares == signal_sum ** 2``, and then it
            is ``signal_sum / signalled``, the one every rank takes).
        other_stop: 1 if a stop for another reason is requested here.
    """

    short: int
    failed: int
    out_of_prompts: int
    missing: int
    kept: int
    generated: int
    signalled: int = 0
    signal_sum: int = 0
    signal_squares: int = 0
    other_stop: int = 0

    @classmethod
    def stop_fields(cls, reason: str | None) -> dict[str, int]:
        """The stop fields of a rank whose stop request is ``reason`` (None: none)."""
        signalled = reason in STOP_NAMES
        number = int(signal.Signals[reason]) if signalled else 0
        return {
            "signalled": int(signalled),
            "signal_sum": number,
            "signal_squares": number * number,
            "other_stop": int(reason is not None and not signalled),
        }

    @property
    def stopped(self) -> bool:
        """A stop was requested on some rank."""
        return bool(self.signalled or self.other_stop)

    def summed(self, sync: SumOverRanks) -> RoundReport:
        """Every field summed over ranks (one call of ``sync``)."""
        return _summed(self, sync)

    def agreed_stop(self, reason: str | None) -> str:
        """The stop every rank reports: this rank's own ``reason``, else a signal seen on
        another rank (recorded here too, so this rank exits as that one does)."""
        if reason is not None:
            return reason
        one_signal = self.signalled * self.signal_squares == self.signal_sum**2
        if self.signalled and one_signal:  # else the ranks saw different signals
            name = signal.Signals(self.signal_sum // self.signalled).name
            request_stop(name)
            return name
        return "a stop was requested on another rank"
