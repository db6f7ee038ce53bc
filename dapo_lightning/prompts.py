"""A prompt and its record: the value types every layer shares (the data module loads them,
environments start episodes from them, tasks encode them), and the encoding of a prompt to token
ids. Loading them from files is :mod:`dapo_lightning.data.prompts.sources`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_lightning.checks import ConfigError

Prompt = str | list[dict[str, str]]


class PromptDataError(ConfigError):
    """A row of a prompt file cannot be used; the message names the row, the field and the fix."""


#: Row fields kept in :attr:`PromptRecord.meta`: ``difficulty`` (the arithmetic task's level),
#: ``split`` (``"train"`` / ``"val"``: a task's own held-out set) and ``reward_kwargs`` (a dict of
#: keyword arguments the reward gets with this prompt's responses, e.g. what a scorer needs).
ROW_META_KEYS = ("difficulty", "split", "reward_kwargs")


@dataclass
class PromptRecord:
    """One prompt with its answer.

    Args:
        uid: Stable id (per-prompt statistics and de-duplication use it).
        prompt: Text or chat messages.
        answer: Ground truth, as a string.
        data_source: Source name, or None.
        prompt_ids: Token ids after the chat template (set by
            :func:`~dapo_lightning.data.prompts.sources.tokenize_records`).
        meta: Extra fields (:data:`ROW_META_KEYS`).
    """

    uid: str
    prompt: Prompt
    answer: str
    data_source: str | None = None
    prompt_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def prompt_input_text(
    tokenizer: Any,
    prompt: Prompt,
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text a prompt is tokenized from: with the chat template, the conversation rendered
    with the generation prompt (a string is one user message; ``tools``: the tools' JSON
    schemas, which the template renders); without, the prompt itself."""
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    if not isinstance(prompt, str):
        raise PromptDataError(
            "a prompt is a list of chat messages but prompts.apply_chat_template is false: set "
            "it true or give plain-text prompts."
        )
    return prompt


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a prompt (:func:`prompt_input_text`, no special tokens added)."""
    text = prompt_input_text(tokenizer, prompt, apply_chat_template, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(
    tokenizer: Any,
    prompts: list[Prompt],
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """:func:`encode_prompt` of each prompt, tokenized in one batch call (a fast tokenizer
    encodes a batch several times quicker than one text at a time; the ids are the same)."""
    if not prompts:
        return []
    texts = [prompt_input_text(tokenizer, p, apply_chat_template, tools) for p in prompts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one text: itself, or chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)


__all__ = [
    "ROW_META_KEYS",
    "Prompt",
    "PromptDataError",
    "PromptRecord",
    "encode_prompt",
    "encode_prompts",
    "prompt_input_text",
    "prompt_text",
]
