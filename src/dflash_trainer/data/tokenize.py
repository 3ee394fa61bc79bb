"""Render a conversation with the target's own chat template; mask all but assistant tokens.

The conversation is rendered once to text (`apply_chat_template(tokenize=False)`) and tokenized
once with `add_special_tokens=False` (templates already write BOS and the turn markers). The loss
mask comes from character spans mapped to tokens through the fast tokenizer's offset mapping, so
it works for any template without knowing its markers:

For assistant turn i
  1. P = render(messages[:i]); the turn's text starts at len(P) in the full text (P must be a
     prefix of it; after another assistant turn, the end of that turn is used instead).
  2. S = render(messages[:i] + [assistant: SENTINEL]); the text after SENTINEL in S is the turn's
     trailer (e.g. `<|im_end|>\n`, `<|eot_id|>`), the text before it the role header.
  3. In the full text, the first occurrence of content + trailer at or after len(P), no further
     than S's header length, locates the content (the header may be shorter than S's: Qwen3-style
     templates render only the final assistant turn with an empty think block). A template that
     trims content is matched by the stripped content.
  4. Supervised characters: the content and the trailer without its trailing whitespace. So
     `Hi there!<|im_end|>` is supervised, the header `<|im_start|>assistant\n` and the newline
     after `<|im_end|>` are not (a served model stops at the end-of-turn token and never
     generates that newline).
A token is supervised when its character span overlaps a supervised span (a BPE token that joins
a header space with the first content word is supervised).

A conversation the template cannot render (a `raise_exception` in the template) or whose content
the template rewrites is reported by `ConversationSkipped(reason)` for the caller to count; for the
latter, per_turn.py builds one document per assistant turn instead (e.g. Qwen3 strips the
reasoning of earlier assistant turns).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np

SENTINEL = "QxSENTINELxQ"  # stand-in assistant content; plain ASCII so no template alters it


class ConversationSkipped(ValueError):
    """This conversation cannot be used with this template; `reason` is the skip-count key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class TokenizedConversation:
    """One document: token ids and a 0/1 loss mask of the same length (1 = assistant token)."""

    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template used for rendering: `chat_template` if given, else the tokenizer's own.

    Raises ValueError (with the fix) when the tokenizer has none or is not a fast tokenizer (the
    loss mask needs its offset mapping).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} is not a fast tokenizer; "
                         f"the loss mask needs `return_offsets_mapping` (load it with use_fast=True / a tokenizer.json)")
    if chat_template:
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is used for chats
        template = template.get("default")
    if not template:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; pass one with "
                         f"`--chat-template FILE` (a Jinja file; it must be the template used at serving time)")
    return template


def chat_template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def render(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str,
           enable_thinking: bool | None = None, add_generation_prompt: bool = False) -> str:
    """The template's text for `messages` (with the generation prompt when asked: the prompt a
    server renders before the model writes the next assistant turn)."""
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.apply_chat_template(list(messages), chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as e:
        raise ConversationSkipped("template_error", str(e)) from e
    assert isinstance(text, str), type(text)
    return text


def sentinel_probe(tokenizer: Any, history: Sequence[dict[str, str]], chat_template: str,
                   enable_thinking: bool | None = None) -> tuple[str, int, str]:
    """(S, k, trailer) for an assistant turn after `history`: S = render(history + [assistant:
    SENTINEL]), k = where SENTINEL starts in S, trailer = S after SENTINEL (e.g. `<|im_end|>\n`).

    Raises ConversationSkipped("template_alters_content") when SENTINEL is not rendered verbatim.
    """
    probe = render(tokenizer, [*history, {"role": "assistant", "content": SENTINEL}], chat_template, enable_thinking)
    k = probe.rfind(SENTINEL)
    if k < 0:
        raise ConversationSkipped("template_alters_content",
                                  f"turn {len(history)}: stand-in content not rendered verbatim")
    return probe, k, probe[k + len(SENTINEL):]


def assistant_char_spans(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str,
                         enable_thinking: bool | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text, [start, end) character spans of the supervised text of each assistant turn)."""
    full = render(tokenizer, messages, chat_template, enable_thinking)
    spans: list[tuple[int, int]] = []
    cursor = 0  # end of the last located assistant turn
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], chat_template, enable_thinking) if i else ""
        if full.startswith(prefix) and len(prefix) >= cursor:
            start = len(prefix)
        elif i and messages[i - 1]["role"] == "assistant":
            start = cursor
        else:
            raise ConversationSkipped("template_not_incremental", f"turn {i}")
        probe, k, trailer = sentinel_probe(tokenizer, messages[:i], chat_template, enable_thinking)
        # The content starts right after this turn's header; a match further away is another turn.
        header_len = k - len(prefix) if probe.startswith(prefix) else k
        for content in (msg["content"], msg["content"].strip()):
            c0 = full.find(content + trailer, start)
            if 0 <= c0 - start <= header_len:
                break
        else:
            raise ConversationSkipped("template_alters_content", f"turn {i}")
        c1 = c0 + len(content)
        spans.append((c0, c1 + len(trailer.rstrip())))
        cursor = c1 + len(trailer)
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], *, chat_template: str | None = None,
                          enable_thinking: bool | None = None) -> TokenizedConversation:
    """Token ids of the rendered conversation and its loss mask (1 on assistant content + end of turn).

    `chat_template` None = the tokenizer's own (ValueError if it has none); `enable_thinking` None =
    not passed to the template. Raises `ConversationSkipped` for conversations this template
    cannot render faithfully.
    """
    template = resolve_chat_template(tokenizer, chat_template)
    text, spans = assistant_char_spans(tokenizer, messages, template, enable_thinking)
    return tokenize_spans(tokenizer, text, spans)


def tokenize_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> TokenizedConversation:
    """`text` tokenized once (`add_special_tokens=False`), loss mask 1 on every token whose character
    span overlaps one of the [start, end) character `spans`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [tokens, 2] char [start, end)
    starts, ends = offsets[:, 0], offsets[:, 1]
    assert (np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all(), "offsets must ascend"
    mask = np.zeros(len(ids), dtype=np.int8)
    for lo, hi in spans:
        # Tokens overlapping [lo, hi): end > lo and start < hi (both columns ascend).
        t0 = int(np.searchsorted(ends, lo, side="right"))
        t1 = int(np.searchsorted(starts, hi, side="left"))
        mask[t0:t1] = 1
    return TokenizedConversation(input_ids=ids, loss_mask=mask.tolist())
