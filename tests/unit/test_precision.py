import torch

from dflash_trainer.training import precision


def test_one_precision_rule_per_device():
    """Prevents the target, the features and the drafter's autocast from disagreeing by caller:
    bf16 on CUDA, fp32 with autocast off on CPU (even inside an enclosing bf16 autocast)."""
    assert precision.compute_dtype(torch.device("cpu")) == torch.float32
    assert precision.compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    amp = precision.autocast(torch.device("cpu"))
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        for _ in range(2):  # entered once per step
            with amp:
                assert (a @ a).dtype == torch.float32


def test_a_busy_cpu_suggests_one_thread(monkeypatch):
    """Prevents the 3.5× slower default on a shared CPU going unmentioned: unset threads on a busy CPU
    (load ≥ 0.75 × cores) give a hint naming the setting; a set value is applied and gives none."""
    import os

    import pytest
    import torch

    from dflash_trainer.training.precision import set_cpu_threads

    cpu = torch.device("cpu")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))  # 3.0 ≥ 0.75 × 4
    hint = set_cpu_threads(None, cpu, "--threads 1")
    assert hint is not None and "load 3.0 on 4 cores" in hint and "--threads 1 is often" in hint
    monkeypatch.setattr(os, "getloadavg", lambda: (2.9, 0.0, 0.0))
    assert set_cpu_threads(None, cpu, "--threads 1") is None
    assert set_cpu_threads(None, torch.device("meta"), "--threads 1") is None  # not a CPU run
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0.0, 0.0))
        assert set_cpu_threads(1, cpu, "--threads 1") is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads=0"):
        set_cpu_threads(0, cpu, "--threads 1")
