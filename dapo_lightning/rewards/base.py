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
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from dapo_lightning.interrupt import StopRequested, stop_requested
from dapo_lightning.rewards.results import (
    RewardFailureError,
    RewardFunction,
    RewardOutputError,
    RewardResult,
    check_reward_output,
    failure_result,
)
from dapo_lightning.rewards.rounds import (
    PACE_MARGIN,
    ROUND_SLACK_S,
    STOP_POLL_S,
    STRIKES_BEFORE_FIRST_SCORE,
    STRIKES_IN_A_ROW,
    ScoringRound,
    check_reward_settings,
    chunk_limit_s,
    dead_worker_line,
    ended_error,
    failure_message,
    job_kwargs,
    lost_job_line,
    round_budget_s,
)
from dapo_lightning.rewards.workers import (
    WORKER_START_S,
    ProcessWorker,
    ThreadWorker,
    check_picklable,
    start_worker,
)

__all__ = [
    "PACE_MARGIN",
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

Worker = ProcessWorker | ThreadWorker


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
            raise RewardFailureError(
                failure_message(self.reward, results, self.max_failure_frac, self.timeout_s)
            )
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
    def _score_round(
        self, responses: list[str], gts: list[str], extra_kwargs: list[dict[str, Any]]
    ) -> list[RewardResult]:
        """Score in the pool until every sample has a result, the failed share passes
        ``max_failure_frac`` or the round's wall budget (:func:`round_budget_s`, counted from
        the first ready worker) is spent; a stop request raises within ``STOP_POLL_S``."""
        n = len(responses)
        size = max(1, min(self.chunk_size, math.ceil(n / self.num_workers)))  # all busy
        rnd = ScoringRound(n, size)
        try:
            self._run_round(rnd, responses, gts, extra_kwargs)
        except StopRequested:
            self._kill_all()  # a hanging reward would hold the stop otherwise
            raise
        return [r for r in rnd.results if r is not None]

    def _run_round(
        self,
        rnd: ScoringRound,
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
                self._drop_dead_idle()
                self._fill_pool()
            for w in list(self._workers):
                if w.ready and w.job is None and rnd.pending:
                    self._send(w, rnd, responses, gts, extra_kwargs)
            ready = wait([w.conn for w in self._workers], timeout=self._wait_s(rnd.deadline))
            self._collect(ready, rnd)
            self._check_verdicts(rnd)

    def _send(
        self,
        w: Worker,
        rnd: ScoringRound,
        responses: list[str],
        gts: list[str],
        extra_kwargs: list[dict[str, Any]],
    ) -> None:
        """Give ``w`` the next job of the round, with its time limit."""
        idx = rnd.pending.popleft()
        msg = (rnd.jobs, [responses[i] for i in idx], [gts[i] for i in idx])
        try:
            w.conn.send((*msg, job_kwargs(extra_kwargs, idx)))
        except OSError:  # it died since the look (BrokenPipeError): a fresh worker takes the job
            rnd.pending.appendleft(idx)
            self._drop(w, "between two jobs")
            return
        limit = chunk_limit_s(self.timeout_s, len(idx), self.pace_s)
        w.job = (rnd.jobs, idx, time.monotonic(), limit)
        rnd.jobs += 1

    def _check_verdicts(self, rnd: ScoringRound) -> None:
        """Stop the round once its failed share passes ``max_failure_frac``, or once the
        reward has used up its strikes (:meth:`ScoringRound.verdict`)."""
        strikes = (self._strikes, self._last_strike)
        reason = rnd.verdict(self.max_failure_frac, self.scored_once, strikes, self.num_workers)
        if reason is not None:
            self._give_up(rnd, reason)

    def _give_up(self, rnd: ScoringRound, reason: str) -> None:
        """Kill the busy workers, fail every unscored sample with ``reason``."""
        for w in [w for w in self._workers if w.job is not None]:
            w.kill()
            self._workers.remove(w)
        rnd.give_up(reason, self.reward)

    def _drop_dead_idle(self) -> None:
        """Forget the idle workers that died between two jobs (the OOM killer's SIGKILL between
        rounds, say): fresh ones take their place (:meth:`_fill_pool`), as for a worker that
        dies during a job; nothing is failed or counted against the reward."""
        for w in [w for w in self._workers if w.ready and w.job is None and not w.alive()]:
            self._drop(w, "between rounds")

    def _drop(self, w: Worker, when: str) -> None:
        """Remove the dead idle worker ``w`` from the pool, with one line saying so."""
        how = w.died_how()
        w.kill()
        self._workers.remove(w)
        print(dead_worker_line(self.reward, when, how), file=sys.stderr, flush=True)

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

    def _collect(self, ready: list[Any], rnd: ScoringRound) -> None:
        """Take the messages of the ``ready`` workers; end the ones past their limit or dead."""
        for w in list(self._workers):
            now = time.monotonic()
            if w.conn in ready:
                self._receive(w, rnd, now)
            elif w.job is not None and now - w.job[2] > w.job[3]:
                self._lose(w, rnd, "timeout")
            elif not w.ready:
                w.check_started(now)

    def _receive(self, w: Worker, rnd: ScoringRound, now: float) -> None:
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
        if status == "ended":  # sys.exit / KeyboardInterrupt in the reward: a bug, said at once
            self._kill_all()
            raise ended_error(self.reward, payload)
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

    def _lose(self, w: Worker, rnd: ScoringRound, reason: str) -> None:
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
