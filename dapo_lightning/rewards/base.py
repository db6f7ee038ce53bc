"""The runner that scores a round of responses safely (the reward protocol:
:mod:`dapo_lightning.rewards.results`; where a reward runs: :mod:`dapo_lightning.rewards.workers`).

:class:`RewardRunner` calls the reward in worker processes (or, with ``in_process``, on a thread
of the training process) with a per-sample timeout (math-verify and user rewards can hang on
adversarial input), turns a sample that raises, times out or kills its worker into a *failure*
(``score = reward.failure_score``, ``acc = False``), and raises :class:`RewardFailureError` as soon
as more than ``max_failure_frac`` of a round has failed. A reward that returns the wrong number
of results or a non-finite score is a bug, not a failure: it raises :class:`RewardOutputError`
at once. A stop request (SIGTERM, SIGINT) raises
:class:`~dapo_lightning.interrupt.StopRequested` within ``STOP_POLL_S``, whatever the reward does.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from dapo_lightning.checks import ConfigError, check_finite
from dapo_lightning.interrupt import StopRequested, stop_requested
from dapo_lightning.rewards.results import (
    RewardFailureError,
    RewardFunction,
    RewardOutputError,
    RewardResult,
    check_reward_output,
    failure_result,
)
from dapo_lightning.rewards.workers import (
    WORKER_START_S,
    ProcessWorker,
    ThreadWorker,
    check_picklable,
    start_worker,
)

__all__ = [
    "ROUND_SLACK_S",
    "STOP_POLL_S",
    "STRIKES_BEFORE_FIRST_SCORE",
    "STRIKES_IN_A_ROW",
    "WORKER_START_S",
    "RewardFailureError",
    "RewardFunction",
    "RewardOutputError",
    "RewardResult",
    "RewardRunner",
    "check_picklable",
    "check_reward_output",
    "check_reward_settings",
    "chunk_limit_s",
    "failure_result",
    "round_budget_s",
]

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

Worker = ProcessWorker | ThreadWorker


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


def lost_job_line(runner: RewardRunner, size: int, limit_s: float, why: str) -> str:
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


class _Round:
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


class RewardRunner:
    """Scores rounds of responses with a reward function, with timeouts and failure accounting.

    Args:
        reward: A :class:`RewardFunction` (picklable when ``in_process`` is False).
        timeout_s: Most seconds one sample may take; a slower sample is killed and fails.
        num_workers: Worker processes (persistent; a worker that hangs is killed and replaced
            when there is work for it; its start is outside every sample's limit).
        max_failure_frac: Largest share of a round that may fail: the round stops as soon as
            more has failed (the rest counts as failed) and :class:`RewardFailureError` is
            raised; failures below it score ``reward.failure_score``.
        chunk_size: Most samples sent to a worker per call (its time limit:
            :func:`chunk_limit_s`); a chunk that fails or times out is retried one sample at a
            time, after the fresh chunks. A reward that hangs or kills its worker
            :data:`STRIKES_BEFORE_FIRST_SCORE` times per worker before its first score, or on
            :data:`STRIKES_IN_A_ROW` fresh jobs per worker in a row after it, fails the round
            at once (about ``2 * timeout_s`` plus a restart of the workers; the first such
            failure of a round prints one line). A round also has a wall budget
            (:func:`round_budget_s`).
            A stop request (SIGTERM) kills the workers and raises
            :class:`~dapo_lightning.interrupt.StopRequested` within ``STOP_POLL_S``.
        in_process: Call the reward on one thread of this process (no pickling; for trusted,
            fast rewards): same limits and stop checks, but a timed-out call is abandoned, not
            killed (see :mod:`dapo_lightning.rewards.workers`).
        mp_context: ``multiprocessing`` start method for the workers ("spawn" is safe with
            threads and torch.distributed in the parent).
    """

    def __init__(
        self,
        reward: Any,
        *,
        timeout_s: float = 10.0,
        num_workers: int = 1,
        max_failure_frac: float = 0.1,
        chunk_size: int = 16,
        in_process: bool = False,
        mp_context: str = "spawn",
    ) -> None:
        if not callable(reward):
            raise TypeError(f"reward must be callable, got {type(reward).__name__}.")
        check_reward_settings(timeout_s, num_workers, max_failure_frac)
        if not in_process:
            check_picklable(reward)
        self.reward = reward
        self.timeout_s = float(timeout_s)
        self.num_workers = 1 if in_process else num_workers
        self.max_failure_frac = max_failure_frac
        self.chunk_size = max(1, chunk_size)
        self.in_process = in_process
        self._start_method = mp_context
        self._workers: list[Worker] = []
        #: Seconds the last worker took to import the reward (part of the round budget).
        self.worker_start_s = 0.0
        #: Wall budget of the last round (:func:`round_budget_s`).
        self.last_round_budget_s = math.nan
        #: Failures of the last :meth:`score` call and of all calls.
        self.last_failures = 0
        self.total_failures = 0
        #: True once the reward returned a result (until then a call's limit is timeout_s).
        self.scored_once = False
        #: Slowest seconds per sample of a job that scored (:func:`chunk_limit_s`).
        self.pace_s: float | None = None
        self._strikes = 0  # timeouts and worker deaths since the last result (of fresh jobs)
        self._last_strike = ""

    # ------------------------------------------------------------------ public
    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extra_kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> list[RewardResult]:
        """Score one round: returns one result per response, failures included.

        ``extra_kwargs[i]`` (optional) are keyword arguments for sample i (e.g. data_source);
        they are passed as lists to the reward (``kw[key] = [value per sample]``).
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"{len(responses)} responses but {len(ground_truths)} ground truths to score."
            )
        n = len(responses)
        extra_kwargs = list(extra_kwargs) if extra_kwargs is not None else [{}] * n
        self.last_failures = 0
        if n == 0:
            return []
        results = self._score_round(list(responses), list(ground_truths), extra_kwargs)
        failures = sum(1 for r in results if "reward_failure" in r.extra)
        self.last_failures = failures
        self.total_failures += failures
        if failures > self.max_failure_frac * n:
            raise RewardFailureError(self._failure_message(results, failures))
        return results

    def close(self) -> None:
        """Stop the workers."""
        for w in self._workers:
            w.close()
        self._workers = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_workers"] = []
        return state

    # --------------------------------------------------------------- internals
    @staticmethod
    def _kw(extra_kwargs: list[dict[str, Any]], idx: list[int]) -> dict[str, list[Any]]:
        keys = set().union(*(extra_kwargs[i].keys() for i in idx)) if idx else set()
        return {k: [extra_kwargs[i].get(k) for i in idx] for k in keys}

    def _failure_message(self, results: list[RewardResult], failures: int) -> str:
        n = len(results)
        reasons = sorted(
            {str(r.extra["reward_failure"])[:200] for r in results if "reward_failure" in r.extra}
        )
        return (
            f"{failures} of {n} responses ({failures / n:.0%}) failed to score with "
            f"{type(self.reward).__name__}, more than data.scoring.max_failure_frac="
            f"{self.max_failure_frac}. First reasons: {reasons[:3]}. Fix the reward function, "
            f"raise data.scoring.timeout_s (now {self.timeout_s}) if it is slow, or raise "
            "data.scoring.max_failure_frac to tolerate more."
        )

    def _score_round(
        self, responses: list[str], gts: list[str], extra_kwargs: list[dict[str, Any]]
    ) -> list[RewardResult]:
        """Score in the pool until every sample has a result, the failed share passes
        ``max_failure_frac`` or the round's wall budget (:func:`round_budget_s`, counted from
        the first ready worker) is spent; a stop request raises within ``STOP_POLL_S``."""
        n = len(responses)
        size = max(1, min(self.chunk_size, math.ceil(n / self.num_workers)))  # all busy
        rnd = _Round(n, size)
        try:
            self._run_round(rnd, responses, gts, extra_kwargs)
        except StopRequested:
            self._kill_all()  # a hanging reward would hold the stop otherwise
            raise
        return [r for r in rnd.results if r is not None]

    def _run_round(
        self,
        rnd: _Round,
        responses: list[str],
        gts: list[str],
        extra_kwargs: list[dict[str, Any]],
    ) -> None:
        n = rnd.n
        while rnd.pending or any(w.job is not None for w in self._workers):
            self._raise_if_stopping()
            now = time.monotonic()
            if rnd.deadline is None and any(w.ready for w in self._workers):
                self.last_round_budget_s = self._budget(n)
                rnd.deadline = now + self.last_round_budget_s
            if rnd.deadline is not None and now > rnd.deadline:
                budget = f"{self.last_round_budget_s:.0f} s"
                self._give_up(rnd, f"timeout (the round's {budget} budget ran out)")
                break
            if rnd.pending:
                self._fill_pool()
            for w in self._workers:
                if w.ready and w.job is None and rnd.pending:
                    self._send(w, rnd, responses, gts, extra_kwargs)
            ready = wait([w.conn for w in self._workers], timeout=self._wait_s(rnd.deadline))
            self._collect(ready, rnd)
            self._check_verdicts(rnd)

    def _send(
        self,
        w: Worker,
        rnd: _Round,
        responses: list[str],
        gts: list[str],
        extra_kwargs: list[dict[str, Any]],
    ) -> None:
        """Give ``w`` the next job of the round, with its time limit."""
        idx = rnd.pending.popleft()
        msg = (rnd.jobs, [responses[i] for i in idx], [gts[i] for i in idx])
        w.conn.send((*msg, self._kw(extra_kwargs, idx)))
        limit = chunk_limit_s(self.timeout_s, len(idx), self.pace_s)
        w.job = (rnd.jobs, idx, time.monotonic(), limit)
        rnd.jobs += 1

    def _check_verdicts(self, rnd: _Round) -> None:
        """Stop the round once its failed share passes ``max_failure_frac``, or once a reward
        that never scored has used up its strikes."""
        if rnd.results.count(None) == 0:
            return
        if rnd.failures > self.max_failure_frac * rnd.n:
            self._give_up(
                rnd, f"not scored: scoring stopped after {rnd.failures} of {rnd.n} failed"
            )
        elif not self.scored_once and (
            self._strikes >= STRIKES_BEFORE_FIRST_SCORE * self.num_workers
        ):
            self._give_up(
                rnd,
                f"not scored: the reward has not scored one response and timed out or ended its "
                f"worker {self._strikes} times (the last: {self._last_strike})",
            )
        elif self._strikes >= STRIKES_IN_A_ROW * self.num_workers:
            self._give_up(
                rnd,
                f"not scored: the reward timed out or ended its worker on {self._strikes} fresh "
                f"jobs in a row since its last result (the last: {self._last_strike})",
            )

    def _give_up(self, rnd: _Round, reason: str) -> None:
        """Kill the busy workers, fail every unscored sample with ``reason``."""
        for w in [w for w in self._workers if w.job is not None]:
            w.kill()
            self._workers.remove(w)
        rnd.give_up(reason, self.reward)

    def _fill_pool(self) -> None:
        """Start workers up to ``num_workers`` (without waiting: a fresh worker's import time
        is outside every sample's limit)."""
        method = None if self.in_process else self._start_method
        while len(self._workers) < self.num_workers:
            self._workers.append(start_worker(self.reward, method))

    def _wait_s(self, deadline: float | None) -> float:
        now = time.monotonic()
        ends = [w.job[2] + w.job[3] for w in self._workers if w.job is not None]
        ends += [deadline] if deadline is not None else []
        return max(0.0, min([now + STOP_POLL_S, *ends]) - now)

    def _collect(self, ready: list[Any], rnd: _Round) -> None:
        """Take the messages of the ``ready`` workers; end the ones past their limit or dead."""
        for w in list(self._workers):
            now = time.monotonic()
            if w.conn in ready:
                self._receive(w, rnd, now)
            elif w.job is not None and now - w.job[2] > w.job[3]:
                self._lose(w, rnd, "timeout")
            elif not w.ready:
                w.check_started(now)

    def _receive(self, w: Worker, rnd: _Round, now: float) -> None:
        """One message of ``w``: ready, a job's results, a job's error, or the pipe's end."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                w.fail_start()
            self._lose(w, rnd, f"the reward's worker process ended while scoring ({w.died_how()})")
            return
        if msg == "ready":
            w.ready = True
            self.worker_start_s = now - w.started
            return
        _, status, payload = msg
        job, w.job = w.job, None
        idx = job[1] if job is not None else []
        if status == "ok":
            for i, r in zip(idx, check_reward_output(payload, len(idx), self.reward)):
                rnd.results[i] = r
            self.scored_once = True
            self._strikes = 0
            if job is not None and idx:
                self.pace_s = max(self.pace_s or 0.0, (now - job[2]) / len(idx))
        elif idx:
            last = (str(payload).strip().splitlines() or [""])[-1]  # the exception's line
            rnd.fail(idx, f"error: {last[-300:]}", self.reward)

    def _lose(self, w: Worker, rnd: _Round, reason: str) -> None:
        """``w`` timed out or died: kill it (a fresh one replaces it when there is work), fail
        or split its job; before the first score it is a strike."""
        job = w.job
        w.kill()
        self._workers.remove(w)
        if job is not None:
            if not self.scored_once or rnd.fresh(job[1]):
                self._strikes += 1
                self._last_strike = reason
            if not rnd.warned:  # one line per round: the wait for a restart can be long
                rnd.warned = True
                print(lost_job_line(self, len(job[1]), job[3], reason), file=sys.stderr, flush=True)
            rnd.fail(job[1], reason, self.reward)

    def _budget(self, n: int) -> float:
        return round_budget_s(self.timeout_s, n, self.num_workers, self.worker_start_s)

    def _raise_if_stopping(self) -> None:
        reason = stop_requested()
        if reason is not None:
            raise StopRequested(reason)

    def _kill_all(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []
