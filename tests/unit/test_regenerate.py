"""`dflash-train regenerate`: only assistant turns change, formats are kept, runs resume."""

from __future__ import annotations

import json

import pytest

from dflash_trainer.data.regenerate import RegenerateSettings, regenerate_file
from dflash_trainer.data.responders import Response

pytestmark = pytest.mark.usefixtures("one_thread")

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "Be  brief.\n"},
        {"from": "human", "value": "Hi there  \u00e9\u4e2d "},
        {"from": "gpt", "value": "old answer 1"},
        {"from": "human", "value": "And then?\n\n"},
        {"from": "gpt", "value": "old answer 2"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "leading"}, {"from": "human", "value": "Q"},
                                  {"from": "gpt", "value": "old"}, {"from": "human", "value": "trailing"}]},
    {"id": "c", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "only"}, {"from": "gpt", "value": "y"}], "extra": [1, 2]},
]


class StubResponder:
    """Deterministic responses naming the conversation length; records every prompt it saw."""

    def __init__(self, fail_after_calls: int | None = None, truncate: set[int] | None = None):
        self.prompts: list[list[dict]] = []
        self.calls = 0
        self.fail_after_calls = fail_after_calls
        self.truncate = truncate or set()

    def __call__(self, conversations, seed):
        if self.fail_after_calls is not None and self.calls >= self.fail_after_calls:
            raise KeyboardInterrupt("simulated crash")
        self.calls += 1
        out = []
        for conv in conversations:
            self.prompts.append(conv)
            n = len(conv)
            out.append(Response(text=f"new {n} from {conv[-1]['content'].strip()}", finished=n not in self.truncate))
        return out

@pytest.fixture
def slow_responder(monkeypatch):
    """(SlowStub, clock): regenerate's clock replaced by `clock[0]`, which each wave of a SlowStub (a
    StubResponder) moves 10 "seconds" on, so a max_seconds budget runs out at a chosen wave."""
    from dflash_trainer.data import regenerate as regen_mod

    clock = [0.0]
    monkeypatch.setattr(regen_mod.time, "perf_counter", lambda: clock[0])

    class SlowStub(StubResponder):
        def __call__(self, conversations, seed):
            clock[0] += 10.0
            return super().__call__(conversations, seed)

    return SlowStub, clock


def _run(tmp_path, records, responder, suffix=".json", jsonl=False, **kw):
    data = tmp_path / f"in{suffix}"
    if jsonl:
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        data.write_text(json.dumps(records))
    out = tmp_path / f"out{suffix}"
    settings = RegenerateSettings(data=str(data), out=str(out), **kw)
    return settings, regenerate_file(settings, responder), out


def _role(t):
    return t.get("from", t.get("role"))


def test_only_assistant_turns_change(tmp_path):
    """User and system turns (and every other field) stay byte-identical; each assistant turn is
    replaced by the response to the conversation before it, built from the regenerated turns; an
    assistant turn with nothing to answer stays; a trailing user turn gets an answer of its own
    (a new turn in the record's format); unusable records are dropped and counted."""
    stub = StubResponder()
    _, report, out = _run(tmp_path, SHAREGPT, stub, batch_size=2)
    got = json.loads(out.read_text())  # a JSON array in, a JSON array out
    assert [r["id"] for r in got] == ["a", "b", "d"]
    for new in got:
        old = next(r for r in SHAREGPT if r["id"] == new["id"])
        assert set(new) == set(old) and new.get("extra") == old.get("extra")
        added = 1 if new["id"] == "b" else 0  # b ends with a user turn: answered now
        assert len(new["conversations"]) == len(old["conversations"]) + added
        for t_new, t_old in zip(new["conversations"], old["conversations"]):
            assert set(t_new) == set(t_old) and _role(t_new) == _role(t_old)
            if _role(t_old) != "gpt":
                assert t_new["value"].encode() == t_old["value"].encode()
    a = got[0]["conversations"]
    assert a[2]["value"] == "new 2 from Hi there  \u00e9\u4e2d"
    assert a[4]["value"] == "new 4 from And then?"
    second_prompt = next(p for p in stub.prompts if len(p) == 4)
    assert second_prompt[2] == {"role": "assistant", "content": a[2]["value"]}
    b = got[1]["conversations"]
    assert b[0]["value"] == "leading" and b[2]["value"] == "new 1 from Q" and b[3]["value"] == "trailing"
    assert b[4] == {"from": "gpt", "value": "new 3 from trailing"}
    assert report.skipped_by_reason == {"empty_turn": 1}
    assert report.records_written == 3 and report.regenerated_turns == 5 and report.output_format == "json"
    assert json.loads((tmp_path / "out.json.report.json").read_text())["records_written"] == 3
    assert not (tmp_path / "out.json.partial.jsonl").exists()


def test_openai_jsonl_kept_as_jsonl_with_truncated_and_failed_counts(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
               for i in range(3)]

    class Mixed(StubResponder):
        def __call__(self, conversations, seed):
            out = super().__call__(conversations, seed)
            out[0] = Response(text="", finished=False, error="prompt_too_long")
            return out

    _, report, out = _run(tmp_path, records, Mixed(truncate={1}), suffix=".jsonl", jsonl=True, batch_size=3)
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["messages"][1]["content"] == "new 1 from q1"
    assert report.failed_by_reason == {"prompt_too_long": 1}
    assert report.truncated_turns == 2 and report.truncated_records == 2 and report.output_format == "jsonl"
    # every written answer was cut (prompts of length 1 are truncated): each turn says so; users do not
    assert all(json.loads(ln)["messages"][1]["truncated"] is True for ln in lines)
    assert all("truncated" not in json.loads(ln)["messages"][0] for ln in lines)


def test_truncated_turns_are_marked_and_finished_ones_are_not(tmp_path):
    _, report, out = _run(tmp_path, SHAREGPT, StubResponder(truncate={4}))
    got = {r["id"]: r for r in json.loads(out.read_text())}
    turns = got["a"]["conversations"]
    assert "truncated" not in turns[2] and turns[4]["truncated"] is True and report.truncated_turns == 1
    assert all("truncated" not in t for rid in ("b", "d") for t in got[rid]["conversations"])
    # regenerating a regenerated file: a turn the target now finishes loses its old mark
    again = tmp_path / "again"
    again.mkdir()
    _, _, out2 = _run(again, json.loads(out.read_text()), StubResponder())
    assert all("truncated" not in t for r in json.loads(out2.read_text()) for t in r["conversations"])


def test_resume_after_crash_gives_the_same_output(tmp_path):
    """A crash after the first finished record leaves a partial file; the same command continues
    from there (no finished record generated twice) and the output equals an uninterrupted run."""
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    _, _, whole = _run(whole_dir, SHAREGPT, StubResponder(), batch_size=1)
    crash = StubResponder(fail_after_calls=2)  # record "a" needs two calls (two assistant turns)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, SHAREGPT, crash, batch_size=1)
    partial = tmp_path / "out.json.partial.jsonl"
    assert partial.exists()
    with partial.open("ab") as f:
        f.write(b'{"index": 3, "stat')  # a half-written line from the crash
    again = StubResponder()
    _, report, out = _run(tmp_path, SHAREGPT, again, batch_size=1)
    assert out.read_text() == whole.read_text()
    assert all(p[-1]["content"] != "Hi there  \u00e9\u4e2d " for p in again.prompts)  # "a" was not redone
    assert report.records_written == 3


def test_resume_reads_answers_holding_line_separators(tmp_path):
    """The partial file is JSON lines written with ensure_ascii=False: an answer holding U+2028, U+2029 or NEL
    (U+0085), which str.splitlines() would break a line at, is read back whole on resume."""
    odd = [{"id": "s", "conversations": [{"from": "human", "value": "one\u2028two\u2029three\x85four"},
                                         {"from": "gpt", "value": "old"}]},
           {"id": "t", "conversations": [{"from": "human", "value": "plain"}, {"from": "gpt", "value": "old"}]}]
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    _, _, whole = _run(whole_dir, odd, StubResponder(), batch_size=1)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, odd, StubResponder(fail_after_calls=1), batch_size=1)
    assert "\u2028" in (tmp_path / "out.json.partial.jsonl").read_text(encoding="utf-8")
    again = StubResponder()
    _, report, out = _run(tmp_path, odd, again, batch_size=1)
    assert out.read_text() == whole.read_text() and len(again.prompts) == 1 and report.records_written == 2


def test_refuses_to_overwrite_or_resume_with_other_settings(tmp_path):
    _run(tmp_path, SHAREGPT, StubResponder())
    with pytest.raises(ValueError, match="already exists"):
        _run(tmp_path, SHAREGPT, StubResponder())
    d = tmp_path / "x"
    d.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _run(d, SHAREGPT, StubResponder(fail_after_calls=1), batch_size=1)
    with pytest.raises(ValueError, match="other settings"):
        _run(d, SHAREGPT, StubResponder(), batch_size=1, max_new_tokens=7)


def test_prompt_too_long_cuts_after_the_last_regenerated_turn(tmp_path):
    """A later turn whose prompt is too long keeps the record up to the last regenerated answer
    (counted as cut); the records whose first turn fits are kept whole."""

    class LongSecondTurn(StubResponder):
        def __call__(self, conversations, seed):
            out = super().__call__(conversations, seed)
            return [Response(text="", finished=False, error="prompt_too_long") if len(c) > 3 else r
                    for c, r in zip(conversations, out)]

    _, report, out = _run(tmp_path, SHAREGPT, LongSecondTurn())
    got = json.loads(out.read_text())
    a = next(r for r in got if r["id"] == "a")
    assert [t["value"] for t in a["conversations"]] == ["Be  brief.\n", "Hi there  \u00e9\u4e2d ", "new 2 from Hi there  \u00e9\u4e2d"]
    assert report.cut_records == 1 and report.cut_turns == 2 and report.records_written == 3


def test_time_budget_keeps_the_partial_file_and_the_same_command_continues(tmp_path):
    """max_seconds stops taking records; the output holds what is done, the report says it stopped,
    and the same command without the budget finishes the file exactly as an uninterrupted run."""
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    _, _, whole = _run(whole_dir, SHAREGPT, StubResponder())
    _, report, out = _run(tmp_path, SHAREGPT, StubResponder(), max_seconds=0.0)
    assert report.stopped_at_max_seconds and report.records_written == 0 and json.loads(out.read_text()) == []
    assert (tmp_path / "out.json.partial.jsonl").exists()
    _, report, out = _run(tmp_path, SHAREGPT, StubResponder())
    assert not report.stopped_at_max_seconds and report.records_written == 3
    assert out.read_text() == whole.read_text() and not (tmp_path / "out.json.partial.jsonl").exists()


def test_drop_truncated_ends_records_before_unfinished_turns(tmp_path):
    """--drop-truncated: a turn cut by max_new_tokens is not kept; the record keeps the finished
    turns before it (cut, counted) or fails as `truncated` when its first turn was cut."""
    _, report, out = _run(tmp_path, SHAREGPT, StubResponder(truncate={4}), drop_truncated=True)
    got = {r["id"]: r for r in json.loads(out.read_text())}
    assert [t["value"] for t in got["a"]["conversations"]][-1] == "new 2 from Hi there  \u00e9\u4e2d"
    assert len(got["a"]["conversations"]) == 3 and report.cut_records == 1 and report.truncated_turns == 0
    d = tmp_path / "first"
    d.mkdir()
    _, report, out = _run(d, SHAREGPT, StubResponder(truncate={1}), drop_truncated=True)
    assert report.failed_by_reason == {"truncated": 2} and report.records_written == 1


def test_output_format_follows_the_output_name(tmp_path):
    """A JSON-array input regenerated to OUT.jsonl is written as JSONL (an array in a .jsonl file would
    not read back: the reader goes line by line there) and reads back whole; a name without either
    suffix keeps the input's format."""
    from dflash_trainer.data.chat import ReadStats, iter_conversations

    data = tmp_path / "in.json"
    data.write_text(json.dumps(SHAREGPT))
    for name, fmt in (("out.jsonl", "jsonl"), ("out.json", "json"), ("out.txt", "json")):
        report = regenerate_file(RegenerateSettings(data=str(data), out=str(tmp_path / name)), StubResponder())
        assert report.output_format == fmt
        stats = ReadStats()
        convs = list(iter_conversations(tmp_path / name, stats)) if name != "out.txt" else None
        if convs is not None:
            assert len(convs) == 3 and not stats.skipped, (name, stats.skipped)
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 3


class LoopingStub(StubResponder):
    """Like StubResponder, but the answers to conversations of the given lengths come back as
    stopped by the loop guard."""

    def __init__(self, looped: set[int]):
        super().__init__()
        self.looped = looped

    def __call__(self, conversations, seed):
        out = super().__call__(conversations, seed)
        return [Response(text=r.text, finished=len(c) not in self.looped, looped=len(c) in self.looped)
                for r, c in zip(out, conversations)]


def test_prompt_only_records_are_answered_turn_by_turn_and_loops_counted(tmp_path):
    """A record of user turns alone gets an answer after each user turn, each prompt holding the
    earlier answers; a looped answer is kept, marked `looped` (not `truncated`) and counted, per
    source too; --drop-truncated ends the record before it instead."""
    records = [{"id": "m", "source": "math", "messages": [{"role": "user", "content": "1+1?"},
                                                          {"role": "user", "content": "and 2+2?"}]},
               {"id": "c", "source": "code", "messages": [{"role": "system", "content": "S"},
                                                          {"role": "user", "content": "write f"}]}]
    stub = LoopingStub(looped={3})  # the second turn of "m" (prompt: user, assistant, user)
    _, report, out = _run(tmp_path, records, stub, suffix=".jsonl", jsonl=True, batch_size=2)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    m = got[0]["messages"]
    assert [t["role"] for t in m] == ["user", "assistant", "user", "assistant"]
    assert m[1] == {"role": "assistant", "content": "new 1 from 1+1?"}
    assert m[3] == {"role": "assistant", "content": "new 3 from and 2+2?", "looped": True}
    assert [p for p in stub.prompts if len(p) == 3][0][1] == {"role": "assistant", "content": "new 1 from 1+1?"}
    assert got[1]["messages"][2] == {"role": "assistant", "content": "new 2 from write f"}
    assert report.looped_turns == 1 and report.looped_records == 1 and report.truncated_turns == 0
    assert report.by_source == {"math": {"records": 1, "turns": 2, "looped_turns": 1},
                                "code": {"records": 1, "turns": 1, "looped_turns": 0}}
    (tmp_path / "drop").mkdir()
    _, report2, out2 = _run(tmp_path / "drop", records, LoopingStub(looped={3}), suffix=".jsonl", jsonl=True,
                            drop_truncated=True)
    assert [t["role"] for t in json.loads(out2.read_text().splitlines()[0])["messages"]] == ["user", "assistant"]
    assert report2.cut_records == 1 and report2.looped_turns == 0


def test_samples_write_one_copy_per_draw_and_settings_are_checked(tmp_path):
    """samples=2 writes each record twice with "sample": 0 / 1; keys are record · samples + sample,
    so a run that crashed after two copies resumes with exactly the other two; max_conversations
    counts records, not copies; samples > 1 at temperature 0 is refused."""
    records = [{"id": "x", "messages": [{"role": "user", "content": "hi"}]},
               {"id": "y", "messages": [{"role": "user", "content": "yo"}]},
               {"id": "z", "messages": [{"role": "user", "content": "hey"}]}]
    kw = dict(suffix=".jsonl", jsonl=True, samples=2, temperature=0.7, batch_size=1, max_conversations=2)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, records, StubResponder(fail_after_calls=2), **kw)  # x/0 and x/1 done
    again = StubResponder()
    _, report, out = _run(tmp_path, records, again, **kw)
    assert [p[-1]["content"] for p in again.prompts] == ["yo", "yo"]  # only y's two copies were left
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in got] == [("x", 0), ("x", 1), ("y", 0), ("y", 1)]
    assert report.records_written == 4 and report.regenerated_turns == 4
    # records without a str / int id (none, or 1.5: the chat reader would number each copy apart): the copies
    # of one share "input-<index>" (prepare splits by id); one sample adds none
    plain = [{"messages": r["messages"]} for r in records[:1]] + [{"id": 1.5, "messages": r["messages"]} for r in records[1:]]
    (tmp_path / "noid").mkdir()
    _, _, out = _run(tmp_path / "noid", plain, StubResponder(), **kw)
    assert [(r["id"], r["sample"]) for r in map(json.loads, out.read_text().splitlines())] == [
        ("input-0", 0), ("input-0", 1), ("input-1", 0), ("input-1", 1)]
    (tmp_path / "one").mkdir()
    _, _, out = _run(tmp_path / "one", plain, StubResponder(), **{**kw, "samples": 1})
    assert [(r.get("id"), "sample" in r) for r in map(json.loads, out.read_text().splitlines())] == [
        (None, False), (1.5, False)]
    (tmp_path / "bad").mkdir()
    for bad, match in ((dict(samples=2), "temperature"), (dict(top_p=1.5), "top_p"), (dict(loop_ngram=0), "loop_ngram")):
        with pytest.raises(ValueError, match=match):
            _run(tmp_path / "bad", records, StubResponder(), suffix=".jsonl", jsonl=True, **bad)


def test_the_packaged_sharegpt_file_is_read_up_to_its_heldout_tail(tmp_path, monkeypatch):
    """On the packaged ShareGPT file (here: a file the held-out rule is told to treat as such, with
    its tail starting at the third usable conversation), regeneration never reads the tail."""
    import dflash_trainer.data.regenerate as regen

    monkeypatch.setattr(regen, "training_conversation_limit", lambda path: 2)
    records = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
               for i in range(5)]
    records.insert(1, {"id": "prompt-only", "messages": [{"role": "user", "content": "p"}]})  # not a conversation yet
    _, report, out = _run(tmp_path, records, StubResponder(), suffix=".jsonl", jsonl=True)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["0", "prompt-only", "1"]
    assert report.stopped_at_heldout


def test_time_budget_ends_multi_turn_records_after_their_current_turn(tmp_path, slow_responder):
    """When max_seconds runs out, a record in flight is not carried through its later turns: it is
    written cut after the answer being generated (budget_cut_records, cut_turns) and no new record
    is taken. The clock is a fake that the responder moves past the budget on its first wave."""
    SlowStub, clock = slow_responder
    records = [SHAREGPT[0], SHAREGPT[3], SHAREGPT[1]]  # a: two user turns, d: one, b: not taken (batch 2)
    _, report, out = _run(tmp_path, records, SlowStub(), batch_size=2, max_seconds=5.0)
    got = {r["id"]: r for r in json.loads(out.read_text())}
    assert sorted(got) == ["a", "d"] and report.stopped_at_max_seconds
    a = got["a"]["conversations"]
    assert [t["from"] for t in a] == ["system", "human", "gpt"]  # cut after its first regenerated answer
    assert a[-1]["value"] == "new 2 from Hi there  \u00e9\u4e2d"
    assert got["d"]["conversations"][-1]["value"] == "new 1 from only"  # a one-turn record just finishes
    assert report.budget_cut_records == 1 and report.cut_records == 1 and report.cut_turns == 2
    assert report.regenerated_turns == 2 and report.records_read == 2
    _, report, out = _run(tmp_path, records, StubResponder(), batch_size=2)  # the same command, no budget left
    got = {r["id"]: r for r in json.loads(out.read_text())}
    assert sorted(got) == ["a", "b", "d"] and report.budget_cut_records == 0  # a answered again, in full
    assert [t["from"] for t in got["a"]["conversations"]] == ["system", "human", "gpt", "human", "gpt"]


def test_a_budget_stopped_run_is_continued_into_a_new_output_from_its_next_record(tmp_path, slow_responder):
    """A run stopped by max_seconds reports next_record = the index after the last record it took;
    a run with first_record = that index in a new output reads only the rest, and the two outputs
    together equal an uninterrupted run. With samples > 1 the budget never splits a record's
    samples. A negative first_record is refused."""
    SlowStub, clock = slow_responder
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    kw = dict(suffix=".jsonl", jsonl=True)
    (tmp_path / "whole").mkdir()
    _, whole_report, whole = _run(tmp_path / "whole", records, StubResponder(), **kw)
    assert whole_report.next_record is None and not whole_report.stopped_at_max_seconds
    (tmp_path / "first").mkdir()
    _, first, out1 = _run(tmp_path / "first", records, SlowStub(), batch_size=2, max_seconds=5.0, **kw)
    assert first.stopped_at_max_seconds and first.records_written == 2 and first.next_record == 2
    (tmp_path / "rest").mkdir()
    rest_stub = StubResponder()
    _, rest, out2 = _run(tmp_path / "rest", records, rest_stub, first_record=first.next_record, **kw)
    assert [p[-1]["content"] for p in rest_stub.prompts] == ["q2", "q3", "q4"]
    assert rest.first_record == 2 and rest.records_read == 3 and rest.next_record is None
    assert out1.read_text() + out2.read_text() == whole.read_text()

    clock[0] = 0.0
    (tmp_path / "samples").mkdir()
    _, sampled, out = _run(tmp_path / "samples", records, SlowStub(), batch_size=1, max_seconds=5.0,
                           samples=2, temperature=0.7, **kw)
    got = [(r["id"], r["sample"]) for r in map(json.loads, out.read_text().splitlines())]
    assert got == [("r0", 0), ("r0", 1)] and sampled.next_record == 1
    with pytest.raises(ValueError, match="first_record"):
        _run(tmp_path / "samples", records, StubResponder(), first_record=-1, **kw)


def test_a_resumed_run_stopped_by_its_budget_answers_the_gaps_before_next_record(tmp_path, slow_responder):
    """A crash leaves gaps in the partial file (records in flight lost while later ones finished).
    A resume that its budget stops still takes every gap before the last finished record, so no
    record below next_record is missing; append_continuation then joins the continuation into one
    output and one report (every record once, in order; counts summed; where it stopped)."""
    from dflash_trainer.data.regen_report import append_continuation

    SlowStub, _ = slow_responder
    two = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"},
           {"role": "assistant", "content": "b"}]
    one = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    records = [{"id": f"r{i}", "messages": two if i < 2 else one} for i in range(6)]
    kw = dict(suffix=".jsonl", jsonl=True)
    (tmp_path / "a").mkdir()
    with pytest.raises(KeyboardInterrupt):  # wave 1 finishes r2, r3; r0, r1 wait for a second turn
        _run(tmp_path / "a", records, StubResponder(fail_after_calls=1), batch_size=4, **kw)
    _, first, out = _run(tmp_path / "a", records, SlowStub(), batch_size=1, max_seconds=5.0, **kw)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == ["r0", "r1", "r2", "r3", "r4"] and first.next_record == 5  # the gaps r0, r1 taken past the budget
    (tmp_path / "b").mkdir()
    _, more, more_out = _run(tmp_path / "b", records, StubResponder(), first_record=5, **kw)
    assert more.records_written == 1 and more.next_record is None
    merged = append_continuation(out, more_out)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"r{i}" for i in range(6)]
    assert merged["records_written"] == 6 and merged["records_read"] == first.records_read + 1
    assert merged["next_record"] is None and not merged["stopped_at_max_seconds"] and merged["first_record"] == 0
    assert merged == json.loads((tmp_path / "a" / "out.jsonl.report.json").read_text())
    with pytest.raises(ValueError, match="not stopped"):  # the joined output read its whole input
        append_continuation(out, more_out)


def test_first_record_past_the_input_and_invalid_lines_before_it(tmp_path):
    """first_record beyond the input's records is refused (a continuation of another file); lines
    before first_record are not read, so an invalid line there is not counted again."""
    lines = [json.dumps({"id": "r0", "messages": [{"role": "user", "content": "q"}]}), "{not json",
             json.dumps({"id": "r2", "messages": [{"role": "user", "content": "q2"}]})]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    settings = RegenerateSettings(data=str(data), out=str(tmp_path / "o.jsonl"), first_record=2)
    report = regenerate_file(settings, StubResponder())
    assert report.records_read == 1 and report.skipped_by_reason == {} and report.records_written == 1
    with pytest.raises(ValueError, match="first_record=4: .* has only 3 records"):
        regenerate_file(RegenerateSettings(data=str(data), out=str(tmp_path / "p.jsonl"), first_record=4),
                        StubResponder())
