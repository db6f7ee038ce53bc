"""How many samples dynamic sampling generates per group it keeps: uniform draws vs predictive
selection, right-sized rounds and in-flight refill (issue #27).

``--simulated`` (no model, seconds): the REAL :class:`~dapo_lightning.data.sampling.producer.RolloutProducer`
(sampler, difficulty tracker, predictive selector, round sizing, streaming round, carry-over,
filter, lockstep flags) with a real :class:`~dapo_lightning.rewards.base.RewardRunner`, driven by a
simulated engine in the one place a model would be: :class:`SimulatedEngine` answers prompt ``i``
correctly with probability ``p_i(t)``, a fixed per-prompt pass-rate distribution taken from the
SmolLM2 recipe's logs (benchmarks/RESULTS.md: about 80% of its groups had zero variance, almost
all all-wrong) that drifts as training "learns":

* 60% hopeless (``p0 ~ U(0, 0.01)``), 20% solved (``U(0.97, 1)``), 20% mixed (``U(0.1, 0.9)``);
* every rollout step ``logit p_i += d_i``, ``d_i ~ U(0, 0.02)`` (200 steps move a hopeless prompt
  from ``p = 0.005`` up to at most ``p = 0.2``: some prompts change class during a run).

Sample lengths are drawn per sample (1-32 tokens); the engine runs ``slots`` samples at a time
and, in its streaming form (``stream_groups``, what the vLLM engine offers), finishes groups in
the order their samples end; sent ``DRAIN`` (the batch is full) it drops the groups not started
and finishes the started ones, and closed early it aborts the rest, so an aborted request costs
the tokens it had generated. "Samples" below count a finished sample as 1 and an aborted one
as its generated share of its length.

The recipe's batch shape: 256 prompts, ``n = 8``, ``train_batch_size = 8``, ``gen_batch_size =
16``, ``selection.retire_after = 3``, ``max_num_gen_batches = 10``; 200 rollout steps per configuration:

* samples per kept group (in units of ``n``): all samples generated / groups that reached a batch;
* rounds per step (median), zero-variance share of the generated groups;
* starved prompts: prompts eligible at the end (not retired) whose longest gap between visits
  (or from the last visit to the end) exceeds ``selection.revisit_within`` epochs; the largest gap;
* changed prompts found after: for the prompts the drift made learnable (true
  ``p^n + (1 - p)^n`` falling to 1/2 or below, :func:`found_after`), the rollout steps until
  their next visit (mean / max; those not visited again by the end count to the end): what
  fewer revisits cost;
* where the samples beyond the batch's own went (second table, :data:`CAUSES`): zero-variance
  groups of first visits, of revisits the no-starvation floor forced (due after
  ``revisit_within`` epochs, or the ``1 - max_skip`` draw), of prompts predicted to vary;
  aborted partial samples; kept groups dropped as surplus or still carried at the end;
* kept acc - p: mean over kept groups of (the group's accuracy - the prompt's true pass rate)
  (the former ``adaptive_n``, which subsampled larger groups to a variance-keeping mix, was
  measured here at +0.033 against uniform's +0.023 with 5.8 n samples per kept group against
  4.3 n, and removed: benchmarks/RESULTS.md).

Prints the two tables, writes ``benchmarks/out/sampling_efficiency.png`` and ends with the line
``samples per kept group: uniform X.X n, all parts Y.Y n``.

Usage::

    .venv/bin/python -m benchmarks.sampling_efficiency --simulated          # ~40 s
    .venv/bin/python -m benchmarks.sampling_efficiency --simulated --steps 600 --seed 1
    .venv/bin/python -m benchmarks.sampling_efficiency --simulated --quick  # smoke test
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import bar_chart, out_dir, print_table
from dapo_lightning.data.prompts.sources import PromptRecord
from dapo_lightning.data.sampling.producer import DynamicSamplingConfig, RolloutProducer
from dapo_lightning.data.sampling.rounds import RoundHooks
from dapo_lightning.rewards.base import RewardResult, RewardRunner
from dapo_lightning.rollout.base import (
    DRAIN,
    Completion,
    EngineCapabilities,
    RolloutEngine,
    SamplingConfig,
)
from dapo_lightning.rollout.session import EngineSession

#: The recipe's dynamic-sampling shape (configs/smollm2_135m.yaml).
RECIPE = dict(n=8, train_batch_size=8, gen_batch_size=16, max_num_gen_batches=10)
#: The SmolLM2 recipes' prompt selection (``dynamic_sampling.selection``, predictive as they set
#: it; the rest: the defaults).
RECIPE_SELECTION = dict(retire_after=3, strategy="predictive")

#: The former behaviour: uniform draws, fixed rounds, whole rounds (the HF engine's path), the
#: surplus dropped.
UNIFORM = dict(
    selection={"strategy": "uniform", "review_weight": 0.0},
    round_sizing="fixed",
    in_flight=False,
    carry_over=False,
)


def recipe_config(settings: dict[str, Any]) -> DynamicSamplingConfig:
    """The recipe's config with ``settings`` over it (``selection`` merged key by key)."""
    selection = {**RECIPE_SELECTION, **settings.get("selection", {})}
    return DynamicSamplingConfig(**{**RECIPE, **settings, "selection": selection})


def make_pass_rates(num_prompts: int, seed: int) -> tuple[list[float], list[float], list[str]]:
    """Initial logits, drift per step and class of every prompt (module docstring)."""
    rng = random.Random(seed)
    logits, drift, kinds = [], [], []
    for i in range(num_prompts):
        u = i / num_prompts
        kind, p0 = (
            ("hopeless", rng.uniform(0.0005, 0.01))
            if u < 0.6
            else ("solved", rng.uniform(0.97, 0.9995))
            if u < 0.8
            else ("mixed", rng.uniform(0.1, 0.9))
        )
        logits.append(math.log(p0 / (1 - p0)))
        drift.append(rng.uniform(0.0, 0.02))
        kinds.append(kind)
    order = list(range(num_prompts))
    rng.shuffle(order)  # classes spread over the file, as a task's problems are
    return [logits[i] for i in order], [drift[i] for i in order], [kinds[i] for i in order]


@dataclass
class SimulatedEngine(RolloutEngine):
    """Stands in for the model (and only for it): sample ``j`` of prompt ``i`` is right with
    probability ``p_i(step)``; lengths 1..``max_len`` tokens; ``slots`` samples run at a time.

    ``generate`` runs whole rounds; ``stream_groups`` (present when ``streaming``) yields the
    groups as their last sample ends and, when closed early, aborts the rest (their generated
    tokens still count)."""

    logits: list[float]
    drift: list[float]
    seed: int = 0
    max_len: int = 32
    slots: int = 64
    step: int = 0
    samples: float = 0.0  # sample-equivalents generated (finished 1, aborted partial)
    aborted: float = 0.0  # of which: aborted samples' generated shares
    steps: int = 0  # engine steps (one token for every running sample): the time proxy
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"engine-{self.seed}")

    def pass_rate(self, i: int, step: int | None = None) -> float:
        """``p_i`` at rollout ``step`` (None: the current one)."""
        t = self.step if step is None else step
        return 1.0 / (1.0 + math.exp(-(self.logits[i] + self.drift[i] * t)))

    def _group(self, prompt: Sequence[int], n: int) -> tuple[list[Completion], list[int]]:
        p = self.pass_rate(int(prompt[0]))
        group, lengths = [], []
        for _ in range(n):
            right = self.rng.random() < p
            length = self.rng.randint(1, self.max_len)
            # one token stands for the response (its length only times the engine's slots)
            group.append(
                Completion([1 if right else 2], [-0.1], "stop", text="1" if right else "0")
            )
            lengths.append(length)
        return group, lengths

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        groups = [self._group(p, n) for p in prompts]
        self.samples += len(prompts) * n
        self.steps += _steps_to_finish(
            [length for _, lengths in groups for length in lengths], self.slots
        )
        return [g for g, _ in groups]

    def load_weights(self, named_tensors: Any) -> None:  # no weights: the step drives p
        pass


def _steps_to_finish(lengths: list[int], slots: int) -> int:
    """Engine steps until every sample of ``lengths`` (FIFO, ``slots`` at a time) has ended."""
    free_at = [0] * min(slots, len(lengths))
    for length in lengths:  # each sample takes the slot that frees first
        k = min(range(len(free_at)), key=free_at.__getitem__)
        free_at[k] += length
    return max(free_at, default=0)


class StreamingSimulatedEngine(SimulatedEngine):
    """:class:`SimulatedEngine` with the streaming API (``stream_groups``)."""

    capabilities = EngineCapabilities(streaming=True)

    def stream_groups(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        groups = [self._group(p, n) for p in prompts]
        queue = [(k, j) for k in range(len(prompts)) for j in range(n)]  # FIFO, as vLLM
        running: dict[tuple[int, int], int] = {}  # sample -> tokens generated
        left = [n] * len(prompts)
        try:
            while queue or running:
                while queue and len(running) < self.slots:
                    running[queue.pop(0)] = 0
                self.steps += 1
                finished = []
                for key in list(running):
                    running[key] += 1
                    k, j = key
                    if running[key] >= groups[k][1][j]:
                        del running[key]
                        self.samples += 1
                        left[k] -= 1
                        if left[k] == 0:
                            finished.append((k, groups[k][0]))
                if finished and (yield finished) == DRAIN:  # finish the started groups only
                    started = {k for k, _ in running} | {k for k in range(len(left)) if left[k] < n}
                    queue = [(k, j) for k, j in queue if k in started]
        finally:  # closed early: the running samples' generated share counts, queued ones not
            partial = sum(t / groups[k][1][j] for (k, j), t in running.items())
            self.samples += partial  # + the finished samples of the unfinished groups:
            self.aborted += partial + sum(n - rest for rest in left if rest > 0)


class MatchReward:
    """Exact match of the response text with the answer (+1 / -1)."""

    def __call__(self, responses: list[str], answers: list[str], **kw: Any) -> list[RewardResult]:
        return [
            RewardResult(1.0 if r == a else -1.0, r == a, {"has_answer": True})
            for r, a in zip(responses, answers)
        ]


@dataclass
class Outcome:
    samples_per_group: float  # in units of n
    rounds: float
    zero_variance: float
    starved: int
    max_gap: int
    bias: float
    skipped: float
    engine_steps: float
    seconds: float
    #: Rollout steps from a prompt's becoming learnable to its next visit (found_after).
    found_after: list[int] = field(default_factory=list)
    #: Of those, prompts not visited again by the end (their wait counted to the end).
    not_found: int = 0
    #: Samples (units of n per kept group) beyond the kept groups' own, by cause (CAUSES).
    waste: dict[str, float] = field(default_factory=dict)


#: Where the samples beyond the batch's own went (the second table's columns): zero-variance
#: groups of first visits, of revisits forced by the no-starvation floor (``revisit_within``
#: epochs since the last visit: due; the ``1 - max_skip`` draw: floor), of prompts predicted to
#: vary (or drawn without a prediction: uniform), partial
#: samples aborted by in-flight rounds, kept groups dropped as surplus (or stale), kept groups
#: still carried at the end.
CAUSES = ("first visits", "due revisits", "floor draws", "predicted wrong", "aborted",
          "dropped surplus", "carried at end")  # fmt: skip
#: The selector's reasons (``PredictiveSelector.decide``) as causes of a zero-variance group.
CAUSE_OF = {"due": "due revisits", "floor": "floor draws", "predicted": "predicted wrong"}


def found_after(
    engine: SimulatedEngine, visit_steps: dict[int, list[int]], steps: int, n: int
) -> tuple[list[int], int]:
    """Rollout steps until a prompt that became learnable is visited, and how many never were.

    Prompt ``i`` becomes learnable at the first step ``s`` at which its true zero-variance
    probability ``P0(s) = p_i(s)^n + (1 - p_i(s))^n`` is at most 1/2, having been above 1/2
    at step 0 (a hopeless or solved prompt the drift made mixed). Its wait is ``v - s``, ``v``
    the first step ``>= s`` at which it was visited, or ``steps - s`` when it was not visited
    again by the end (counted in the second value). Prompts learnable from the start, or
    never, have no wait.
    """
    waits, not_found = [], 0
    for i in range(len(engine.logits)):
        p0 = [engine.pass_rate(i, t) ** n + (1 - engine.pass_rate(i, t)) ** n for t in range(steps)]
        if p0[0] <= 0.5:
            continue
        became = next((t for t in range(steps) if p0[t] <= 0.5), None)
        if became is None:
            continue
        seen = [v for v in visit_steps.get(i, []) if v >= became]
        waits.append((min(seen) if seen else steps) - became)
        not_found += not seen
    return waits, not_found


def simulate(name: str, settings: dict[str, Any], steps: int, prompts: int, seed: int) -> Outcome:
    """Run ``steps`` rollout steps of the real producer on the simulated engine."""
    logits, drift, _ = make_pass_rates(prompts, seed)
    streaming = settings.get("in_flight", True)
    engine_cls = StreamingSimulatedEngine if streaming else SimulatedEngine
    engine = engine_cls(logits, drift, seed=seed)
    records = [
        PromptRecord(uid=f"p{i}", prompt=f"p{i}", answer="1", prompt_ids=[i])
        for i in range(prompts)
    ]
    config = recipe_config(settings)
    visits: dict[str, list[int]] = defaultdict(list)
    visit_steps: dict[int, list[int]] = defaultdict(list)  # prompt -> rollout steps visited
    waste = dict.fromkeys(CAUSES, 0.0)  # samples
    why: dict[str, str] = {}  # uid -> the selector's reason for its last draw
    bias: list[float] = []
    producer: RolloutProducer | None = None

    def on_scored(rollouts: Any) -> None:
        acc = rollouts.acc.view(-1, config.n)
        for g in range(acc.shape[0]):
            uid = rollouts.prompt_uid[g * config.n]
            if acc[g].max() > acc[g].min():
                bias.append(float(acc[g].mean()) - engine.pass_rate(int(uid[1:])))

    producer = RolloutProducer(
        EngineSession(engine),
        RewardRunner(MatchReward(), in_process=True),
        records,
        config,
        decode=lambda ids: "1" if ids and ids[0] == 1 else "0",
        pad_token_id=0,
        sampling=SamplingConfig(max_tokens=32),
        seed=seed,
        hooks=RoundHooks(scored=on_scored),
    )
    update = producer.tracker.update

    def record_visit(uid: str, accs: Any, epoch: int) -> None:  # every visit, in its draw epoch
        first = not visits[uid]
        visits[uid].append(epoch)
        visit_steps[int(uid[1:])].append(engine.step)
        if len(set(accs)) == 1:  # a zero-variance group: all its samples are waste
            reason = why.get(uid, "predicted")
            cause = "first visits" if first else CAUSE_OF.get(reason, "predicted wrong")
            waste[cause] += len(accs)
        update(uid, accs, epoch)

    producer.tracker.update = record_visit
    if producer.selector is not None:
        decide = producer.selector.decide

        def record_decision(stats: Any, epoch: int) -> str:
            reason = decide(stats, epoch)
            uid = current_uid[0]
            if reason != "skip":
                why[uid] = reason
            return reason

        producer.selector.decide = record_decision
        current_uid = [""]
        take = producer.sampler.take

        def take_recording(k: int, eligible: Any = None, skip: Any = None, **kwargs: Any):
            def skip_named(i: int, epoch: int) -> bool:
                current_uid[0] = records[i].uid
                return skip(i, epoch)

            return take(k, eligible, skip=skip_named if skip else None, **kwargs)

        producer.sampler.take = take_recording
    t0 = time.perf_counter()
    batch_groups, rounds, zero_var, skipped = 0.0, [], [], 0.0
    for step in range(steps):
        engine.step = step
        batch = producer.next_batch(policy_version=step)
        s = batch.stats
        dropped = s["data/dropped_surplus_groups"] + s["data/dropped_stale_groups"]
        waste["dropped surplus"] += dropped * config.n
        batch_groups += s["data/batch_groups"]
        rounds.append(s["data/gen_rounds"])
        zero_var.append(s["data/zero_variance_frac"])
        skipped += s["data/skipped_predicted"]
    for i, epoch in producer.sampler.pending:  # drawn, given back by a stopped round: next up
        visits[records[i].uid].append(epoch)
    end_epoch = producer.sampler.epoch
    bound = config.selection.revisit_within
    gaps = {}
    for r in records:
        st = producer.tracker.stats.get(r.uid) if producer.tracker is not None else None
        if st is not None and st.retired:
            continue
        seen = [-1, *sorted(visits.get(r.uid, [])), end_epoch]  # a given-back draw ends later
        gaps[r.uid] = max(b - a for a, b in zip(seen, seen[1:]))
    waste["aborted"] = engine.aborted
    waste["carried at end"] = sum(r.num_groups for r, _ in producer.carried) * config.n
    per_kept = max(batch_groups, 1.0) * config.n
    waits, not_found = found_after(engine, visit_steps, steps, config.n)
    return Outcome(
        found_after=waits,
        not_found=not_found,
        waste={k: v / per_kept for k, v in waste.items()},
        samples_per_group=engine.samples / max(batch_groups, 1.0) / config.n,
        rounds=statistics.median(rounds),
        zero_variance=statistics.fmean(zero_var),
        starved=sum(g > bound for g in gaps.values()),
        max_gap=max(gaps.values()) if gaps else 0,
        bias=statistics.fmean(bias) if bias else 0.0,
        skipped=skipped / steps,
        engine_steps=engine.steps / steps,
        seconds=time.perf_counter() - t0,
    )


#: The second pass's prompt selection (2026-12-02): every skipped prompt due after 16 epochs
#: (no back-off), history weighed 0.9 per visit.
SECOND_PASS = {"revisit_after": 16, "revisit_within": 16, "history_decay": 0.9}

#: The configurations compared: the former behaviour, each part alone, all parts (the SmolLM2
#: recipes' sampling: predictive selection and the library's defaults for the rest).
CONFIGS: dict[str, dict[str, Any]] = {
    "uniform (former)": UNIFORM,
    "+ predictive selection": {**UNIFORM, "selection": {"strategy": "predictive"}},
    "+ right-sized rounds": {**UNIFORM, "round_sizing": "kept_frac"},
    "+ right-sized rounds, carry-over": {
        **UNIFORM,
        "round_sizing": "kept_frac",
        "carry_over": True,
    },
    "+ in-flight refill": {**UNIFORM, "in_flight": True},
    "all parts, no carry-over": {"carry_over": False},
    "all parts, whole rounds": {"in_flight": False},
    "all parts, second-pass selection": {"selection": SECOND_PASS},
    "second pass + history_decay 0.5": {"selection": {**SECOND_PASS, "history_decay": 0.5}},
    "second pass + back-off 16-32": {"selection": {**SECOND_PASS, "revisit_within": 32}},
    "all parts (recipe)": {},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulated", action="store_true", help="the simulated engine (no model)")
    parser.add_argument("--quick", action="store_true", help="20 steps (smoke test)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.simulated and not args.quick:
        parser.error(
            "only --simulated is implemented here; the real recipe comparison is "
            "benchmarks/smollm2_curve.py with the old defaults (see benchmarks/RESULTS.md)."
        )
    steps = 20 if args.quick else args.steps
    results = {
        name: simulate(name, cfg, steps, args.prompts, args.seed) for name, cfg in CONFIGS.items()
    }
    rows = [
        [
            name,
            f"{o.samples_per_group:.2f}",
            o.rounds,
            f"{o.zero_variance:.2f}",
            f"{o.skipped:.1f}",
            o.starved,
            o.max_gap,
            f"{statistics.fmean(o.found_after):.0f} / {max(o.found_after)} ({o.not_found})"
            if o.found_after
            else "-",
            f"{o.bias:+.3f}",
            f"{o.engine_steps:.0f}",
            f"{o.seconds:.1f}",
        ]
        for name, o in results.items()
    ]
    print_table(
        f"Simulated dynamic sampling: {args.prompts} prompts, n={RECIPE['n']}, "
        f"train_batch_size={RECIPE['train_batch_size']}, {steps} rollout steps, seed {args.seed}",
        [
            "configuration",
            "samples / kept group (n)",
            "rounds / step (median)",
            "zero-variance frac",
            "skipped / step",
            "starved prompts",
            "max gap (epochs)",
            "changed found after (steps, mean / max; not found)",
            "kept acc - p",
            "engine steps / step",
            "seconds",
        ],
        rows,
    )
    print_table(
        "Where the samples beyond the batch's own went (units of n per kept group; "
        "1 + their sum = samples / kept group)",
        ["configuration", *CAUSES],
        [[name, *(f"{o.waste[c]:.2f}" for c in CAUSES)] for name, o in results.items()],
    )
    png = bar_chart(
        out_dir() / ("sampling_efficiency_quick.png" if args.quick else "sampling_efficiency.png"),
        "Samples generated per kept group (units of n), simulated recipe",
        list(results),
        {"samples / kept group": [o.samples_per_group for o in results.values()]},
        ylabel="samples per kept group / n",
    )
    print(f"wrote {png}")
    uniform, parts = results["uniform (former)"], results["all parts (recipe)"]
    print(
        f"samples per kept group: uniform {uniform.samples_per_group:.1f} n, "
        f"all parts {parts.samples_per_group:.1f} n"
    )


if __name__ == "__main__":
    main()
