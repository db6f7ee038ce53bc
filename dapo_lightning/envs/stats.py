"""The ``env/*`` metrics of episodes: the counts an :class:`~dapo_lightning.envs.runner.EpisodeRunner`
keeps, and what they are logged as."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: The counts the episode runner keeps per rollout step (plus ``metric:<name>`` for each
#: metric the environment declares).
STAT_KEYS = (
    "episodes", "turns", "tool_calls", "tool_errors", "failures", "timeouts", "tokens",
    "observations_cut", "calling",
)  # fmt: skip


def env_stats(
    totals: Mapping[str, float] | None = None, metric_names: Sequence[str] = ()
) -> dict[str, float]:
    """The ``env/*`` metrics of episode counts (all zero for None):

    env/turns_mean          = assistant turns / episodes
    env/tool_calls_mean     = tool calls / episodes
    env/tool_use_frac       = episodes with at least one tool call / episodes
    env/tool_error_rate     = failed tool calls / tool calls      (0 without calls)
    env/episode_tokens_mean = (prompt + response tokens) / episodes
    env/failures            = episodes the environment failed (raised, hung, garbage)
    env/timeouts            = those that ran over call_timeout_s
    env/observations_cut    = episodes ended because an observation did not fit
    env/<name>              = the environment's metric ``name`` summed over each episode's
                              turns, / episodes (``metric_names``, its declared names)
    """
    t = dict(totals) if totals is not None else {}
    get = lambda key: float(t.get(key, 0))  # noqa: E731
    episodes = max(get("episodes"), 1.0)
    out = {
        "env/turns_mean": get("turns") / episodes,
        "env/tool_calls_mean": get("tool_calls") / episodes,
        "env/tool_use_frac": get("calling") / episodes,
        "env/tool_error_rate": get("tool_errors") / max(get("tool_calls"), 1.0),
        "env/episode_tokens_mean": get("tokens") / episodes,
        "env/failures": get("failures"),
        "env/timeouts": get("timeouts"),
        "env/observations_cut": get("observations_cut"),
    }
    out.update({f"env/{name}": get(f"metric:{name}") / episodes for name in metric_names})
    return out
