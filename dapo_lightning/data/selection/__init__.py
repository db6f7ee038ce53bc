"""Which prompts a rank draws next: the seeded sampler, per-prompt difficulty statistics
(retiring solved prompts, parking hopeless ones, predictive selection)."""
