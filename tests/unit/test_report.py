"""`dflash-train report`: one PNG from metrics.jsonl (+ summary.json), for finished and running runs."""

import json
import subprocess
import sys

import pytest

from dflash_trainer.telemetry.report import write_report, write_report_safely

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rank(rank: int, role: str, busy: float | None, wait: float, step: int) -> dict:
    """One entry of a record's "ranks" list, shaped like telemetry.rank_rates.rates()."""
    return {"rank": rank, "role": role, "device": f"cuda:{rank}", "seconds": 2.0, "tok_per_s": 4000.0 + 10 * step,
            "items": 4, "wait_pct": wait, "transfer_pct": 1.5, "occupancy_mean": 1.5 if role == "drafter" else None,
            "busy_pct": busy, "nvml_util_pct": None}


def _records(num: int = 10, log_every: int = 5) -> list[dict]:
    """Records as drafter_rank._Logger.write writes them: a target rank 0 and a drafter rank 1."""
    out = []
    for i in range(1, num + 1):
        step = i * log_every
        acc = [0.6 - 0.1 * k + 0.02 * i for k in range(3)]
        out.append({"step": step, "loss": 5.0 / (1 + 0.3 * i), "tokens": step * 4096, "tok_per_s": 4000.0 + 50 * i,
                    "skipped_steps": 0, "acc_per_position": acc, "tau_estimate": 1.0 + acc[0] + acc[0] * acc[1],
                    "tau_exact": 1.1 + 0.05 * i, "lr": 1e-3, "elapsed_s": 2.0 * i,
                    "ranks": [_rank(0, "target", 60.0 + 3 * i, 30.0 - 2 * i, step), _rank(1, "drafter", 95.0 - i, 2.0, step)]})
    return out


def _write_run(folder, records, summary=None, tail: str = ""):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 10_000 and data.startswith(PNG_MAGIC)


def test_report_of_a_two_rank_run_is_a_png(tmp_path):
    """Prevents a report that silently writes nothing for process layouts (rank rows in records)."""
    run = _write_run(tmp_path / "run", _records(),
                     summary={"validation": {"loss": 2.1, "acc_per_position": [0.7, 0.5, 0.3]}})
    path = write_report(run)
    assert path == run / "report.png"
    assert _is_png(path)


def test_report_of_a_running_run_skips_the_half_written_line(tmp_path):
    """Prevents `report` on a live run from crashing on the line the trainer is writing right now."""
    records = _records(4)
    half = json.dumps(_records(5)[-1])[:57]  # cut mid-record, no newline: a write in progress
    run = _write_run(tmp_path / "run", records, tail=half)
    path = write_report(run, tmp_path / "elsewhere" / "live.png")
    assert _is_png(path)
    assert not list((tmp_path / "elsewhere").glob(".*.tmp"))  # written through a temporary name


def test_report_without_ranks_and_with_null_values(tmp_path):
    """Co-located records (no "ranks") with None metrics (an interval of skipped steps) still plot."""
    records = [{k: v for k, v in r.items() if k != "ranks"} for r in _records(3)]
    records[1].update(loss=None, tau_estimate=None, tau_exact=None, acc_per_position=[None, None, None])
    assert _is_png(write_report(_write_run(tmp_path / "run", records)))


def test_report_errors_name_the_problem(tmp_path):
    """No metrics.jsonl → FileNotFoundError; only a half line → ValueError; at the end of a run neither
    is raised but reported through warn."""
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)
    _write_run(tmp_path, [], tail='{"step": 1, "lo')
    with pytest.raises(ValueError, match="no complete record"):
        write_report(tmp_path)
    warnings = []
    assert write_report_safely(tmp_path, warnings.append) is None
    assert len(warnings) == 1 and "dflash-train report" in warnings[0]


def test_report_cli(tmp_path):
    """`dflash-train report RUN_DIR` writes RUN_DIR/report.png; a folder with no run exits 2 with one line."""
    run = _write_run(tmp_path / "run", _records(3))
    ok = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "report", str(run)], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert _is_png(run / "report.png")
    bad = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "report", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "metrics.jsonl" in bad.stdout + bad.stderr


def test_save_png_writes_the_format_its_suffix_names(tmp_path):
    """Prevents a plot asked for as .svg or .pdf from holding PNG bytes: the suffix picks the format,
    PNG without one."""
    from dflash_trainer.telemetry.report import new_figure, save_png

    fig = new_figure((2, 2))
    fig.subplots().plot([0, 1], [1, 0])
    heads = {name: save_png(fig, tmp_path / name).read_bytes()[:8] for name in ("a.png", "b.svg", "c.pdf", "d")}
    assert heads["a.png"].startswith(b"\x89PNG") and heads["d"].startswith(b"\x89PNG")
    assert heads["b.svg"].startswith(b"<?xml") and heads["c.pdf"].startswith(b"%PDF")
