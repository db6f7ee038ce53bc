"""The reward protocol and the runner that scores a round of responses safely.

A reward function is a batch call::

    reward(responses: list[str], ground_truths: list[str], **kw) -> list[RewardResult]

:class:`RewardRunner` calls it in worker processes with a per-sample timeout (math-verify and
user rewards can hang on adversarial input), turns a sample that raises or times out into a
*failure* (``score = reward.failure_score``, ``acc = False``), counts failures, and raises
:class:`RewardFailureError` when more than ``max_failure_frac`` of a round fails. A reward that
returns the wrong number of results or a non-finite score is a bug, not a failure: it raises
:class:`RewardOutputError` at once.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import pickle
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, runtime_checkable

from dapo_lightning.checks import ConfigError, check_finite
from dapo_lightning.interrupt import StopRequested, stop_requested


@dataclass
class RewardResult:
    """The reward of one response.

    Args:
        score: The raw reward (the DAPO rule: +1 correct, -1 wrong).
        acc: True when the answer is correct (what the dynamic-sampling filter uses by default).
        extra: Free-form information; always has ``has_answer`` (a parseable answer was found).
    """

    score: float
    acc: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.extra.setdefault("has_answer", False)


@runtime_checkable
class RewardFunction(Protocol):
    """What a reward is: a picklable batch callable (it runs in worker processes)."""

    #: Score given to a sample whose scoring raised or timed out.
    failure_score: float

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]: ...


class RewardFailureError(RuntimeError):
    """Too many samples of one round failed to score."""


class RewardOutputError(ValueError):
    """The reward function returned something that is not a valid reward list."""


def check_reward_output(results: Any, expected: int, reward: Any) -> list[RewardResult]:
    """Validate a reward's output: a list of ``expected`` RewardResults with finite scores."""
    name = type(reward).__name__
    if not isinstance(results, (list, tuple)) or len(results) != expected:
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise RewardOutputError(
            f"reward {name} returned {got} results for {expected} responses: a reward must "
            "return one RewardResult per response, in order."
        )
    for i, r in enumerate(results):
        if not isinstance(r, RewardResult):
            raise RewardOutputError(
                f"reward {name} returned a {type(r).__name__} at position {i}: return "
                "RewardResult(score=..., acc=..., extra={...})."
            )
        score = _as_float(r.score)
        if score is None:
            raise RewardOutputError(
                f"reward {name} returned RewardResult(score={r.score!r}) at position {i}: the "
                f"field score must be a number (a {type(r.score).__name__} is not); return "
                "a float, e.g. 1.0 for a right answer and -1.0 for a wrong one."
            )
        if not math.isfinite(score):
            raise RewardOutputError(
                f"reward {name} returned score={r.score} at position {i}: scores must be finite "
                "floats (a NaN or inf reward would poison the advantages)."
            )
        if isinstance(r.acc, (str, bytes)) or r.acc not in (True, False):
            raise RewardOutputError(
                f"reward {name} returned RewardResult(acc={r.acc!r}) at position {i}: the field "
                "acc must be True or False (is the answer right?)."
            )
    return list(results)


def _as_float(value: Any) -> float | None:
    """``float(value)`` for a number (Python, NumPy or a one-element tensor); None otherwise."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


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


def failure_result(reward: Any, reason: str) -> RewardResult:
    """The result of a sample whose scoring failed (``reason``: "timeout" or the error text)."""
    return RewardResult(
        score=float(getattr(reward, "failure_score", -1.0)),
        acc=False,
        extra={"has_answer": False, "reward_failure": reason},
    )


def _worker_main(conn: Connection, reward: Any) -> None:  # pragma: no cover - runs in a child
    """Worker loop: receive ``(job_id, responses, ground_truths, kw)``, send results back."""
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        job_id, responses, gts, kw = msg
        try:
            out = reward(responses, gts, **kw)
            conn.send((job_id, "ok", out))
        except Exception:  # noqa: BLE001 - reported to the parent as a failure
            conn.send((job_id, "error", traceback.format_exc(limit=3)))


#: Most seconds a fresh worker may take to import the reward before the run fails.
WORKER_START_S = 120.0
#: Seconds a round's wall budget allows beyond ``timeout_s * ceil(samples / workers)``, plus
#: twice the time the last worker took to start (respawns after a kill fit in it).
ROUND_SLACK_S = 5.0
#: Longest wait between two looks at a stop request (SIGTERM) while scoring.
STOP_POLL_S = 0.25


class _Worker:
    """One worker process; started without waiting: it is ``ready`` once its first message
    (sent after it imported the reward) arrives."""

    def __init__(self, ctx: Any, reward: Any) -> None:
        self.reward_name = type(reward).__name__
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, reward), daemon=True)
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.job: tuple[int, list[int], float, float] | None = None  # id, samples, start, limit

    def check_started(self, now: float) -> None:
        """Raise when the worker died or has not imported the reward within WORKER_START_S."""
        if not self.ready and (now - self.started > WORKER_START_S or not self.proc.is_alive()):
            died = not self.proc.is_alive()
            self.kill()
            raise RuntimeError(
                f"reward worker for {self.reward_name} exited before it started (its error is "
                "above): when it says the script re-ran its top level, put the training code "
                'under `if __name__ == "__main__":`; else check that the reward is picklable '
                "and importable in a fresh process, or set data.scoring.in_process: true."
                if died
                else f"reward worker for {self.reward_name} did not start within "
                f"{WORKER_START_S:.0f} s: check that the reward is picklable and importable in "
                "a fresh process, or set data.scoring.in_process: true."
            )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def round_budget_s(
    timeout_s: float, num_samples: int, num_workers: int, start_s: float = 0.0
) -> float:
    """Wall seconds one round of ``num_samples`` may take with ``num_workers`` workers whose
    start took ``start_s``: ``timeout_s * ceil(num_samples / num_workers) + ROUND_SLACK_S +
    2 * start_s`` (every worker busy with its share at the per-sample limit, plus room for
    respawning killed workers)."""
    share = math.ceil(num_samples / max(1, num_workers))
    return timeout_s * share + ROUND_SLACK_S + 2.0 * start_s


def check_picklable(reward: Any) -> None:
    """Raise :class:`ConfigError` naming the reward and the fix when it cannot be sent to a
    worker process (the ``spawn`` start method pickles it)."""
    try:
        pickle.dumps(reward)
    except Exception as err:  # noqa: BLE001 - TypeError, PicklingError, AttributeError, ...
        raise ConfigError(
            f"reward {type(reward).__name__} cannot be sent to a reward worker process "
            f"(pickling it failed: {err}). Fix: set data.scoring.in_process: true to score in "
            "the training process (no timeout), or make the reward picklable (no locks, open "
            "files or lambdas among its attributes; a module-level class)."
        ) from err


class RewardRunner:
    """Scores rounds of responses with a reward function, with timeouts and failure accounting.

    Args:
        reward: A :class:`RewardFunction` (picklable when ``in_process`` is False).
        timeout_s: Most seconds one sample may take; a slower sample is killed and fails.
        num_workers: Worker processes (persistent; a worker that hangs is killed and replaced
            when there is work for it; its start is outside every sample's limit).
        max_failure_frac: Largest share of a round that may fail before the run stops with
            :class:`RewardFailureError` (failures below it score ``reward.failure_score``).
        chunk_size: Most samples sent to a worker per call (its time limit is ``timeout_s`` per
            sample; a round is split so that every worker gets a share); a chunk that fails or
            times out is retried one sample at a time, so one bad sample never fails its
            neighbours. A round has a wall budget (:func:`round_budget_s`): what is unscored
            when it runs out fails as a timeout, so a reward that hangs on every sample fails
            the round within about ``timeout_s * ceil(samples / num_workers)`` seconds.
            A stop request (SIGTERM) kills the workers and raises
            :class:`~dapo_lightning.interrupt.StopRequested` within ``STOP_POLL_S``.
        in_process: Call the reward in this process, without timeouts or stop checks
            (exceptions still count as failures). For trusted, fast rewards and debugging only.
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
        self.num_workers = num_workers
        self.max_failure_frac = max_failure_frac
        self.chunk_size = max(1, chunk_size)
        self.in_process = in_process
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []
        #: Seconds the last worker took to import the reward (part of the round budget).
        self.worker_start_s = 0.0
        #: Wall budget of the last round scored in workers (:func:`round_budget_s`).
        self.last_round_budget_s = math.nan
        #: Failures of the last :meth:`score` call and of all calls.
        self.last_failures = 0
        self.total_failures = 0

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
        if n == 0:
            self.last_failures = 0
            return []
        if self.in_process:
            results = self._score_in_process(list(responses), list(ground_truths), extra_kwargs)
        else:
            results = self._score_in_workers(list(responses), list(ground_truths), extra_kwargs)
        failures = sum(1 for r in results if "reward_failure" in r.extra)
        self.last_failures = failures
        self.total_failures += failures
        if failures > self.max_failure_frac * n:
            reasons = sorted(
                {
                    str(r.extra["reward_failure"])[:200]
                    for r in results
                    if "reward_failure" in r.extra
                }
            )
            raise RewardFailureError(
                f"{failures} of {n} responses ({failures / n:.0%}) failed to score with "
                f"{type(self.reward).__name__}, more than data.scoring.max_failure_frac="
                f"{self.max_failure_frac}. First reasons: {reasons[:3]}. Fix the reward function, "
                f"raise data.scoring.timeout_s (now {self.timeout_s}) if it is slow, or raise "
                "data.scoring.max_failure_frac to tolerate more."
            )
        return results

    def close(self) -> None:
        """Stop the worker processes."""
        for w in self._workers:
            with contextlib.suppress(OSError):  # the worker may already be gone
                w.conn.send(None)
            w.proc.join(2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2)
            w.conn.close()
        self._workers = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_workers"] = []
        state["_ctx"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ctx = mp.get_context("spawn")

    # --------------------------------------------------------------- internals
    @staticmethod
    def _kw(extra_kwargs: list[dict[str, Any]], idx: list[int]) -> dict[str, list[Any]]:
        keys = set().union(*(extra_kwargs[i].keys() for i in idx)) if idx else set()
        return {k: [extra_kwargs[i].get(k) for i in idx] for k in keys}

    def _score_in_process(
        self, responses: list[str], gts: list[str], extra_kwargs: list[dict[str, Any]]
    ) -> list[RewardResult]:
        idx = list(range(len(responses)))
        try:
            out = self.reward(responses, gts, **self._kw(extra_kwargs, idx))
        except Exception:  # noqa: BLE001 - retried one by one below
            out = None
        if out is not None:
            return check_reward_output(out, len(responses), self.reward)
        results = []
        for i in idx:
            try:
                one = self.reward([responses[i]], [gts[i]], **self._kw(extra_kwargs, [i]))
            except Exception as e:  # noqa: BLE001 - a failing sample is a counted failure
                results.append(failure_result(self.reward, f"error: {type(e).__name__}: {e}"))
                continue
            results.extend(check_reward_output(one, 1, self.reward))
        return results

    def _score_in_workers(
        self, responses: list[str], gts: list[str], extra_kwargs: list[dict[str, Any]]
    ) -> list[RewardResult]:
        """Score in the worker pool within the round's wall budget (:func:`round_budget_s`,
        counted from the first ready worker); a stop request (SIGTERM) kills the workers and
        raises :class:`~dapo_lightning.interrupt.StopRequested` within ``STOP_POLL_S``."""
        n = len(responses)
        results: list[RewardResult | None] = [None] * n
        size = max(1, min(self.chunk_size, math.ceil(n / self.num_workers)))  # every worker busy
        pending: deque[list[int]] = deque(
            list(range(s, min(n, s + size))) for s in range(0, n, size)
        )
        deadline: float | None = None
        jobs = 0
        while pending or any(w.job is not None for w in self._workers):
            self._raise_if_stopping()
            now = time.monotonic()
            if deadline is None and any(w.ready for w in self._workers):
                self.last_round_budget_s = self._budget(n)
                deadline = now + self.last_round_budget_s
            if deadline is not None and now > deadline:
                self._over_budget(results, pending, n)
                break
            if pending:
                self._fill_pool()
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    idx = pending.popleft()
                    msg = (jobs, [responses[i] for i in idx], [gts[i] for i in idx])
                    w.conn.send((*msg, self._kw(extra_kwargs, idx)))
                    w.job = (jobs, idx, time.monotonic(), self.timeout_s * len(idx))
                    jobs += 1
            ready = wait([w.conn for w in self._workers], timeout=self._wait_s(deadline))
            self._collect(ready, results, pending)
        return [r for r in results if r is not None]

    def _fill_pool(self) -> None:
        """Drop dead workers and start new ones up to ``num_workers`` (without waiting: a fresh
        worker's import time is outside every sample's limit); a worker that died before it
        started fails the run (:meth:`_Worker.check_started`), it is not replaced."""
        for w in [w for w in self._workers if not w.proc.is_alive() and w.job is None]:
            self._drop(w)
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.reward))

    def _drop(self, w: _Worker) -> None:
        """Remove a dead worker from the pool; one that died before it started fails the run
        instead, naming the fix (:meth:`_Worker.check_started`)."""
        if not w.ready:
            w.proc.join(5)  # its pipe can close before is_alive turns False
        w.check_started(time.monotonic())
        w.kill()
        self._workers.remove(w)

    def _wait_s(self, deadline: float | None) -> float:
        now = time.monotonic()
        ends = [w.job[2] + w.job[3] for w in self._workers if w.job is not None]
        ends += [deadline] if deadline is not None else []
        return max(0.0, min([now + STOP_POLL_S, *ends]) - now)

    def _collect(
        self, ready: list[Any], results: list[RewardResult | None], pending: deque[list[int]]
    ) -> None:
        """Take the messages of the ``ready`` workers; kill the ones past their limit."""
        for w in list(self._workers):
            now = time.monotonic()
            if w.conn in ready:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = (None, "error", "worker process died")
                    self._drop(w)
                if msg == "ready":
                    w.ready = True
                    self.worker_start_s = now - w.started
                    continue
                _, status, payload = msg
                idx, w.job = w.job[1] if w.job is not None else [], None
                if status == "ok":
                    for i, r in zip(idx, check_reward_output(payload, len(idx), self.reward)):
                        results[i] = r
                elif idx:
                    self._fail_or_split(
                        idx, f"error: {str(payload).strip()[-300:]}", results, pending
                    )
            elif w.job is not None and now - w.job[2] > w.job[3]:
                w.kill()
                self._workers.remove(w)
                self._fail_or_split(w.job[1], "timeout", results, pending)
            elif w.job is None:
                w.check_started(now)

    def _over_budget(
        self, results: list[RewardResult | None], pending: deque[list[int]], n: int
    ) -> None:
        """The round's wall budget is spent: kill the busy workers, fail what is unscored."""
        for w in [w for w in self._workers if w.job is not None]:
            w.kill()
            self._workers.remove(w)
        pending.clear()
        reason = f"timeout (the round's {self.last_round_budget_s:.0f} s budget ran out)"
        for i, r in enumerate(results):
            if r is None:
                results[i] = failure_result(self.reward, reason)

    def _budget(self, n: int) -> float:
        return round_budget_s(self.timeout_s, n, self.num_workers, self.worker_start_s)

    def _raise_if_stopping(self) -> None:
        reason = stop_requested()
        if reason is not None:
            for w in self._workers:
                w.kill()  # a hanging reward would hold the stop otherwise
            self._workers = []
            raise StopRequested(reason)

    def _fail_or_split(
        self,
        idx: list[int],
        reason: str,
        results: list[RewardResult | None],
        pending: deque[list[int]],
    ) -> None:
        if len(idx) > 1:
            pending.extend([i] for i in idx)
        else:
            results[idx[0]] = failure_result(self.reward, reason)
