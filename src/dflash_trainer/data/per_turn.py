"""One document per assistant turn, for conversations a template cannot render as one document.

Some templates render earlier assistant turns differently from how the model wrote them: Qwen3
strips the `<think>…</think>` reasoning of every assistant turn before the last user query. Such a
conversation has no single text in which each turn reads as the model produced it, so it becomes
one document per assistant turn i, built exactly as a server sees that turn:

  prompt   = render(messages[:i], add_generation_prompt=True)     what the server tokenizes
  response = the turn's content, less what the prompt already wrote (see `served_response`)
  trailer  = the text after the stand-in content in render(messages[:i] + [assistant: SENTINEL])
  document = tokens(prompt) + tokens(response + trailer)

The prompt is tokenized on its own (`add_special_tokens=False`, as `apply_chat_template(...,
tokenize=True)` does), so its tokens are exactly the served prompt's even where one tokenization of
prompt + response would merge characters across the boundary (a response that starts with a
newline after a header that ends with one). The response is tokenized from that boundary, as the
model generates it. Loss mask: 1 on the response and the trailer without its trailing whitespace
(`answer<|im_end|>`; the newline after it is never generated), 0 on the prompt: the supervision
rule of tokenize.py. Lengths: a conversation of n assistant turns repeats its history n times.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash_trainer.data.tokenize import (ConversationSkipped, TokenizedConversation, render, resolve_chat_template,
                                          sentinel_probe, tokenize_conversation, tokenize_spans)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # reasoning markers (Qwen3, DeepSeek-R1 and kin)
# Single-document failures that one document per turn resolves (it needs neither a faithful render
# of earlier turns nor prefix renders that are prefixes of the full text).
EXPANDABLE = ("template_alters_content", "template_not_incremental")


@dataclass
class ConversationDocuments:
    """The documents of one conversation: one (`expanded` False) or one per assistant turn."""

    documents: list[TokenizedConversation]
    expanded: bool


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
    Any other content is the response as is (`<think>reasoning</think>answer` after a bare header).
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


def turn_document(tokenizer: Any, messages: Sequence[dict[str, str]], i: int, chat_template: str,
                  enable_thinking: bool | None = None) -> TokenizedConversation:
    """The document of assistant turn `messages[i]`: served prompt for `messages[:i]` + the turn.

    Raises ConversationSkipped (template_error, template_alters_content,
    reasoning_with_thinking_disabled) for a turn this template cannot serve.
    """
    assert messages[i]["role"] == "assistant", messages[i]["role"]
    history = messages[:i]
    prompt = render(tokenizer, history, chat_template, enable_thinking, add_generation_prompt=True)
    bare = render(tokenizer, history, chat_template, enable_thinking) if i else ""
    tail = prompt[len(os.path.commonprefix([prompt, bare])):]  # e.g. "<|im_start|>assistant\n"
    _, _, trailer = sentinel_probe(tokenizer, history, chat_template, enable_thinking)
    response = served_response(messages[i]["content"], tail)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    reply = tokenize_spans(tokenizer, response + trailer, [(0, len(response) + len(trailer.rstrip()))])
    return TokenizedConversation(input_ids=prompt_ids + reply.input_ids,
                                 loss_mask=[0] * len(prompt_ids) + reply.loss_mask)


def per_turn_documents(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str,
                       enable_thinking: bool | None = None) -> list[TokenizedConversation]:
    """One `turn_document` per assistant turn, in turn order (ConversationSkipped as it raises)."""
    return [turn_document(tokenizer, messages, i, chat_template, enable_thinking)
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def conversation_documents(tokenizer: Any, messages: Sequence[dict[str, str]], *, chat_template: str | None = None,
                           enable_thinking: bool | None = None) -> ConversationDocuments:
    """The conversation as one document when the template renders every assistant turn as written
    (exactly `tokenize_conversation`), else one document per assistant turn.

    `chat_template` None = the tokenizer's own (ValueError if it has none); `enable_thinking` None =
    not passed to the template. Raises ConversationSkipped when neither form is possible.
    """
    template = resolve_chat_template(tokenizer, chat_template)
    try:
        doc = tokenize_conversation(tokenizer, messages, chat_template=template, enable_thinking=enable_thinking)
        return ConversationDocuments([doc], expanded=False)
    except ConversationSkipped as e:
        if e.reason not in EXPANDABLE:
            raise
    return ConversationDocuments(per_turn_documents(tokenizer, messages, template, enable_thinking), expanded=True)
