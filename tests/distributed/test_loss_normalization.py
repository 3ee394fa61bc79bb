"""The loss is normalized by the GLOBAL weighted count of valid slots (2 drafter processes, gloo, DDP)."""

import datetime
import faulthandler
import gc
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.pipeline.drafter_rank import ReplicatedDrafter, sum_gradients_hook
from dflash_trainer.training.loop import Batch, train_step
from dflash_trainer.pipeline.launch import rank_process_context
from dflash_trainer.training.step import StepSettings

T, V, H = 128, 64, 32
# row id → valid slots (B = 2: one valid slot per valid anchor, weight 1)
ROWS = {0: 1, 1: 1, 2: 4, 3: 4}
SPLITS = {"by_size": [[0, 1], [2, 3]], "mixed": [[0, 2], [1, 3]]}


def _row(row_id: int) -> dict[str, torch.Tensor]:
    """One document; exactly ROWS[row_id] + 1 consecutive supervised tokens → ROWS[row_id] valid anchors."""
    g = torch.Generator().manual_seed(100 + row_id)
    c = ROWS[row_id]
    start = 10 + 7 * row_id
    mask = torch.zeros(T, dtype=torch.bool)
    mask[start:start + c + 1] = True
    return {"input_ids": torch.randint(0, V - 1, (T,), generator=g), "position_ids": torch.arange(T), "loss_mask": mask}


def _features(row_id: int) -> torch.Tensor:
    return torch.randn(T, 2 * H, generator=torch.Generator().manual_seed(200 + row_id))


def _drafter() -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, vocab_size=V, block_size=2, mask_token_id=V - 1,
                        target_layer_ids=[0, 1], num_target_layers=2)
    torch.manual_seed(0)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    return DFlashDrafter(cfg, emb, head)


def _one_split(rank: int, split: list[list[int]]) -> dict:
    """One training step of a fresh DDP drafter on this rank's rows of `split`: loss, weight sum,
    update and logged metrics. The DDP objects die when this returns, while the process group is alive
    (as in drafter_rank.py): a reducer destroyed after destroy_process_group can deadlock with gloo's
    threads, which still hold the comm hook's Python callbacks (seen once in ~40 runs)."""
    # decay weights (fixed, 1 on every slot at B = 2): each token counts equally, whatever the split
    settings = StepSettings(num_anchors=4, gamma=1.0, label_source="data", mask_kind="dense", position_weights="decay")
    drafter = _drafter()
    ddp = nn.parallel.DistributedDataParallel(drafter)
    ddp.register_comm_hook(None, sum_gradients_hook)
    ids = split[rank]
    rows = {k: torch.stack([_row(i)[k] for i in ids]) for k in ("input_ids", "position_ids", "loss_mask")}
    feats = torch.stack([_features(i) for i in ids])
    params = [p for p in drafter.parameters() if p.requires_grad]
    before = torch.cat([p.detach().flatten() for p in params])
    opt = torch.optim.SGD(params, lr=1.0, fused=True)  # the update is the gradient itself (fused: reads found_inf)
    acc = MetricAccumulator(2, "cpu")
    batch = Batch(0, np.array(ids), rows, feats, None, None)
    gens = [torch.Generator().manual_seed(0) for _ in ids]  # every valid position is an anchor anyway
    finite = train_step(ReplicatedDrafter(ddp), batch, settings, gens, opt, params, 1e9, acc, group=None, world=2)
    grads = before - torch.cat([p.detach().flatten() for p in params])
    local_sums = acc.state()  # [loss_sum, weight_sum, ...] of this rank
    local = (local_sums[0] / local_sums[1]).float().clone()  # what rank-local normalization would report
    dist.all_reduce(local)
    acc.all_reduce(None)  # what drafter 0 logs: (sum, count) pairs reduced over the drafters
    summary = acc.summary()
    return {"loss": torch.tensor(summary["loss"]), "weight_sum": torch.tensor(summary["weight_sum"]),
            "grads": grads, "summary": summary, "finite": bool(finite), "local_mean": local / 2}


def _worker(rank: int, port: int, out: str) -> None:
    stacks = open(Path(out) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(60, exit=True, file=stacks)  # a hang: the Python threads' stacks, then exit
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    results = {name: _one_split(rank, split) for name, split in SPLITS.items()}
    gc.collect()  # DDP objects caught in a reference cycle die here too, while the process group lives
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_loss_and_grads_do_not_depend_on_the_split(tmp_path):
    """Prevents rank-local normalization: rows with 1,1,4,4 valid slots split [1,1]|[4,4] or [1,4]|[1,4]
    over two drafters give the same loss and the same gradients (each token counts equally)."""
    ctx = rank_process_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_worker, args=(r, store.port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    try:
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            stacks = tmp_path / f"rank{r}.stacks"
            assert p.exitcode == 0, f"rank {r} exit code {p.exitcode}:\n{stacks.read_text() if stacks.exists() else ''}"
    finally:
        for p in procs:  # a rank left running would hold pytest's exit
            if p.is_alive():
                p.kill()
                p.join()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    a, b = r0["by_size"], r0["mixed"]
    assert a["weight_sum"].item() == b["weight_sum"].item() == 10.0
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a["grads"], b["grads"], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(r0["mixed"]["grads"], r1["mixed"]["grads"], rtol=0, atol=0)  # replicas agree
    assert a["grads"].abs().max() > 0
    assert a["finite"] and b["finite"]
    # the logged metrics are the global ones on every rank and for every split
    for r in (r0, r1):
        for name in SPLITS:
            s = r[name]["summary"]
            assert s["weight_sum"] == 10.0 and s["valid_slots"] == 10 and s["skipped_steps"] == 0
            assert abs(s["loss"] - a["loss"].item()) < 1e-5
    # the same data normalized per rank gives a split-dependent loss: the test can tell them apart
    assert (a["local_mean"] - b["local_mean"]).abs() > 1e-3
