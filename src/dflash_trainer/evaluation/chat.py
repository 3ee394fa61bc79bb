"""Chat prompts for generation: render with the serving template, and the ids that end a response.

Rendering is training's (data/tokenize.py `served_prompt`, `prompt_ids`): the template's text with
the assistant generation prompt, then tokens without extra special tokens (templates write BOS and
turn markers themselves).
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.data.tokenize import prompt_ids, served_prompt
from dflash_trainer.target_model.load import TargetBundle


def render_prompt(tokenizer: Any, chat_template: str, messages: list[dict[str, str]],
                  enable_thinking: bool | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt: the served prompt that
    training documents hold before each assistant turn (data/serving.py).

    enable_thinking None = not passed to the template (as in training). Raises
    ConversationSkipped("template_error") (a ValueError) when the template raises.
    """
    return prompt_ids(tokenizer, served_prompt(tokenizer, messages, chat_template, enable_thinking))


def eos_token_ids(target: TargetBundle) -> set[int]:
    """Ids that end a response: the tokenizer's eos plus the model's generation-config and config
    eos ids (chat models often stop at an end-of-turn token that differs from the base eos)."""
    ids: set[int] = set()
    sources = [getattr(target.tokenizer, "eos_token_id", None),
               getattr(getattr(target.model, "generation_config", None), "eos_token_id", None),
               getattr(target.config, "eos_token_id", None)]
    for e in sources:
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids
