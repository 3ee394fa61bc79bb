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
