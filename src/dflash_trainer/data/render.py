"""Chat prompts for generation: the served prompt's token ids, and the ids that end a response."""

from __future__ import annotations

from typing import Any

from dflash_trainer.data.tokenize import prompt_ids, served_prompt
from dflash_trainer.target_model.load import TargetBundle


def render_prompt(tokenizer: Any, chat_template: str, messages: list[dict[str, str]],
                  enable_thinking: bool | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt, rendered as training
    documents render the prompt before each assistant turn (data/tokenize.py `served_prompt`, then
    `prompt_ids`: no extra special tokens, the template writes BOS and turn markers itself).

    enable_thinking None = not passed to the template (as in training). Raises
    ConversationSkipped("template_error") (a ValueError) when the template raises.
    """
    return prompt_ids(tokenizer, served_prompt(tokenizer, messages, chat_template, enable_thinking))


def eos_token_ids(target: TargetBundle) -> set[int]:
    """Ids that end a response: the tokenizer's eos plus the model's generation-config and config
    eos ids (chat models often stop at an end-of-turn token that differs from the base eos)."""
    ids: set[int] = set()
    for e in (getattr(target.tokenizer, "eos_token_id", None),
              getattr(getattr(target.model, "generation_config", None), "eos_token_id", None),
              getattr(target.config, "eos_token_id", None)):
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids
