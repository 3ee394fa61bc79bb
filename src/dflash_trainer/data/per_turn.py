"""The training documents of one conversation: every assistant turn exactly as a server shows it.

The rule, for every template and `enable_thinking`: the training text of assistant turn i is the
served prompt for messages[:i] (the template with the generation prompt) followed by the turn as the
model generates it and the template's end of turn, with loss on those last two only
(data/serving.py). As tokens:

  turn_document(i) = prompt_ids(prompt_i) + reply_tokens(response_i + trailer_i)

A conversation stays ONE document, render(messages) tokenized once, only when that document holds
every turn's document (`one_document`); its loss mask is then exactly the turns' reply masks, so
both forms train the same tokens after the same context. Otherwise it becomes one document per
assistant turn (`expanded`; a conversation of n assistant turns then repeats its history n times).
What makes the one render differ from serving: Qwen3 strips `<think>…</think>` from turns before
the last user query; with enable_thinking=False its served prompt ends with an empty
`<think>\\n\\n</think>\\n\\n` that its render of the conversation shows for the last turn only; with
thinking on or unset it renders the last turn with an empty block the model did not write (an
answer stored without one); templates that trim content (Llama 3, Gemma) drop whitespace the model
wrote; a response that starts with a newline merges with the header's newline into one token.

A turn serving cannot show (data/serving.py: template_error, template_alters_content,
template_without_generation_prompt, reasoning_with_thinking_disabled) raises ConversationSkipped
for the whole conversation, whichever form it would have taken: the two forms never decide
differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_trainer.data.serving import ServedTurn, reply_tokens, served_turns
from dflash_trainer.data.tokenize import (TokenizedConversation, encode_offsets, prompt_ids, render,
                                          resolve_chat_template)


@dataclass
class ConversationDocuments:
    """The documents of one conversation: one (`expanded` False) or one per assistant turn, in turn
    order. `first_unserved_turn`: when expanded, the index (among assistant turns) of the first turn
    the one render did not hold as served; None when not expanded."""

    documents: list[TokenizedConversation]
    expanded: bool
    first_unserved_turn: int | None = None


def turn_document(tokenizer: Any, turn: ServedTurn) -> TokenizedConversation:
    """The served prompt's tokens (loss 0), then the reply's (`reply_tokens`)."""
    ids = prompt_ids(tokenizer, turn.prompt)
    reply = reply_tokens(tokenizer, turn)
    return TokenizedConversation(input_ids=ids + reply.input_ids, loss_mask=[0] * len(ids) + reply.loss_mask)


def per_turn_documents(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str,
                       enable_thinking: bool | None = None) -> list[TokenizedConversation]:
    """One `turn_document` per assistant turn, in turn order (ConversationSkipped as serving.py raises)."""
    return [turn_document(tokenizer, t) for t in served_turns(tokenizer, messages, chat_template, enable_thinking)]


def _added_token_ids(tokenizer: Any) -> np.ndarray:
    """int64 ids of the tokenizer's added tokens (turn markers and other special tokens), which split
    its input before anything else; empty when it is told not to split them."""
    if getattr(tokenizer, "split_special_tokens", False):
        return np.zeros(0, dtype=np.int64)
    return np.fromiter(getattr(tokenizer, "added_tokens_decoder", {}), dtype=np.int64)


def one_document(tokenizer: Any, text: str,
                 turns: Sequence[ServedTurn]) -> tuple[TokenizedConversation | None, int | None]:
    """(document, None) when `text`, the conversation rendered once, holds every turn of `turns` as
    served, else (None, j) for the first turn j it does not hold.

    With ids/offsets = `text` tokenized once, turn j (prompt P, reply R = `reply_tokens`, e = one past
    R's last supervised token) is held when
      1. text starts with P followed by the turn's supervised text;
      2. ids[:t] == prompt_ids(P), t = the first token starting at or after len(P) (a token across
         len(P) makes them differ). Compared on the stretch from the last added token before t: a
         tokenizer splits its input at added tokens (turn markers) first and tokenizes each stretch
         between them on its own, so the ids before that token are P's already; from the start
         where there is none. Differences come from tokenizers whose tokens depend on where a text
         ends or starts (normalizers, pre-tokenizer look-aheads, a prefix space);
      3. ids[t:t + e] == R.input_ids[:e].
    The document's mask is 1 on exactly those reply tokens: `turn_document`'s supervision.
    """
    ids, starts, _ = encode_offsets(tokenizer, text)  # [tokens], first char of each token [tokens]
    mask = np.zeros(len(ids), dtype=np.int8)
    added = np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), _added_token_ids(tokenizer)))  # token indices
    for j, turn in enumerate(turns):
        b = len(turn.prompt)
        if not (text.startswith(turn.prompt) and text.startswith(turn.supervised_text, b)):
            return None, j
        t = int(np.searchsorted(starts, b, side="left"))  # first token starting at or after the prompt's end
        n = int(np.searchsorted(added, t))  # added tokens before t
        a, c = (int(added[n - 1]), int(starts[added[n - 1]])) if n else (0, 0)
        if prompt_ids(tokenizer, text[c:b]) != ids[a:t]:
            return None, j
        reply = reply_tokens(tokenizer, turn)
        supervised = np.flatnonzero(reply.loss_mask)
        e = int(supervised[-1]) + 1 if len(supervised) else 0
        if ids[t:t + e] != reply.input_ids[:e]:
            return None, j
        mask[t:t + e] = reply.loss_mask[:e]
    return TokenizedConversation(input_ids=ids, loss_mask=mask.tolist()), None


def conversation_documents(tokenizer: Any, messages: Sequence[dict[str, str]], *, chat_template: str | None = None,
                           enable_thinking: bool | None = None) -> ConversationDocuments:
    """The conversation as one document when its single render holds every assistant turn as served
    (`one_document`), else one `turn_document` per assistant turn.

    `chat_template` None = the tokenizer's own (ValueError if it has none or the tokenizer is not a
    fast one); `enable_thinking` None = not passed to the template. Raises ConversationSkipped
    (reason = the count key) when a turn cannot be served, in either form.
    """
    template = resolve_chat_template(tokenizer, chat_template)
    turns = served_turns(tokenizer, messages, template, enable_thinking)
    doc, first_unserved = one_document(tokenizer, render(tokenizer, messages, template, enable_thinking), turns)
    if doc is not None:
        return ConversationDocuments([doc], expanded=False)
    return ConversationDocuments([turn_document(tokenizer, t) for t in turns], expanded=True,
                                 first_unserved_turn=first_unserved)
