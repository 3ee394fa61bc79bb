"""What a server shows the model for each assistant turn of a conversation, as text and tokens.

For assistant turn i (any template, the run's `enable_thinking`):

  prompt   = served_prompt(messages[:i])  the template with the generation prompt (tokenize.py)
  response = the turn's content, less what the prompt already wrote (`served_response`)
  trailer  = the text after the stand-in content in render(messages[:i] + [assistant: SENTINEL])
             (e.g. `<|im_end|>\\n`: the end of turn the template writes after any content)

The prompt is tokenized on its own (what the server feeds); the response and trailer are tokenized
from the prompt's end (what the model generates, then the end-of-turn), with loss on the response
and the trailer without its trailing whitespace (`answer<|im_end|>`; the newline after it is never
generated): `reply_tokens`. data/per_turn.py builds the training documents from these.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash_trainer.data.tokenize import (ConversationSkipped, TokenizedConversation, render, sentinel_probe,
                                          served_prompt, tokenize_spans)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # reasoning markers (Qwen3, DeepSeek-R1 and kin)


@dataclass(frozen=True)
class ServedTurn:
    """One assistant turn as served: `prompt` text (history + generation prompt), `response` (the
    text the model generates after it), `trailer` (the template's end of turn after the response)."""

    prompt: str
    response: str
    trailer: str

    @property
    def supervised_text(self) -> str:
        """The characters the loss covers: response + trailer without its trailing whitespace."""
        return self.response + self.trailer.rstrip()


def served_response(content: str, generation_tail: str) -> str:
    """The part of an assistant turn's `content` that the model generates after a prompt whose
    generation part (the text after the rendered history) is `generation_tail`.

    When the template writes a reasoning block into the generation prompt (Qwen3 with
    enable_thinking=False writes an empty `<think>\\n\\n</think>\\n\\n`; some templates open one with
    `<think>\\n`), the model never generates that part, so content that repeats it loses it:
      - content starting with the written block verbatim: the block is removed;
      - prompt closed the block, content has its own empty block: the block and whitespace after it
        are removed; a non-empty one raises ConversationSkipped("reasoning_with_thinking_disabled")
        (the served model does not reason with this flag: prepare with enable_thinking matching);
      - prompt opened the block, content opens its own: the content's opening marker is removed.
    Any other content is the response as is (`<think>reasoning</think>answer` after a bare header;
    an answer without a think block after a bare header, even where the template's own render of a
    final turn inserts an empty block: the model wrote no block).
    """
    k = generation_tail.rfind(THINK_OPEN)
    if k < 0:
        return content
    written = generation_tail[k:]  # e.g. "<think>\n\n</think>\n\n" or "<think>\n"
    if content.startswith(written):
        return content[len(written):]
    head = content.lstrip()
    if not head.startswith(THINK_OPEN):
        return content
    if THINK_CLOSE not in written:
        return head[len(THINK_OPEN):].lstrip()
    end = head.find(THINK_CLOSE)
    if end < 0 or head[len(THINK_OPEN):end].strip():
        raise ConversationSkipped("reasoning_with_thinking_disabled",
                                  "the prompt closes the reasoning block but the response reasons")
    return head[end + len(THINK_CLOSE):].lstrip()


def served_turn(tokenizer: Any, messages: Sequence[dict[str, str]], i: int, chat_template: str,
                enable_thinking: bool | None = None) -> ServedTurn:
    """Assistant turn `messages[i]` as served after `messages[:i]` (module docstring).

    Raises ConversationSkipped: template_error (the template raises), template_alters_content (the
    stand-in content is not rendered verbatim), template_without_generation_prompt (the generation
    prompt adds nothing after the history: a server could not start an assistant turn),
    reasoning_with_thinking_disabled (`served_response`).
    """
    assert messages[i]["role"] == "assistant", messages[i]["role"]
    history = messages[:i]
    prompt = served_prompt(tokenizer, history, chat_template, enable_thinking)
    bare = render(tokenizer, history, chat_template, enable_thinking) if i else ""
    common = len(bare) if prompt.startswith(bare) else len(os.path.commonprefix([prompt, bare]))
    tail = prompt[common:]  # the generation prompt, e.g. "<|im_start|>assistant\n"
    if not tail:
        raise ConversationSkipped("template_without_generation_prompt",
                                  f"turn {i}: add_generation_prompt=True writes nothing after the history; pass "
                                  f"--chat-template with the template serving uses (it writes the assistant header)")
    _, _, trailer = sentinel_probe(tokenizer, history, chat_template, enable_thinking)
    return ServedTurn(prompt=prompt, response=served_response(messages[i]["content"], tail), trailer=trailer)


def served_turns(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str,
                 enable_thinking: bool | None = None) -> list[ServedTurn]:
    """`served_turn` of every assistant turn, in order (ConversationSkipped as the first one raises)."""
    return [served_turn(tokenizer, messages, i, chat_template, enable_thinking)
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def reply_tokens(tokenizer: Any, turn: ServedTurn) -> TokenizedConversation:
    """response + trailer tokenized from the prompt's end (`add_special_tokens=False`); loss mask 1
    on the tokens of `turn.supervised_text`, 0 on the trailer's trailing whitespace."""
    return tokenize_spans(tokenizer, turn.response + turn.trailer, [(0, len(turn.supervised_text))])
