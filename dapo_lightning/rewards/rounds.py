"""One scoring round of the :class:`~dapo_lightning.rewards.base.RewardRunner`: its settings'
checks, its limits (the per-job limit, the round's wall budget, the strikes that stop a reward
that hangs or ends its workers), its state (:class:`ScoringRound`) and the line said when a job
is lost."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dapo_lightning.checks import ConfigError, check_finite
from dapo_lightning.rewards.results import (
    REWARD_FIELD,
    RewardOutputError,
    RewardResult,
    failure_result,
)

#: Seconds a round's wall budget allows beyond ``timeout_s * ceil(samples / workers)``, plus
#: twice the time the last worker took to start (respawns after a kill fit in it).
ROUND_SLACK_S = 5.0
#: Longest wait between two looks at a stop request (SIGTERM) while scoring.
STOP_POLL_S = 0.25
#: Timeouts or worker deaths per worker after which a reward that has not scored one sample
#: yet is taken to fail on every input: the round stops (about 2 x timeout_s, not one timeout
#: per sample).
STRIKES_BEFORE_FIRST_SCORE = 2
#: The same count, per worker, once the reward has scored: timeouts or worker deaths *in a row*
#: (no result in between) of fresh jobs (samples not yet in a failed job; a failed chunk's
#: samples are retried one by one after every fresh job) stop the round: a reward that starts
#: hanging mid-run fails in about 2 x timeout_s plus one restart of the workers, not after the
#: round's budget. Failures of retried samples count one by one against ``max_failure_frac``
#: (one group of adversarial responses never stops a round).
STRIKES_IN_A_ROW = STRIKES_BEFORE_FIRST_SCORE
#: A chunk's limit once the reward has scored (:func:`chunk_limit_s`): ``timeout_s`` plus this
#: many times the chunk's expected time at the slowest pace seen.
PACE_MARGIN = 3.0


def check_reward_settings(timeout_s: float, num_workers: int, max_failure_frac: float) -> None:
    """Raise a ValueError naming the setting (``reward_timeout_s``, ``reward_workers``,
    ``max_reward_failure_frac``) that is out of range or not finite."""
    check_finite("reward_timeout_s", timeout_s, "Give the seconds one response may take (> 0).")
    if not timeout_s > 0:
        raise ConfigError(f"reward_timeout_s must be > 0 seconds, got {timeout_s}.")
    if isinstance(num_workers, bool) or not num_workers >= 1:
        raise ConfigError(f"reward_workers must be >= 1 worker processes, got {num_workers}.")
    check_finite("max_reward_failure_frac", max_failure_frac, "Give a share in [0, 1].")
    if not 0 <= max_failure_frac <= 1:
        raise ConfigError(f"max_reward_failure_frac must be in [0, 1], got {max_failure_frac}.")


def round_budget_s(
    timeout_s: float, num_samples: int, num_workers: int, start_s: float = 0.0
) -> float:
    """Wall seconds one round of ``num_samples`` may take with ``num_workers`` workers whose
    start took ``start_s``: ``timeout_s * ceil(num_samples / num_workers) + ROUND_SLACK_S +
    2 * start_s`` (every worker busy with its share at the per-sample limit, plus room for
    respawning killed workers)."""
    share = math.ceil(num_samples / max(1, num_workers))
    return timeout_s * share + ROUND_SLACK_S + 2.0 * start_s


def chunk_limit_s(timeout_s: float, size: int, pace_s: float | None) -> float:
    """Seconds a job of ``size`` samples may take: ``timeout_s`` before the reward has scored
    (``pace_s`` None), then ``timeout_s + PACE_MARGIN * size * pace_s`` (``pace_s``: the
    slowest seconds per sample of a job that scored), at most ``size * timeout_s``.

    A chunk past its limit is retried one sample at a time (each with ``timeout_s``), so a
    tight chunk limit never fails a sample that is within its own; it bounds how long a hang
    goes unnoticed (a fast reward's chunk of 16 waited ``16 x timeout_s`` for a hang).
    """
    if pace_s is None:
        return timeout_s
    return min(size * timeout_s, timeout_s + PACE_MARGIN * size * pace_s)


def lost_job_line(runner: Any, size: int, limit_s: float, why: str) -> str:
    """The line said at a round's first lost job (``size`` responses, ``limit_s``, ``why``:
    ``"timeout"`` or how the worker ended): what happened and what comes next."""
    what = "timed out" if why == "timeout" else "failed"
    restart = "abandoning its thread" if runner.in_process else "restarting its worker"
    return (
        f"scoring: reward {type(runner.reward).__name__} {what} on {size} response(s) ({why}; "
        f"limit {limit_s:.0f} s, data.scoring.timeout_s={runner.timeout_s:g}); {restart} and "
        f"retrying; the round fails after {STRIKES_IN_A_ROW * runner.num_workers} such "
        "failures in a row."
    )


def job_kwargs(extra_kwargs: list[dict[str, Any]], idx: list[int]) -> dict[str, list[Any]]:
    """The keyword arguments of the job of samples ``idx``: each key's values as a list, one
    per sample (None where a sample lacks it)."""
    keys = set().union(*(extra_kwargs[i].keys() for i in idx)) if idx else set()
    return {k: [extra_kwargs[i].get(k) for i in idx] for k in keys}


def failure_message(
    reward: Any, results: list[RewardResult], max_failure_frac: float, timeout_s: float
) -> str:
    """The :class:`RewardFailureError` message of a round whose failed share of ``results``
    passed ``max_failure_frac``: how many failed, the first reasons, the settings to change."""
    n = len(results)
    failed = [r for r in results if "reward_failure" in r.extra]
    reasons = sorted({str(r.extra["reward_failure"])[:200] for r in failed})
    return (
        f"{len(failed)} of {n} responses ({len(failed) / n:.0%}) failed to score with "
        f"{type(reward).__name__}, more than data.scoring.max_failure_frac="
        f"{max_failure_frac}. First reasons: {reasons[:3]}. Fix the reward function, "
        f"raise data.scoring.timeout_s (now {timeout_s}) if it is slow, or raise "
        "data.scoring.max_failure_frac to tolerate more."
    )


def ended_error(reward: Any, how: str) -> RewardOutputError:
    """The error for a reward that ended its own scoring (``how``: ``"called sys.exit(3)"``,
    ``"raised KeyboardInterrupt"``): a bug of the reward, said at once (not a timeout)."""
    return RewardOutputError(
        f"{REWARD_FIELD}: reward {type(reward).__name__} {how} while scoring (not a timeout: "
        "it ended its scoring itself). Fix the reward: return a RewardResult for every "
        "response (its failure_score for one it cannot judge) or raise an exception (that "
        "response then fails alone); never exit."
    )


def dead_worker_line(reward: Any, when: str, how: str) -> str:
    """The line said when an idle worker is found dead (``when``: ``"between rounds"``;
    ``how``: its exit code or signal) and a fresh one takes its place."""
    return (
        f"scoring: a reward worker for {type(reward).__name__} ended {when} ({how}); starting "
        "a fresh one."
    )


class ScoringRound:
    """One round's state: results so far, the jobs left, failures, the wall deadline."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.results: list[RewardResult | None] = [None] * n
        self.pending: deque[list[int]] = deque(
            list(range(s, min(n, s + size))) for s in range(0, n, size)
        )
        self.failures = 0
        self.jobs = 0
        self.deadline: float | None = None
        self.retried: set[int] = set()  # samples of a failed job (retried one by one)
        self.warned = False  # the line about a timeout was printed

    def fresh(self, idx: list[int]) -> bool:
        """True when no sample of ``idx`` was in a failed job before."""
        return self.retried.isdisjoint(idx)

    def fail(self, idx: list[int], reason: str, reward: Any) -> None:
        """A job failed: a single sample fails, a chunk is retried one sample at a time after
        the fresh jobs (one bad sample never fails its neighbours; fresh jobs first tell a
        reward that hangs on everything from one bad group)."""
        if len(idx) > 1:
            self.retried.update(idx)
            self.pending.extend([i] for i in idx)
        else:
            self.results[idx[0]] = failure_result(reward, reason)
            self.failures += 1

    def give_up(self, reason: str, reward: Any) -> None:
        """Fail every unscored sample with ``reason``."""
        self.pending.clear()
        for i, r in enumerate(self.results):
            if r is None:
                self.results[i] = failure_result(reward, reason)
                self.failures += 1

    def verdict(
        self,
        max_failure_frac: float,
        scored_once: bool,
        strikes: tuple[int, str],
        num_workers: int,
    ) -> str | None:
        """Why the round stops now (its failed share passed ``max_failure_frac``, or the
        reward used up its ``strikes``: the count and the last one, before its first score
        or in a row after it), or None to go on."""
        count, last = strikes
        if self.results.count(None) == 0:
            return None
        if self.failures > max_failure_frac * self.n:
            return f"not scored: scoring stopped after {self.failures} of {self.n} failed"
        if not scored_once and count >= STRIKES_BEFORE_FIRST_SCORE * num_workers:
            return (
                f"not scored: the reward has not scored one response and timed out or ended "
                f"its worker {count} times (the last: {last})"
            )
        if count >= STRIKES_IN_A_ROW * num_workers:
            return (
                f"not scored: the reward timed out or ended its worker on {count} fresh jobs "
                f"in a row since its last result (the last: {last})"
            )
        return None
