"""The printed run summary says where the run's picture is (a newcomer looked for it)."""

from __future__ import annotations

from rich.console import Console

from dflash_trainer.training.finished import RunResult, print_summary


def test_summary_names_the_report_png_when_it_exists(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-final"
    ckpt.mkdir(parents=True)
    result = RunResult(steps=4, tokens=2048, wall_s=3.0, train_tok_per_s=700.0, first_loss=9.0, last_loss=8.0,
                       validation={}, checkpoint=str(ckpt))
    console = Console(record=True, width=200)
    print_summary(result, console)
    assert "\n  report " not in console.export_text()  # no picture written: no line
    (tmp_path / "run" / "report.png").write_bytes(b"\x89PNG")
    console = Console(record=True, width=200)
    print_summary(result, console)
    assert f"report {tmp_path / 'run' / 'report.png'}" in console.export_text()
