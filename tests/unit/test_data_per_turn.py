"""The real Qwen3 template: every assistant turn trains on exactly what serving shows for it.

Qwen3's template strips the `<think>…</think>` reasoning of assistant turns before the last user
query, writes an empty think block into the generation prompt when thinking is off, and renders the
final assistant turn with an empty block when it is on; a conversation whose single render does not
hold each turn as served becomes one document per turn: the served prompt for its history, then the
turn as the model wrote it.
"""

import json

import pytest

from dflash_trainer.data.loader import load_split
from dflash_trainer.data.per_turn import conversation_documents, per_turn_documents
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.prepare_report import load_report
from dflash_trainer.data.serving import served_response
from dflash_trainer.data.tokenize import ConversationSkipped

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
# The held-back check's conversation: a system turn, two user turns, plain answers.
REPRO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "2+3 = 5."},
    {"role": "user", "content": "And 4*5?"},
    {"role": "assistant", "content": "20."},
]
HISTORY_0 = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
HISTORY_1 = HISTORY_0 + "<|im_start|>assistant\n2+3 = 5.<|im_end|>\n<|im_start|>user\nAnd 4*5?<|im_end|>\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


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
    assert "reasoning A" not in qwen3_tok.apply_chat_template(REASONING, tokenize=False)  # the one render strips it
    out = conversation_documents(qwen3_tok, REASONING)
    assert out.expanded and len(out.documents) == 2 and out.first_unserved_turn == 0
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
    # held as one document with thinking unset: its final answer carries the block the template writes there
    plain = [*PLAIN[:3], {"role": "assistant", "content": EMPTY_THINK + "answer B"}]
    records = {"reason2": REASONING, "plain": plain, "reason3": three}
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


def supervised_texts(tok, doc):
    """The decoded maximal runs of supervised tokens of one document."""
    runs, cur = [], []
    for i, m in zip(doc.input_ids + [0], doc.loss_mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs


def test_thinking_off_trains_every_turn_after_the_empty_think_block_serving_shows(qwen3_tok):
    """With enable_thinking=False the served prompt of EVERY assistant turn
    ends with an empty think block, but the one render shows it only before the last answer; kept as
    one document (as before), turn 1 trained after `<|im_start|>assistant\n`, a prompt serving never
    shows. Now each turn is its own document, prompt tokens equal to the served ones."""
    served_0 = qwen3_tok.apply_chat_template(REPRO[:2], add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    assert served_0 == HISTORY_0 + "<|im_start|>assistant\n" + EMPTY_THINK
    assert not qwen3_tok.apply_chat_template(REPRO, tokenize=False, enable_thinking=False).startswith(served_0)
    out = conversation_documents(qwen3_tok, REPRO, enable_thinking=False)
    assert out.expanded and out.first_unserved_turn == 0
    assert [qwen3_tok.decode(d.input_ids) for d in out.documents] == [
        HISTORY_0 + "<|im_start|>assistant\n" + EMPTY_THINK + "2+3 = 5.<|im_end|>\n",
        HISTORY_1 + "<|im_start|>assistant\n" + EMPTY_THINK + "20.<|im_end|>\n"]
    check_served_turns(qwen3_tok, REPRO, out.documents, ["2+3 = 5.", "20."], enable_thinking=False)


@pytest.mark.parametrize("flag", [None, True])
def test_thinking_on_trains_the_answer_as_written_after_the_served_header(qwen3_tok, flag):
    """With thinking on (or unset) the served prompt ends at `<|im_start|>assistant\n` and an answer
    stored without a think block is what the model wrote there; the one render puts an empty block
    before the last answer, which the model did not write, so turn 2 is not held (first_unserved 1)
    and both turns become documents of their served prompt + the answer."""
    out = conversation_documents(qwen3_tok, REPRO, enable_thinking=flag)
    assert out.expanded and out.first_unserved_turn == 1
    assert [qwen3_tok.decode(d.input_ids) for d in out.documents] == [
        HISTORY_0 + "<|im_start|>assistant\n2+3 = 5.<|im_end|>\n",
        HISTORY_1 + "<|im_start|>assistant\n20.<|im_end|>\n"]
    check_served_turns(qwen3_tok, REPRO, out.documents, ["2+3 = 5.", "20."], **({} if flag is None else
                                                                               {"enable_thinking": flag}))


@pytest.mark.parametrize("flag", [None, True, False])
def test_one_document_only_where_the_render_is_what_serving_shows(qwen3_tok, flag):
    """A final answer stored with the empty block the template writes stays one document with thinking
    on/unset (the render is served prompt + answer for both turns), supervising the block the model
    writes; with thinking off the block is the served prompt's, so the answer loses it and turn 1
    still splits the conversation. A single turn with thinking off is held: the render's block is
    then exactly the prompt's, unsupervised."""
    convo = [*REPRO[:4], {"role": "assistant", "content": EMPTY_THINK + "20."}]
    extra = {} if flag is None else {"enable_thinking": flag}
    out = conversation_documents(qwen3_tok, convo, enable_thinking=flag)
    if flag is False:
        assert out.expanded and out.first_unserved_turn == 0
        assert [supervised_texts(qwen3_tok, d) for d in out.documents] == [["2+3 = 5.<|im_end|>"], ["20.<|im_end|>"]]
        (single,) = conversation_documents(qwen3_tok, REPRO[:3], enable_thinking=False).documents
        assert qwen3_tok.decode(single.input_ids) == (HISTORY_0 + "<|im_start|>assistant\n" + EMPTY_THINK
                                                      + "2+3 = 5.<|im_end|>\n")
        assert supervised_texts(qwen3_tok, single) == ["2+3 = 5.<|im_end|>"]
        return
    assert not out.expanded and out.first_unserved_turn is None
    (doc,) = out.documents
    assert qwen3_tok.decode(doc.input_ids) == HISTORY_1 + "<|im_start|>assistant\n" + EMPTY_THINK + "20.<|im_end|>\n"
    assert doc.input_ids == qwen3_tok.apply_chat_template(convo, tokenize=True, **extra)["input_ids"]
    assert supervised_texts(qwen3_tok, doc) == ["2+3 = 5.<|im_end|>", EMPTY_THINK + "20.<|im_end|>"]
    # Each turn's served document is a prefix of the one document (through its supervised tokens).
    for turn in per_turn_documents(qwen3_tok, convo, qwen3_tok.chat_template, flag):
        end = len(turn.loss_mask) - turn.loss_mask[::-1].index(1)
        assert doc.input_ids[:end] == turn.input_ids[:end]


def test_reasoning_with_thinking_off_is_refused_on_both_paths_and_counted(qwen3_tok, tmp_path):
    """Reasoning under enable_thinking=False was trained silently when the template renders it
    verbatim (a final turn: one document) and refused when it does not (an earlier turn: per turn).
    Now both are refused with the same reason, and prepare counts them."""
    reasoning = "<think>\nI add.\n</think>\n\n2+3 = 5."
    last = [*REPRO[:2], {"role": "assistant", "content": reasoning}]
    earlier = [*REPRO[:2], {"role": "assistant", "content": reasoning}, *REPRO[3:]]
    assert qwen3_tok.apply_chat_template(last, tokenize=False, enable_thinking=False).endswith(
        "<|im_start|>assistant\n" + reasoning + "<|im_end|>\n")  # the one render holds it verbatim
    for convo in (last, earlier):
        with pytest.raises(ConversationSkipped) as e:
            conversation_documents(qwen3_tok, convo, enable_thinking=False)
        assert e.value.reason == "reasoning_with_thinking_disabled"
    # With thinking on, the same reasoning is what the model writes: trained, as one document or per turn.
    on_last, on_earlier = (conversation_documents(qwen3_tok, c, enable_thinking=True) for c in (last, earlier))
    assert (on_last.expanded, on_earlier.expanded, on_earlier.first_unserved_turn) == (False, True, 0)
    assert supervised_texts(qwen3_tok, on_last.documents[0]) == [reasoning + "<|im_end|>"]
    assert [supervised_texts(qwen3_tok, d) for d in on_earlier.documents] == [[reasoning + "<|im_end|>"],
                                                                             ["20.<|im_end|>"]]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": k, "messages": v}) + "\n"
                            for k, v in {"last": last, "earlier": earlier, "plain": REPRO}.items()))
    report = prepare_dataset(data, qwen3_tok, tmp_path / "out", seq_len=256, validation_fraction=0.0,
                             enable_thinking=False)
    assert (report.conversations_read, report.conversations_kept) == (3, 1)
    assert report.skipped_by_reason == {"reasoning_with_thinking_disabled": 2}
    assert report.skip_examples == {"reasoning_with_thinking_disabled": ["line 1 id=last", "line 2 id=earlier"]}
    assert (report.expanded_per_turn, report.expanded_per_turn_documents) == (1, 2)
    only_reasoning = tmp_path / "reasoning.jsonl"
    only_reasoning.write_text(json.dumps({"messages": last}) + "\n")
    with pytest.raises(ValueError, match=r"reasoning_with_thinking_disabled': 1}\); the answers reason but "
                                         r"enable_thinking is false: set enable_thinking true"):
        prepare_dataset(only_reasoning, qwen3_tok, tmp_path / "out2", seq_len=256, enable_thinking=False)
