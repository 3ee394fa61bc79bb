"""Feature reuse (`anchor_draws_per_row`): each target batch serves several optimizer steps, each on
freshly drawn anchors, in the co-located run and in the process layout (tiny models, CPU, fp32)."""

import json
import shutil

import numpy as np
import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.training import run as run_module
from dflash_trainer.interop.checkpoint_files import load_checkpoint
from dflash_trainer.training.schedule import RowSchedule, anchor_seed, anchor_seeds
from dflash_trainer.pipeline.launch import PipelineOptions, run_pipeline
from dflash_trainer.training.run import train
from tests.distributed.pipeline_helpers import T, colocated_run, tiny_config, tiny_drafter_config, tiny_source
from tests.integration.tiny_run import make_prepared
from tests.tiny_targets import tiny_bundle


def _colocated(tmp_path, out: str, **fields) -> TrainConfig:
    tiny_drafter_config(tmp_path / "drafter.json")  # mask token 127: never in make_prepared's rows
    if not (tmp_path / "data").exists():
        make_prepared(tmp_path / "data", rows=6, T=T)
    base = dict(out=str(tmp_path / out), prepared=str(tmp_path / "data"), drafter_config=str(tmp_path / "drafter.json"),
                seq_len=T, num_anchors=8, block_size=4, log_every=1, max_steps=5, rows_per_step=2, device="cpu",
                target={"path": "tiny"}, anchor_draws_per_row=2, save_every=1, keep_last=10, validation_max_rows=1)
    base.update(fields)
    return TrainConfig(**base)


def _weights(folder):
    return load_checkpoint(folder)[1]


def test_colocated_draws_share_one_target_forward_and_resume_mid_batch(tmp_path, monkeypatch, capsys):
    """Prevents feature reuse that recomputes the target (no saving), trains twice on the same anchors,
    miscounts tokens, or loses its place when resumed between two draws of one batch.

    5 steps at 2 draws per batch = 3 target batches (the last one drawn once); tokens count each
    batch once; resuming from checkpoint-3 (draw 1 of batch 1) ends with exactly the weights of the
    uninterrupted run."""
    calls = []
    real = run_module.extract
    monkeypatch.setattr(run_module, "extract", lambda *a, **k: calls.append(1) or real(*a, **k))
    bundle = tiny_bundle("llama", num_layers=4, seed=0)
    full = train(_colocated(tmp_path, "full"), target=bundle)
    assert full.steps == 5
    assert len(calls) == 3  # 3 training batches (validation extracts on its own)
    assert full.tokens == 3 * 2 * T
    records = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [2 * T, 2 * T, 4 * T, 4 * T, 6 * T]
    # two draws on the same batch give different losses (different anchors)
    assert records[0]["loss"] != records[1]["loss"]

    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", part / "checkpoint-3")
    calls.clear()
    resumed = train(_colocated(tmp_path, "part"), target=bundle)
    assert resumed.steps == 5
    assert len(calls) == 2  # batch 1 again (for its second draw), batch 2
    assert resumed.tokens == full.tokens
    want, got = _weights(tmp_path / "full" / "checkpoint-final"), _weights(part / "checkpoint-final")
    assert max((want[k] - got[k]).abs().max().item() for k in want) == 0.0

    # a finished run re-run with another log_every resumes from checkpoint-final at step 5 (in the
    # middle of batch 2's draws): nothing to train, no target forward, no extra metric record
    calls.clear()
    capsys.readouterr()
    again = train(_colocated(tmp_path, "full", log_every=2), target=bundle)
    assert "resumed from" in capsys.readouterr().out  # not "finished": log_every differs
    assert again.steps == 5 and not calls
    assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == len(records)


def test_process_layout_draws_match_single_process(tmp_path):
    """Prevents a drafter that takes a new micro-batch every step (or the same anchors every draw)
    under feature reuse: 1 target → 2 drafters, 2 draws per batch, 5 steps; the weights equal the
    co-located run's (anchors of each row drawn with seed (seed, epoch, row, draw)), the target
    computed ceil(5 / 2) = 3 batches (6 micro-batches), and tokens count each batch once."""
    cfg = tiny_config(tmp_path, num_rows=8, rows_per_step=2, max_steps=5, target_procs=1, drafter_procs=2,
                      anchor_draws_per_row=2)
    result = run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    assert result is not None and result.steps == 5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    weights = _weights(tmp_path / "run" / "checkpoint-final")
    ref, _ = colocated_run(cfg, 5)
    assert max((weights[k] - ref[k]).abs().max().item() for k in ref) < 1e-5
    target = [r for r in summary["ranks_final"] if r["role"] == "target"][0]
    assert target["items"] == 6
    assert summary["tokens"] == 3 * 2 * T


def test_schedule_counts_optimizer_and_batch_steps():
    """Hand-worked: 10 rows, 4 per step → 3 batch steps per epoch; 2 epochs at 3 draws = 18 optimizer
    steps; max_steps=7 → ceil(7 / 3) = 3 batch steps; draw 0 keeps the seed of a run without reuse."""
    s = RowSchedule(num_rows=10, rows_per_step=4, num_drafters=2, seed=1, anchor_draws=3)
    assert s.total_steps(None, 2) == 18
    assert s.batch_steps(s.total_steps(7, 1)) == 3
    assert s.batch_steps(18) == 6
    assert anchor_seed(1, 0, 5) == anchor_seed(1, 0, 5, 0)
    assert len({anchor_seed(1, 0, 5, d) for d in range(3)}) == 3
    # vectorized over rows = one row at a time; distinct over rows, epochs, draws, seeds; padding too
    rows = np.array([7, -1, 0, 3])
    assert anchor_seeds(1, 2, rows, 1).tolist() == [anchor_seed(1, 2, int(r), 1) for r in rows]
    grid = {anchor_seed(sd, e, r, d) for sd in (0, 1) for e in range(3) for r in range(-1, 6) for d in range(3)}
    assert len(grid) == 2 * 3 * 7 * 3 and min(grid) >= 0
    assert torch.equal(torch.as_tensor(s.rows_of(0)[1]), torch.as_tensor(RowSchedule(10, 4, 2, 1).rows_of(0)[1]))
