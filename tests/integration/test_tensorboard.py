"""TensorBoard event files in the run folder, read back with tensorboard's own reader, equal metrics.jsonl."""

import json
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash_trainer.config.schema import TrainConfig
from tests.tiny_targets import tiny_bundle
from dflash_trainer.telemetry.progress import MetricsLog
from dflash_trainer.telemetry.tensorboard_log import record_scalars
from dflash_trainer.training.run import train
from tests.distributed.pipeline_helpers import T, tiny_config, tiny_drafter_config, tiny_source
from tests.integration.tiny_run import make_prepared


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _scalars(run) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0 = keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(records) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        for tag, value in record_scalars(rec):
            out.setdefault(tag, []).append((rec["step"], value))
    return out


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        for (_, g), (_, w) in zip(got[tag], want[tag]):
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9), (tag, g, w)  # simple_value is float32


def _colocated(tmp_path, **fields) -> TrainConfig:
    """A 4-step co-located CPU run on the 4-layer tiny target (no checkpoint-final, no validation)."""
    tiny_drafter_config(tmp_path / "drafter.json")  # mask token 127: never in make_prepared's rows
    make_prepared(tmp_path / "data", rows=8, T=T)
    base = dict(out=str(tmp_path / "run"), prepared=str(tmp_path / "data"), drafter_config=str(tmp_path / "drafter.json"),
                seq_len=T, num_anchors=8, block_size=4, log_every=1, max_steps=4, device="cpu", target={"path": "tiny"})
    base.update(fields)
    return TrainConfig(**base)


def _target():
    return tiny_bundle("llama", num_layers=4, seed=0)


def test_colocated_run_writes_event_files_equal_to_metrics_jsonl(tmp_path):
    """Prevents TensorBoard curves that drift from metrics.jsonl (other tags, steps or values), and a
    run that ends without its report.png."""
    train(_colocated(tmp_path), target=_target(), save_final=False)
    run = tmp_path / "run"
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    got = _scalars(run)
    assert {"train/loss", "train/tau_estimate", "train/tok_per_s", "train/lr", "train/skipped_steps",
            "accuracy/pos1", "accuracy/pos3"} <= got.keys()
    _assert_same(got, _expected(records))
    assert (run / "report.png").stat().st_size > 10_000


def test_reopened_log_continues_from_the_resumed_step(tmp_path):
    """Prevents duplicate or stale points after a resume: reopening at step 2 keeps steps 1–2 in
    the event files, drops 3–4, and the next records continue at 3."""
    rec = lambda step: {"step": step, "loss": 1.0 / step, "acc_per_position": [0.5, None], "lr": 1e-3}  # noqa: E731
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3, 4):
        log.write(rec(step))
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "lo')  # killed mid-write
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_from_step=2)
    log.write(rec(3))
    log.close()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    got = _scalars(tmp_path)
    assert set(got) == {"train/loss", "train/lr", "accuracy/pos1"}
    _assert_same(got, _expected(records))


def test_process_layout_writes_rank_telemetry_to_tensorboard(tmp_path):
    """Prevents rank telemetry that reaches metrics.jsonl but not TensorBoard (process layout: the
    records come from drafter 0 with every rank's rates)."""
    from dflash_trainer.pipeline.launch import PipelineOptions, run_pipeline

    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=4, target_procs=1, drafter_procs=1)
    run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    run = tmp_path / "run"
    records = _records(run)
    got = _scalars(run)
    assert {"wait_pct/rank0_target", "wait_pct/rank1_drafter", "queue_occupancy/rank1_drafter",
            "transfer_ms/rank1_drafter", "tok_per_s/rank0_target"} <= got.keys()
    _assert_same(got, _expected(records))
    assert (run / "report.png").stat().st_size > 10_000



def test_the_end_of_run_validation_reaches_tensorboard(tmp_path):
    """Prevents validation numbers that only summary.json holds: the validation's loss, τ and per-position
    accuracy are scalars at the last step, equal to the summary's."""
    result = train(_colocated(tmp_path), target=_target())
    got = _scalars(tmp_path / "run")
    v = result.validation
    assert got["validation/loss"] == [(4, got["validation/loss"][0][1])]
    assert math.isclose(got["validation/loss"][0][1], v["loss"], rel_tol=1e-6)
    assert math.isclose(got["validation/tau_exact"][0][1], v["tau_exact"], rel_tol=1e-6)
    assert {f"validation_accuracy/pos{k}" for k, a in enumerate(v["acc_per_position"], 1) if a is not None} == {
        t for t in got if t.startswith("validation_accuracy/")}
    _assert_same({t: s for t, s in got.items() if not t.startswith("validation")}, _expected(_records(tmp_path / "run")))
