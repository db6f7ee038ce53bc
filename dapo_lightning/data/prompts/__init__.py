"""Prompts: the sources they are read from (files, built-in tasks) and their preparation for
rollouts and the cold start (chat template, tools' instructions, tokenization, the held-out
split), and the data module's prompt, validation and scoring settings."""
