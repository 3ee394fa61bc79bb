"""Loss masks from the target's own chat template: exactly the assistant content + end of turn."""


import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.per_turn import conversation_documents
from dflash_trainer.data.tokenize import (ConversationSkipped, encode_offsets, prompt_ids, prompt_ids_batch, render,
                                         served_prompt, tokenize_spans)


def tokenize_conversation(tok, messages, **kw):
    """The conversation's single document (asserts it was not split per turn)."""
    out = conversation_documents(tok, messages, **kw)
    assert not out.expanded, f"split per turn at turn {out.first_unserved_turn}"
    (doc,) = out.documents
    return doc

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there!"},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
]

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def tiny_tokenizer(chat_template=LLAMA3_TEMPLATE):
    """A word-level fast tokenizer with Llama-3 special tokens (offsets are exact character spans)."""
    words = ["[UNK]", "system", "user", "assistant", "You", "are", "terse", "Hello", "Hi", "there", "!", "How",
             "you", "?", "Fine", ",", "thanks", ".", "<", "think", ">", "/"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  unk_token="[UNK]", additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])
    tok.chat_template = chat_template
    return tok


def supervised_runs(tok, ids, mask):
    """Maximal runs of supervised tokens, as token strings."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_chatml_mask_is_assistant_content_and_im_end(smollm2_tok):
    """The mask covers `Hi there!<|im_end|>` of each assistant turn and nothing of the system/user
    turns or the `<|im_start|>assistant\\n` header (a shifted or header-including mask trains the
    drafter on tokens the served model never generates)."""
    out = tokenize_conversation(smollm2_tok, CONVERSATION)
    assert len(out.input_ids) == len(out.loss_mask)
    runs = supervised_runs(smollm2_tok, out.input_ids, out.loss_mask)
    assert [smollm2_tok.decode(r) for r in runs] == ["Hi there!<|im_end|>", "Fine, thanks.<|im_end|>"]
    text = smollm2_tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert smollm2_tok.decode(out.input_ids) == text  # rendered once, no special tokens added twice
    unsupervised = smollm2_tok.decode([i for i, m in zip(out.input_ids, out.loss_mask) if not m])
    assert unsupervised == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                            "<|im_start|>assistant\n\n<|im_start|>user\nHow are you?<|im_end|>\n"
                            "<|im_start|>assistant\n\n")


def test_chatml_default_system_prompt_stays_unsupervised(smollm2_tok):
    """SmolLM2's template inserts a default system prompt when none is given; it must not shift spans."""
    out = tokenize_conversation(smollm2_tok, CONVERSATION[1:3])
    runs = supervised_runs(smollm2_tok, out.input_ids, out.loss_mask)
    assert [smollm2_tok.decode(r) for r in runs] == ["Hi there!<|im_end|>"]
    assert "helpful AI assistant" in smollm2_tok.decode(out.input_ids)


def test_llama3_style_mask_uses_eot_marker():
    """With different markers (Llama-3 headers, `<|eot_id|>`) the mask is still exactly content +
    end-of-turn token; BOS appears once."""
    tok = tiny_tokenizer()
    out = tokenize_conversation(tok, CONVERSATION)
    runs = supervised_runs(tok, out.input_ids, out.loss_mask)
    assert [tok.convert_ids_to_tokens(r) for r in runs] == [["Hi", "there", "!", "<|eot_id|>"],
                                                           ["Fine", ",", "thanks", ".", "<|eot_id|>"]]
    tokens = tok.convert_ids_to_tokens(out.input_ids)
    assert tokens.count("<|begin_of_text|>") == 1 and tokens[0] == "<|begin_of_text|>"
    assert tokens[:4] == ["<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>"]


def test_trimmed_content_trains_what_the_model_wrote():
    """A template that trims content renders `  Fine, thanks. \\n` as `Fine, thanks.`; the model wrote
    the spaces, so the one render does not hold that turn (turn 1 of 2) and the conversation is split
    per turn, the turn's text verbatim after the served header."""
    tok = tiny_tokenizer()
    convo = [dict(m) for m in CONVERSATION]
    convo[4]["content"] = "  Fine, thanks. \n"
    out = conversation_documents(tok, convo)
    assert out.expanded and out.first_unserved_turn == 1
    text = render(tok, convo[:4], LLAMA3_TEMPLATE, add_generation_prompt=True) + "  Fine, thanks. \n<|eot_id|>"
    assert out.documents[1].input_ids == tok(text, add_special_tokens=False)["input_ids"]


def test_final_turn_rendered_differently_from_history():
    """A template that renders the final assistant turn with an empty think block (Qwen3-like): the
    one render shows the block before the last answer, which the model wrote after a bare header, so
    the last turn is not held (first_unserved_turn 2) and every document is its served prompt + the
    answer as written, also the answer that follows another assistant turn."""
    template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
                "{{ m['content'] }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    tok = tiny_tokenizer(template)
    convo = [*CONVERSATION, {"role": "assistant", "content": "Hi!"}]
    out = conversation_documents(tok, convo)
    assert out.expanded and out.first_unserved_turn == 2 and len(out.documents) == 3
    assert [[tok.convert_ids_to_tokens(r) for r in supervised_runs(tok, d.input_ids, d.loss_mask)]
            for d in out.documents] == [[["Hi", "there", "!", "<|eot_id|>"]],
                                        [["Fine", ",", "thanks", ".", "<|eot_id|>"]], [["Hi", "!", "<|eot_id|>"]]]
    # The last turn's served prompt is what this template shows a server (it renders the history's
    # final assistant turn with the block); the answer follows the bare header, as the model wrote it.
    assert tok.convert_ids_to_tokens(out.documents[2].input_ids)[-13:] == [
        "think", ">", "Fine", ",", "thanks", ".", "<|eot_id|>", "<|start_header_id|>", "assistant", "<|end_header_id|>",
        "Hi", "!", "<|eot_id|>"]


def test_content_repeated_in_user_turn_is_not_matched():
    """An assistant reply that repeats the user's text is supervised in the assistant turn, not in
    the user turn that precedes it (both end with the same marker)."""
    tok = tiny_tokenizer()
    convo = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello"}]
    out = tokenize_conversation(tok, convo)
    assert tok.convert_ids_to_tokens(out.input_ids) == ["<|begin_of_text|>", "<|start_header_id|>", "user",
                                                        "<|end_header_id|>", "Hello", "<|eot_id|>",
                                                        "<|start_header_id|>", "assistant", "<|end_header_id|>",
                                                        "Hello", "<|eot_id|>"]
    assert out.loss_mask == [0] * 9 + [1, 1]


def test_missing_template_names_the_fix_and_explicit_template_works():
    """A tokenizer without a chat template fails with the option that fixes it, not deep in Jinja."""
    tok = tiny_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="--chat-template"):
        tokenize_conversation(tok, CONVERSATION)
    out = tokenize_conversation(tok, CONVERSATION, chat_template=LLAMA3_TEMPLATE)
    assert sum(out.loss_mask) == 9


def test_enable_thinking_reaches_the_template_only_when_set():
    """The thinking flag is passed through (training and serving must render the same), and None
    leaves the template's own default."""
    template = ("{% if enable_thinking is defined %}[{{ enable_thinking }}]{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}")
    tok = tiny_tokenizer(template)
    texts = {flag: render(tok, CONVERSATION[1:3], template, flag) for flag in (None, False, True)}
    assert texts[None].startswith("user: Hello")
    assert texts[False].startswith("[False]user") and texts[True].startswith("[True]user")


def test_unrenderable_or_rewritten_conversations_are_skips():
    """Template errors, templates that rewrite content and templates without a generation prompt (a
    server could not start an assistant turn) become countable skips, not crashes or silently wrong
    masks."""
    raising = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConversationSkipped) as e:
        tokenize_conversation(tiny_tokenizer(raising), CONVERSATION)
    assert e.value.reason == "template_error"
    upper = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}<|eot_id|>{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConversationSkipped) as e:
        tokenize_conversation(tiny_tokenizer(upper), CONVERSATION)
    assert e.value.reason == "template_alters_content"
    no_prompt = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
    with pytest.raises(ConversationSkipped, match="--chat-template") as e:
        tokenize_conversation(tiny_tokenizer(no_prompt), CONVERSATION)
    assert e.value.reason == "template_without_generation_prompt"


def test_mask_matches_character_loop_on_multibyte_text(smollm2_tok):
    """The vectorized char-span → token mapping equals a plain per-token overlap loop, also where
    byte-level BPE splits one character into several tokens with the same offsets."""
    convo = [{"role": "user", "content": "Say 你好 and 🙂🙂 please"},
             {"role": "assistant", "content": "你好 🙂🙂🙂 — naïve café ✓"},
             {"role": "user", "content": "again"},
             {"role": "assistant", "content": " 🙂 leading space and trailing space "}]
    out = tokenize_conversation(smollm2_tok, convo)
    text = render(smollm2_tok, convo, smollm2_tok.chat_template)
    spans = [(text.index(m["content"] + "<|im_end|>"), text.index(m["content"] + "<|im_end|>") + len(m["content"]) + 10)
             for m in convo[1::2]]
    ids, starts, ends = encode_offsets(smollm2_tok, text)
    slow = [int(any(a < hi and b > lo for lo, hi in spans)) for a, b in zip(starts.tolist(), ends.tolist())]
    assert tokenize_spans(smollm2_tok, text, spans).loss_mask == slow
    assert ids == out.input_ids and out.loss_mask == slow
    assert np.count_nonzero(np.diff(starts) == 0) > 0  # some characters are several tokens (same offsets)
    runs = supervised_runs(smollm2_tok, out.input_ids, out.loss_mask)
    assert [smollm2_tok.decode(r) for r in runs] == ["你好 🙂🙂🙂 — naïve café ✓<|im_end|>",
                                                 " 🙂 leading space and trailing space <|im_end|>"]


def test_prompts_tokenized_in_one_call_equal_one_call_each(smollm2_tok):
    """The regeneration tokenizes the prompts queued since its last look in one call (`prompt_ids_batch`, the
    tokenizer's threads): the ids equal `prompt_ids` of each text, for prompts of different lengths (no
    padding), multi-turn ones and text with special-token look-alikes; an empty batch gives []."""
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 × 7 = ?" * 40}],
             [{"role": "user", "content": "write <|im_end|> literally, then\n\n  indent\tx"}]]
    template = smollm2_tok.chat_template
    texts = [served_prompt(smollm2_tok, c, template) for c in convs]
    got = prompt_ids_batch(smollm2_tok, texts)
    assert got == [prompt_ids(smollm2_tok, t) for t in texts]
    assert len({len(g) for g in got}) == 3 and prompt_ids_batch(smollm2_tok, []) == []
