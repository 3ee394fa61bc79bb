"""Reasoning chats under the real Qwen3 template: one document per assistant turn, each exactly as served.

Qwen3's template strips the `<think>…</think>` reasoning of assistant turns before the last user
query, so such a conversation has no single faithful render; each turn becomes its own document:
the served prompt for its history, then the turn as the model wrote it.
"""

import json

import pytest

from dflash_trainer.data.loader import load_split
from dflash_trainer.data.per_turn import conversation_documents, per_turn_documents, served_response
from dflash_trainer.data.prepare import load_report, prepare_dataset
from dflash_trainer.data.tokenize import ConversationSkipped, tokenize_conversation

REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>reasoning A</think>answer A"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>reasoning B</think>answer B"},
]
PLAIN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "answer A"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "answer B"},
]


def split_document(tok, doc):
    """(prefix ids before the first supervised token, supervised ids, ids after them); asserts the
    supervised tokens form one run."""
    first = doc.loss_mask.index(1)
    last = len(doc.loss_mask) - doc.loss_mask[::-1].index(1)
    assert all(doc.loss_mask[first:last]), "supervised tokens must be one run"
    return doc.input_ids[:first], doc.input_ids[first:last], doc.input_ids[last:]


def served_prompt(tok, history, **flags):
    """(text, ids) of the prompt a server renders for the next assistant turn after `history`."""
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False, **flags)
    ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, **flags)["input_ids"]
    return text, list(ids)


def check_served_turns(tok, messages, docs, responses, **flags):
    """Each document = the served prompt of its history, then exactly `response + <|im_end|>`
    supervised, then the unsupervised newline after it."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(docs) == len(turns) == len(responses)
    for doc, i, response in zip(docs, turns, responses):
        assert len(doc.input_ids) == len(doc.loss_mask)
        prefix, supervised, after = split_document(tok, doc)
        prompt_text, prompt_ids = served_prompt(tok, messages[:i], **flags)
        assert tok.decode(prefix) == prompt_text
        assert prefix == prompt_ids
        assert tok.decode(supervised) == response + "<|im_end|>"
        assert tok.decode(after) == "\n"


def test_reasoning_turns_become_one_document_each(qwen3_tok):
    """A 2-turn chat with reasoning in both turns is kept as 2 documents (it was skipped whole as
    template_alters_content, so multi-turn reasoning data trained nothing); each document supervises
    exactly the turn as the model wrote it, think block included, after exactly the served prompt."""
    with pytest.raises(ConversationSkipped) as e:
        tokenize_conversation(qwen3_tok, REASONING)
    assert e.value.reason == "template_alters_content"
    out = conversation_documents(qwen3_tok, REASONING)
    assert out.expanded and len(out.documents) == 2
    check_served_turns(qwen3_tok, REASONING, out.documents,
                       ["<think>reasoning A</think>answer A", "<think>reasoning B</think>answer B"])
    d1, d2 = (qwen3_tok.decode(d.input_ids) for d in out.documents)
    assert d1 == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
                  "<think>reasoning A</think>answer A<|im_end|>\n")
    # Turn 2 sees turn 1 as the server shows it: reasoning stripped by the template.
    assert d2 == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nanswer A<|im_end|>\n"
                  "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
                  "<think>reasoning B</think>answer B<|im_end|>\n")
    think_id = qwen3_tok.convert_tokens_to_ids("<think>")
    assert [d.input_ids.count(think_id) for d in out.documents] == [1, 1]


def test_thinking_disabled_prompt_holds_the_empty_think_block(qwen3_tok):
    """With enable_thinking=False the served prompt already ends with `<think>\\n\\n</think>\\n\\n`:
    the response is only the answer. Content stored with that empty block (which the template strips
    from earlier turns) loses it instead of repeating it; content that reasons under that flag is a
    counted skip, not training data the served model never produces."""
    stored = [dict(m) for m in PLAIN]
    stored[1]["content"] = "<think>\n\n</think>\n\nanswer A"
    out = conversation_documents(qwen3_tok, stored, enable_thinking=False)
    assert out.expanded and len(out.documents) == 2
    check_served_turns(qwen3_tok, stored, out.documents, ["answer A", "answer B"], enable_thinking=False)
    assert qwen3_tok.decode(out.documents[0].input_ids) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "answer A<|im_end|>\n")
    # A response without a think block, per turn: the same documents.
    assert per_turn_documents(qwen3_tok, PLAIN, qwen3_tok.chat_template, enable_thinking=False) == out.documents
    with pytest.raises(ConversationSkipped) as e:
        conversation_documents(qwen3_tok, REASONING, enable_thinking=False)
    assert e.value.reason == "reasoning_with_thinking_disabled"


@pytest.mark.parametrize("flag", [None, False, True])
def test_plain_conversation_stays_one_document(qwen3_tok, flag):
    """A conversation the template renders faithfully stays one document with the tokens and mask
    of `tokenize_conversation` (expansion must not change existing data)."""
    out = conversation_documents(qwen3_tok, PLAIN, enable_thinking=flag)
    assert not out.expanded
    assert out.documents == [tokenize_conversation(qwen3_tok, PLAIN, enable_thinking=flag)]
    (doc,) = out.documents
    assert qwen3_tok.decode(doc.input_ids) == qwen3_tok.apply_chat_template(PLAIN, tokenize=False)
    runs, cur = [], []
    for i, m in zip(doc.input_ids + [0], doc.loss_mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [qwen3_tok.decode(cur)], []
    assert runs == ["answer A<|im_end|>", "answer B<|im_end|>"]


def test_chatml_conversation_stays_one_document(smollm2_tok):
    """SmolLM2's ChatML template renders every turn as written: one document, as before."""
    out = conversation_documents(smollm2_tok, PLAIN)
    assert not out.expanded and out.documents == [tokenize_conversation(smollm2_tok, PLAIN)]


def test_response_starting_with_newline_keeps_the_served_prompt_tokens(qwen3_tok):
    """The prompt is tokenized on its own: one tokenization of prompt + response would merge the
    header's newline with the response's leading newline into one token (`ĊĊ`), so the document's
    prompt would differ from the served one and a header character would be supervised."""
    convo = [dict(m) for m in REASONING]
    convo[1]["content"] = "\n<think>reasoning A</think>answer A"
    out = conversation_documents(qwen3_tok, convo)
    check_served_turns(qwen3_tok, convo, out.documents,
                       ["\n<think>reasoning A</think>answer A", "<think>reasoning B</think>answer B"])
    prompt_text, _ = served_prompt(qwen3_tok, convo[:1])
    once = qwen3_tok(prompt_text + convo[1]["content"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert once != out.documents[0].input_ids  # the boundary merge this design avoids


def test_served_response_rules():
    """What the model generates after the generation prompt: the prompt's own reasoning block is
    never part of the response, any other content is kept verbatim."""
    bare, closed, opened = "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "A:<think>\n"
    assert served_response("<think>r</think>a", bare) == "<think>r</think>a"
    assert served_response("<think>\n\n</think>\n\nanswer", closed) == "answer"
    assert served_response("<think></think>answer", closed) == "answer"
    assert served_response("answer", closed) == "answer"
    assert served_response("<think>\nr</think>a", opened) == "r</think>a"
    assert served_response("<think>r</think>a", opened) == "r</think>a"
    with pytest.raises(ConversationSkipped, match="reasoning_with_thinking_disabled"):
        served_response("<think>r</think>a", closed)


def test_prepare_counts_and_packs_per_turn_documents(qwen3_tok, tmp_path):
    """prepare keeps reasoning chats as per-turn documents, counts them in the report and the data
    line, packs every document into the rows, and keeps all documents of one conversation in one
    split (else validation would see turns of a training conversation)."""
    three = [*REASONING, {"role": "user", "content": "And 4+4?"},
             {"role": "assistant", "content": "<think>reasoning C</think>answer C"}]
    records = {"reason2": REASONING, "plain": PLAIN, "reason3": three}
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": k, "messages": v}) + "\n" for k, v in records.items()))
    report = prepare_dataset(data, qwen3_tok, tmp_path / "out", seq_len=256, validation_fraction=0.34, seed=0)
    assert report.conversations_kept == 3 and report.conversations_skipped == 0
    assert report.expanded_per_turn == 2 and report.expanded_per_turn_documents == 5
    assert report.train.documents + report.validation.documents == 6
    assert "2 expanded to 5 per-turn documents" in report.summary_line()
    assert load_report(tmp_path / "out") == report
    on_disk = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert (on_disk["expanded_per_turn"], on_disk["expanded_per_turn_documents"]) == (2, 5)

    expected = {k: {tuple(d.input_ids): tuple(d.loss_mask) for d in conversation_documents(qwen3_tok, v).documents}
                for k, v in records.items()}
    (val_id,) = report.validation_ids
    for split, ids in (("validation", [val_id]), ("train", [k for k in records if k != val_id])):
        packed = {}
        for row in load_split(tmp_path / "out", split):
            ids_, mask, pos = row["input_ids"].tolist(), row["loss_mask"].tolist(), row["position_ids"].tolist()
            starts = [p for p in range(len(pos)) if pos[p] == 0] + [len(pos)]
            packed.update({tuple(ids_[a:b]): tuple(mask[a:b]) for a, b in zip(starts, starts[1:]) if any(mask[a:b])})
        assert packed == {d: m for k in ids for d, m in expected[k].items()}, split
