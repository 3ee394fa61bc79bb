"""The feature cache in whole runs (tiny random target, CPU, fp32): later epochs skip the target
forward and the run trains exactly as without the cache, co-located and in the process layout."""

import json

import torch

from dflash_trainer.training import run as run_module
from dflash_trainer.interop.checkpoint_files import load_checkpoint
from dflash_trainer.pipeline.launch import PipelineOptions, run_pipeline
from dflash_trainer.training.run import train
from tests.distributed.pipeline_helpers import colocated_run, tiny_config, tiny_source

STEPS = 9  # 6 rows, 2 per step: 3 batches per epoch, 3 epochs
REAL_EXTRACT = run_module.extract


def _run(tmp_path, name: str, calls: list, monkeypatch, **fields):
    real = REAL_EXTRACT
    monkeypatch.setattr(run_module, "extract", lambda ex, rows, s: calls.append(rows["input_ids"].shape[0]) or real(ex, rows, s))
    cfg = tiny_config(tmp_path / name, num_rows=6, rows_per_step=2, max_steps=STEPS, device="cpu", log_every=1,
                      validation_max_rows=1, **fields)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(cfg, target=tiny_source().load_full(torch.device("cpu"), torch.float32))
    finally:
        torch.set_num_threads(threads)
    weights = load_checkpoint(tmp_path / name / "run" / "checkpoint-final")[1]
    losses = [json.loads(x)["loss"] for x in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, weights, losses


def test_cached_run_equals_the_uncached_run_with_one_target_pass(tmp_path, monkeypatch, capsys):
    """Prevents a cache that changes training (another row's features, stale labels, a lost epoch
    shuffle) or that still runs the target every epoch: 3 epochs with the cache give bit-identical
    losses and weights, with the target run on the 6 rows once (epoch 1) instead of 3 times."""
    plain_calls, cached_calls = [], []
    plain, w_plain, l_plain = _run(tmp_path, "plain", plain_calls, monkeypatch)
    cached, w_cached, l_cached = _run(tmp_path, "cached", cached_calls, monkeypatch, feature_cache_gib=0.01)
    assert sum(plain_calls) == 18 and sum(cached_calls) == 6  # validation extracts on its own, not through extract
    assert l_cached == l_plain and len(l_plain) == STEPS
    assert all(torch.equal(w_plain[k], w_cached[k]) for k in w_plain)
    assert cached.feature_cache == {**cached.feature_cache, "stored_rows": 6, "rows_served": 12, "rows_computed": 6}
    assert plain.feature_cache is None
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "feature cache: 6 of 6 rows stored" in out and "12 of 18 batch rows served from it" in out


def test_a_small_budget_caches_some_rows_and_stays_close(tmp_path, monkeypatch):
    """Room for 2 of 6 rows (bytes per row: T·k·H·4 fp32 features + T·8 labels): the other rows are
    recomputed on their own, so the run matches the plain run within fp32 summation noise."""
    plain_calls, cached_calls = [], []
    _, w_plain, l_plain = _run(tmp_path, "plain", plain_calls, monkeypatch)
    per_row = 128 * (2 * 64 * 4 + 8)
    cached, w_cached, l_cached = _run(tmp_path, "small", cached_calls, monkeypatch, feature_cache_gib=2.5 * per_row / 2**30)
    assert cached.feature_cache["capacity_rows"] == 2 and cached.feature_cache["stored_rows"] == 2
    assert sum(cached_calls) == 6 + 2 * 4  # epochs 2 and 3 recompute the 4 rows not stored
    assert max(abs(a - b) for a, b in zip(l_plain, l_cached)) < 1e-5
    assert max((w_plain[k] - w_cached[k]).abs().max().item() for k in w_plain) < 1e-5


def test_process_layout_target_serves_later_epochs_from_its_cache(tmp_path, monkeypatch):
    """1 target process → 1 drafter process, 3 epochs, cache on the target rank: the weights equal the
    co-located run's and the summary reports the rows the target rank served from its cache."""
    cfg = tiny_config(tmp_path, num_rows=6, rows_per_step=2, max_steps=STEPS, target_procs=1, drafter_procs=1,
                      feature_cache_gib=0.01)
    result = run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    assert result is not None and result.steps == STEPS
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (cache,) = summary["feature_cache"].values()
    assert cache["stored_rows"] == 6 and cache["rows_served"] == 12 and cache["rows_computed"] == 6
    ref, _ = colocated_run(cfg.updated({"feature_cache_gib": 0.0}), STEPS)
    weights = load_checkpoint(tmp_path / "run" / "checkpoint-final")[1]
    assert max((weights[k] - ref[k]).abs().max().item() for k in ref) < 1e-5
