"""Rollout streams: one rank's batches for the module, generated right before each step
(``stream``) or on a rollout thread while the previous step updates (``one_step_off``)."""
