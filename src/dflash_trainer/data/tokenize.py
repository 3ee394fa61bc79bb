"""Render chat messages with the target's own chat template and tokenize them with a loss mask.

Primitives of the data path (data/serving.py and data/per_turn.py build the documents from them):
  - `render`: the template's text (`apply_chat_template(tokenize=False)`), optionally with the
    generation prompt; `served_prompt`: what a server renders before the model writes the next
    assistant turn, `prompt_ids`: its tokens as a server feeds them;
  - `sentinel_probe`: render(history + [assistant: SENTINEL]); the text after SENTINEL is the turn's
    trailer (e.g. `<|im_end|>\n`, `<|eot_id|>`), which tells where supervision ends without knowing
    the template's markers;
  - `encode_offsets` / `tokenize_spans`: text tokenized once with
    `add_special_tokens=False` (templates already write BOS and the turn markers) and a 0/1 loss
    mask from character spans, through the fast tokenizer's offset mapping: a token is supervised
    when its character span overlaps a supervised span.

A conversation the template cannot render (a `raise_exception` in the template) or whose content
the template rewrites is reported by `ConversationSkipped(reason)` for the caller to count.
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


def served_prompt(tokenizer: Any, history: Sequence[dict[str, str]], chat_template: str,
                  enable_thinking: bool | None = None) -> str:
    """The prompt text a server renders before the model writes the assistant turn after `history`:
    the template with the generation prompt and the run's `enable_thinking` (None = not passed). The
    one definition used by training documents (data/serving.py), regeneration and eval.

    Raises ConversationSkipped("template_error") when the template raises.
    """
    return render(tokenizer, history, chat_template, enable_thinking, add_generation_prompt=True)


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids a server feeds for `prompt` text: tokenized on its own with
    `add_special_tokens=False`, as `apply_chat_template(..., tokenize=True)` does."""
    return prompt_ids_batch(tokenizer, [prompt])[0]


def prompt_ids_batch(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """`prompt_ids` of each text, tokenized in one call: a fast tokenizer encodes a batch on its own threads
    (the regeneration's host spent 1.1 ms a turn encoding its prompts one at a time on the CPU machine,
    most of its per-turn work). The same ids as one call each (no padding or truncation)."""
    if not prompts:
        return []
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]


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


def encode_offsets(tokenizer: Any, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(ids, starts, ends) of `text` tokenized once with `add_special_tokens=False`: token i covers
    characters [starts[i], ends[i]) (int64 arrays [tokens], both ascending)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [tokens, 2] char [start, end)
    starts, ends = offsets[:, 0], offsets[:, 1]
    assert (np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all(), "offsets must ascend"
    return list(enc["input_ids"]), starts, ends


def tokenize_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> TokenizedConversation:
    """`text` tokenized once (`add_special_tokens=False`), loss mask 1 on every token whose character
    span overlaps one of the [start, end) character `spans`."""
    ids, starts, ends = encode_offsets(tokenizer, text)
    mask = np.zeros(len(ids), dtype=np.int8)
    for lo, hi in spans:
        # Tokens overlapping [lo, hi): end > lo and start < hi (both columns ascend).
        t0 = int(np.searchsorted(ends, lo, side="right"))
        t1 = int(np.searchsorted(starts, hi, side="left"))
        mask[t0:t1] = 1
    return TokenizedConversation(input_ids=ids, loss_mask=mask.tolist())
