"""Reading and normalizing chat files: every record is kept or counted by reason."""

import json

import pytest

from dflash_trainer.data import chat
from dflash_trainer.data.chat import ReadStats, iter_conversations


def _sg(*turns, id=None):
    rec = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if id is not None:
        rec["id"] = id
    return rec


GOOD_SHAREGPT = _sg(("human", "Hello"), ("gpt", "Hi there!"), id="a")
GOOD_OPENAI = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4"}]}


def _write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_malformed_jsonl_records_are_counted_by_reason(tmp_path):
    """Bad records are skipped and counted under their reason, never dropped silently or fatal."""
    lines = [
        GOOD_SHAREGPT,                                                      # 0 kept
        "{not json",                                                        # 1 invalid_json
        [1, 2, 3],                                                          # 2 not_an_object
        {"id": "x"},                                                        # 3 missing_conversations
        _sg(("human", "Hi"), ("gpt", "   "), id="e"),                       # 4 empty_turn
        _sg(("human", "Hi"), ("tool", "out"), ("gpt", "ok")),               # 5 unknown_role
        {"messages": [{"role": "user", "content": ["part"]},
                      {"role": "assistant", "content": "x"}]},              # 6 non_string_content
        _sg(("human", "Anyone?"), ("human", "Hello?")),                     # 7 no_assistant_turn
        _sg(("gpt", "Unprompted.")),                                        # 8 no_user_turn
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},  # 9 turn_missing_keys
        {"conversations": []},                                              # 10 empty_conversation
        GOOD_OPENAI,                                                        # 11 kept
        "",                                                                 # 12 blank line: not a record
        _sg(("gpt", "Earlier reply."), ("human", "Q"), ("gpt", "A"), ("human", "Thanks"), id="lead"),  # 13 kept
    ]
    stats = ReadStats()
    convs = list(iter_conversations(_write_jsonl(tmp_path / "d.jsonl", lines), stats))
    assert [c.id for c in convs] == ["a", "#11", "lead"]
    assert dict(stats.skipped) == {"invalid_json": 1, "not_an_object": 1, "missing_conversations": 1,
                                   "empty_turn": 1, "unknown_role": 1, "non_string_content": 1,
                                   "no_assistant_turn": 1, "no_user_turn": 1, "turn_missing_keys": 1,
                                   "empty_conversation": 1}
    assert stats.read == 13 and stats.kept == 3 and stats.read == stats.kept + stats.num_skipped
    # examples name the line as an editor counts it: index 4 is line 5
    assert stats.examples["empty_turn"] == ["line 5 id=e"] and stats.examples["invalid_json"] == ["line 2"]
    # Roles normalized; leading assistant turn and trailing user turn dropped and counted.
    assert convs[0].messages == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"}]
    assert convs[1].messages == GOOD_OPENAI["messages"]
    assert convs[2].messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert stats.leading_assistant_dropped == 1 and stats.trailing_turns_dropped == 1


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_json_array_parses_up_to_last_complete_element(tmp_path, monkeypatch, chunk):
    """A truncated array (like the embedded ShareGPT file) yields every complete record and counts the
    tail once, whatever the read-chunk boundaries are."""
    monkeypatch.setattr(chat, "_CHUNK_CHARS", chunk)
    recs = [_sg(("human", f"q{i}"), ("gpt", f"answer {i} ✓"), id=f"r{i}") for i in range(5)]
    text = "[\n" + ",\n".join(json.dumps(r, indent=2, ensure_ascii=False) for r in recs)
    path = tmp_path / "trunc.json"
    path.write_text(text + ',\n  {"id": "r5", "conversations": [{"from": "human", "val', encoding="utf-8")
    stats = ReadStats()
    convs = list(iter_conversations(path, stats))
    assert [c.id for c in convs] == [f"r{i}" for i in range(5)]
    assert convs[4].messages[1]["content"] == "answer 4 ✓"
    assert dict(stats.skipped) == {"truncated_tail": 1} and stats.read == 6

    path.write_text(text + "\n]\n", encoding="utf-8")  # the complete array: no tail
    stats = ReadStats()
    assert len(list(iter_conversations(path, stats))) == 5 and stats.num_skipped == 0 and stats.read == 5


def test_reading_is_lazy(tmp_path):
    """Stopping early must not read (or count) records beyond the ones consumed."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD_SHAREGPT] * 50))
    stats = ReadStats()
    it = iter_conversations(path, stats)
    first = [next(it) for _ in range(3)]
    assert len(first) == 3 and stats.read == 3 and stats.kept == 3


def test_skip_summary_says_what_each_reason_asks_most_common_first():
    """Hand-worked: counts by reason, most common first (ties by name), the reason's hint, up to three refs."""
    from dflash_trainer.data.chat import skip_summary
    from dflash_trainer.data.regen_report import RegenerateReport

    got = skip_summary({"unknown_role": 1, "missing_conversations": 3, "custom": 1},
                       {"missing_conversations": ["line 2", "line 5", "line 9", "line 11"], "custom": ["line 7"]})
    assert got == ("missing_conversations 3 (a record needs a 'conversations' list (ShareGPT) or a 'messages' list "
                   "(OpenAI); e.g. line 2, line 5, line 9), custom 1 (e.g. line 7), unknown_role 1 (roles are system, "
                   "human, user, gpt, assistant, chatgpt, bing, bard)")
    report = RegenerateReport(records_read=10, skipped_by_reason={"invalid_json": 2}, examples={"invalid_json": [0, 4]})
    assert report.skipped_line("record") == ("2 of 10 input records skipped, not answered: invalid_json 2 (each line must "
                                             "be one JSON object; e.g. record 1, record 5)")
    assert RegenerateReport(records_read=3).skipped_line() is None
