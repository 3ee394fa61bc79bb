"""One rule for every template: each assistant turn trains on the served prompt + the turn as written.

The check that keeps a conversation as one document (per_turn.one_document) is a fast path; here it
is held against the obvious one (tokenize the whole render and every per-turn document, compare
prefixes and masks) on real ShareGPT conversations under SmolLM2, Qwen3 (thinking unset, on, off),
a Qwen2.5-style and a Gemma-style template; plus hand-worked documents for the two new template
styles and the regeneration prompts.
"""

import itertools
import json

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from test_data_per_turn import REPRO, supervised_texts

from dflash_trainer.data.chat import ReadStats, iter_conversations, normalize_record
from dflash_trainer.data.per_turn import conversation_documents, per_turn_documents
from dflash_trainer.data.regenerate import RegenerateSettings, regenerate_file
from dflash_trainer.data.sources import default_sharegpt_path
from dflash_trainer.data.tokenize import ConversationSkipped, render
from dflash_trainer.data.render import render_prompt
from dflash_trainer.data.responders import Response

PLAIN = REPRO  # the held-back check's conversation
# Written for these tests after the published templates' behaviour (string content only, no tools):
# ChatML with a default system turn (Qwen2.5 / Qwen2.5-Coder), and turns named user/model with the
# system text folded into the first user turn and content trimmed (Gemma 3).
QWEN25_STYLE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba "
                "Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_STYLE = ("<bos>{% set sys = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
               "{% for m in (messages[1:] if sys else messages) %}"
               "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{{ sys if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
EDGE_CASES = [
    PLAIN,
    [*PLAIN[:2], {"role": "assistant", "content": "\n2+3 = 5."}, *PLAIN[3:]],  # leading newline
    [*PLAIN[:2], {"role": "assistant", "content": "2+3 = 5. \n"}, *PLAIN[3:]],  # trailing whitespace
    [*PLAIN[:2], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2+3 = 5."}, *PLAIN[3:]],
    [*PLAIN[:4], {"role": "assistant", "content": "<think>\n\n</think>\n\n20."}],
    [PLAIN[1], {"role": "assistant", "content": "你好 🙂🙂 — naïve"}, PLAIN[3],
     {"role": "assistant", "content": " 🙂 "}],
]


@pytest.fixture(scope="module")
def gemma_style_tok(qwen3_tok):
    """A fresh copy of the Qwen3 tokenizer (a real byte-level BPE) with Gemma's turn markers added as
    special tokens (the session-scoped qwen3_tok fixture stays unchanged)."""
    tok = AutoTokenizer.from_pretrained(qwen3_tok.name_or_path)
    tok.add_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    return tok


def stripping_tokenizer(chat_template):
    """A word-level tokenizer whose normalizer strips whitespace at both ends of every stretch between
    its special tokens, and which keeps each whitespace character as a token: its tokens depend on
    where a text ends or starts, as with normalizers, look-aheads or a prefix space in real ones."""
    words = ["[UNK]", "user", "assistant", "Hello", "Hi", "!", ":", "\n", " "]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.Strip(left=True, right=True)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|\w+|[^\w\s]+"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = chat_template
    return tok


def one_render_mask(tok, messages, template, flag):
    """The obvious check: when the whole render tokenized once holds each per-turn document through
    its last supervised token, the union of their loss masks over the render's tokens; else None."""
    ids = tok(render(tok, messages, template, flag), add_special_tokens=False)["input_ids"]
    union = [0] * len(ids)
    for d in per_turn_documents(tok, messages, template, flag):
        end = len(d.loss_mask) - d.loss_mask[::-1].index(1)
        if ids[:end] != d.input_ids[:end]:
            return None
        union[:end] = [max(u, m) for u, m in zip(union[:end], d.loss_mask[:end])]
    return union


def test_one_document_check_equals_the_obvious_one(qwen3_tok, smollm2_tok, gemma_style_tok):
    """For every conversation, template and thinking flag: one document (1) exactly when the obvious
    check holds, the document then being the render tokenized once and supervised where the per-turn
    documents are; else the per-turn documents (E); a turn serving cannot show is refused both ways
    (R). Guards the windowed prompt-token check against a tokenizer whose prefix tokens differ. The
    patterns: 4 ShareGPT conversations (one has 2 assistant turns), then EDGE_CASES in order."""
    sharegpt = [c.messages for c in itertools.islice(iter_conversations(default_sharegpt_path(), ReadStats()), 7)]
    sharegpt = [sharegpt[i] for i in (1, 2, 5, 6)]  # the shorter ones (0.5K–4.8K characters)
    setups = {"smollm2": (smollm2_tok, None, None), "qwen3": (qwen3_tok, None, None),
              "qwen3-thinking": (qwen3_tok, None, True), "qwen3-no-thinking": (qwen3_tok, None, False),
              "qwen2.5-style": (qwen3_tok, QWEN25_STYLE, None), "gemma-style": (gemma_style_tok, GEMMA_STYLE, None)}
    got = {}
    for name, (tok, template, flag) in setups.items():
        template_text = template or tok.chat_template
        got[name] = ""
        for messages in sharegpt + EDGE_CASES:
            try:
                per_turn = per_turn_documents(tok, messages, template_text, flag)
            except ConversationSkipped as e:
                with pytest.raises(ConversationSkipped, match=e.reason):
                    conversation_documents(tok, messages, chat_template=template, enable_thinking=flag)
                got[name] += "R"
                continue
            out = conversation_documents(tok, messages, chat_template=template, enable_thinking=flag)
            mask = one_render_mask(tok, messages, template_text, flag)
            assert out.expanded == (mask is None), name
            if out.expanded:
                assert out.documents == per_turn
                got[name] += "E"
                continue
            (doc,) = out.documents
            rendered = render(tok, messages, template_text, flag)
            assert doc.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]
            assert doc.loss_mask == mask
            got[name] += "1"
    # Qwen3, thinking unset/on: the final plain answer follows an empty block the model did not write;
    # off: every prompt ends with the block, shown by the one render for the last turn only, and
    # reasoning in turn 1 is refused. The leading newline merges with the header's under Qwen's
    # pre-tokenizer (not SmolLM2's); the Gemma-style template trims what the model wrote.
    assert got == {"smollm2": "1111" "111111", "qwen3": "EEEE" "EEEE1E", "qwen3-thinking": "EEEE" "EEEE1E",
                   "qwen3-no-thinking": "11E1" "EEEREE", "qwen2.5-style": "1111" "1E1111",
                   "gemma-style": "1111" "1EE11E"}


def test_same_text_other_tokens_splits_the_conversation():
    """The text of the one render can be the served text while its tokens are not: a served prompt
    ending in a newline loses it when tokenized alone (as a server does) under a stripping
    normalizer, so the one render's `\\n` token is context serving never shows; and a response with a
    leading space is tokenized without it from the prompt's end. Both conversations are split per
    turn, each document exactly served prompt tokens + reply tokens."""
    convo = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    newline = stripping_tokenizer("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
                                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = conversation_documents(newline, convo)
    assert render(newline, convo, newline.chat_template).startswith(
        render(newline, convo[:1], newline.chat_template, add_generation_prompt=True) + "Hi!<|im_end|>")
    assert out.expanded and out.first_unserved_turn == 0
    (doc,) = out.documents
    assert newline.convert_ids_to_tokens(doc.input_ids) == ["<|im_start|>", "user", "\n", "Hello", "<|im_end|>",
                                                            "<|im_start|>", "assistant", "Hi", "!", "<|im_end|>"]
    assert doc.loss_mask == [0] * 7 + [1, 1, 1]
    colon = stripping_tokenizer("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>"
                                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")
    spaced = [convo[0], {"role": "assistant", "content": " Hi!"}]
    out = conversation_documents(colon, spaced)
    assert out.expanded and out.first_unserved_turn == 0
    assert colon.convert_ids_to_tokens(out.documents[0].input_ids)[-6:] == ["<|im_start|>", "assistant", ":", "Hi", "!",
                                                                            "<|im_end|>"]
    assert not conversation_documents(colon, convo).expanded  # without the space: the same tokens


def test_smollm2_chatml_stays_one_document_whatever_the_thinking_flag(smollm2_tok):
    """SmolLM2's ChatML template renders every turn as served (its default system turn included) and
    ignores enable_thinking: one document, supervised on each answer + `<|im_end|>`."""
    convo = PLAIN[1:]
    for flag in (None, False, True):
        out = conversation_documents(smollm2_tok, convo, enable_thinking=flag)
        assert not out.expanded and out.first_unserved_turn is None
        (doc,) = out.documents
        assert smollm2_tok.decode(doc.input_ids) == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n2+3 = 5.<|im_end|>\n"
            "<|im_start|>user\nAnd 4*5?<|im_end|>\n<|im_start|>assistant\n20.<|im_end|>\n")
        assert supervised_texts(smollm2_tok, doc) == ["2+3 = 5.<|im_end|>", "20.<|im_end|>"]


def test_qwen25_style_template_stays_one_document(qwen3_tok):
    """ChatML with a default system turn (Qwen2.5 / Qwen2.5-Coder style): every turn as served."""
    out = conversation_documents(qwen3_tok, PLAIN[1:], chat_template=QWEN25_STYLE)
    assert not out.expanded
    (doc,) = out.documents
    assert qwen3_tok.decode(doc.input_ids) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n2+3 = 5.<|im_end|>\n"
        "<|im_start|>user\nAnd 4*5?<|im_end|>\n<|im_start|>assistant\n20.<|im_end|>\n")
    assert supervised_texts(qwen3_tok, doc) == ["2+3 = 5.<|im_end|>", "20.<|im_end|>"]


def test_gemma_style_template_folds_the_system_turn_and_trims(gemma_style_tok):
    """Gemma-style turns (`<start_of_turn>model`, `<end_of_turn>`, system text in the first user turn):
    one document when the answers carry no surrounding whitespace; an answer the template trims is
    not what the model wrote, so that conversation is split and the turn trains verbatim."""
    tok = gemma_style_tok
    out = conversation_documents(tok, PLAIN, chat_template=GEMMA_STYLE)
    assert not out.expanded
    (doc,) = out.documents
    assert tok.decode(doc.input_ids) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n"
        "2+3 = 5.<end_of_turn>\n<start_of_turn>user\nAnd 4*5?<end_of_turn>\n<start_of_turn>model\n20.<end_of_turn>\n")
    assert supervised_texts(tok, doc) == ["2+3 = 5.<end_of_turn>", "20.<end_of_turn>"]
    padded = [*PLAIN[:2], {"role": "assistant", "content": "2+3 = 5. \n"}, *PLAIN[3:]]
    out = conversation_documents(tok, padded, chat_template=GEMMA_STYLE)
    assert out.expanded and out.first_unserved_turn == 0
    assert tok.decode(out.documents[0].input_ids) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n"
        "2+3 = 5. \n<end_of_turn>\n")
    assert [supervised_texts(tok, d) for d in out.documents] == [["2+3 = 5. \n<end_of_turn>"], ["20.<end_of_turn>"]]
    assert tok.decode(out.documents[1].input_ids).endswith(  # the next prompt shows the turn trimmed, as served
        "<start_of_turn>model\n2+3 = 5.<end_of_turn>\n<start_of_turn>user\nAnd 4*5?<end_of_turn>\n"
        "<start_of_turn>model\n20.<end_of_turn>\n")


def test_regeneration_shows_the_target_the_prompt_training_holds(qwen3_tok, tmp_path):
    """`regenerate` with thinking off: the prompt the target answers each turn from (render_prompt of
    the conversation so far, earlier answers its own) is token for token the prompt of that turn's
    training document, and the document supervises exactly the answer + `<|im_end|>`."""
    seen = []

    def respond(conversations, seed):
        seen.extend(conversations)
        return [Response(text=f"Answer {len(c)}.", finished=True) for c in conversations]

    record = {"messages": [PLAIN[0], PLAIN[1], PLAIN[3]]}  # system + two user turns: answered in turn
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps(record) + "\n")
    regenerate_file(RegenerateSettings(data=str(data), out=str(out), enable_thinking=False), respond)
    messages = normalize_record(json.loads(out.read_text()))
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["Answer 2.", "Answer 4."]
    docs = conversation_documents(qwen3_tok, messages, enable_thinking=False).documents
    assert len(docs) == len(seen) == 2
    for doc, conversation, answer in zip(docs, seen, ["Answer 2.", "Answer 4."]):
        first = doc.loss_mask.index(1)
        assert doc.input_ids[:first] == render_prompt(qwen3_tok, qwen3_tok.chat_template, conversation, False)
        assert supervised_texts(qwen3_tok, doc) == [answer + "<|im_end|>"]
