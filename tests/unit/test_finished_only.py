"""benchmarks/finished_only.py: regenerated conversations cut before the first unfinished answer."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("finished_only", ROOT / "benchmarks" / "finished_only.py")
fo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fo)

A = {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "done"},
                                  {"from": "human", "value": "q2"}, {"from": "gpt", "value": "loop loop", "truncated": True},
                                  {"from": "human", "value": "q3"}, {"from": "gpt", "value": "later"}]}
LEAD = {"id": "b", "conversations": [{"from": "gpt", "value": "leading"}, {"from": "human", "value": "q"},
                                     {"from": "gpt", "value": "cut", "truncated": True}]}
WHOLE = {"id": "c", "messages": [{"role": "user", "content": "line\u2028sep"}, {"role": "assistant", "content": "ok"}]}


def test_cut_before_the_first_unfinished_answer():
    out = fo.finished_only(A)
    assert [t["value"] for t in out["conversations"]] == ["q1", "done", "q2"] and out["id"] == "a"
    assert fo.finished_only(WHOLE) == WHOLE  # nothing unfinished: unchanged
    assert fo.finished_only(LEAD) is None  # only an answer to nothing is left: not a usable conversation


def test_reads_json_arrays_and_jsonl_with_line_separators_inside_strings(tmp_path, monkeypatch, capsys):
    for name, text in (("in.json", json.dumps([A, LEAD, WHOLE])),
                       ("in.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in (A, LEAD, WHOLE)))):
        out = tmp_path / f"{name}.out.jsonl"
        (tmp_path / name).write_text(text, encoding="utf-8")
        monkeypatch.setattr(sys, "argv", ["finished_only.py", str(tmp_path / name), str(out)])
        fo.main()
        got = [json.loads(ln) for ln in out.read_text(encoding="utf-8").split("\n") if ln]
        assert [r["id"] for r in got] == ["a", "c"] and got[1] == WHOLE
        counts = json.loads(Path(str(out) + ".counts.json").read_text())
        assert (counts["read"], counts["written"], counts["cut"], counts["dropped"]) == (3, 2, 1, 1)
