"""Chat prompts for generation: render with the serving template, and the ids that end a response.

Rendering matches training (data/tokenize.py): the template's text, then tokens without extra
special tokens (templates write BOS and turn markers themselves), here with the assistant
generation prompt appended.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.target_model.load import TargetBundle


def render_prompt(tokenizer: Any, chat_template: str, messages: list[dict[str, str]],
                  enable_thinking: bool | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt.

    enable_thinking None = not passed to the template (as in training).
    """
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=True, **extra)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
