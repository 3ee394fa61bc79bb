"""The printed run summary says where the run's picture is (a newcomer looked for it), and summary.json's peak memory."""

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


def test_peak_memory_reads_torch_counters(monkeypatch):
    """summary.json's peak_memory_gib: torch's peak allocated / reserved bytes and the device total in
    GiB (2 decimals) on CUDA; None on the CPU."""
    import torch

    from dflash_trainer.training.finished import peak_memory

    assert peak_memory(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30 + 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 140 * 2**30})())
    assert peak_memory(torch.device("cuda", 0)) == {"allocated": 3.5, "reserved": 5.0, "total": 140.0}
