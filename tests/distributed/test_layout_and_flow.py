"""Layout, schedule, wire contract and the credit/stop protocol (no processes)."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.cli.main import app
from dflash_trainer.data.loader import epoch_order
from dflash_trainer.pipeline.layout import parse_devices, resolve_layout
from dflash_trainer.training.schedule import RowSchedule
from dflash_trainer.pipeline.wire import (ProtocolError, TransferBatch, WireSpec, allocate, pack_header, pack_ids,
                                            unpack_header)
from dflash_trainer.pipeline.flow import (FailureReport, choose_original, drained_steps, grant_after,
                                           initial_grants, stop_notices)


def _cfg(**kw):
    base = dict(target_gpus=None, drafter_gpus=None, colocate=False, target_procs=None, drafter_procs=None,
                queue_depth=2, rows_per_step=1, device="auto", dry_run=False)
    base.update(kw)
    return TrainConfig(**base)


def _torchrun(rank, world, local_world):
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local_world),
            "LOCAL_WORLD_SIZE": str(local_world)}


def test_parse_devices():
    assert parse_devices("0-4", "--x") == [0, 1, 2, 3, 4]
    assert parse_devices("0,2,5-6", "--x") == [0, 2, 5, 6]
    for bad in ("a", "3-1", "1,1", "", "-1"):
        with pytest.raises(ValueError, match="--x"):
            parse_devices(bad, "--x")


def test_resolve_layout_roles_and_errors():
    """Prevents silently wrong layouts: contradictory or incomplete flags are refused with the fix."""
    lay = resolve_layout(_cfg(target_procs=2, drafter_procs=3, rows_per_step=3), env={})
    assert (lay.launcher, lay.backend, lay.world_size) == ("spawn", "gloo", 5)
    assert [r.role for r in lay.ranks] == ["target", "target", "drafter", "drafter", "drafter"]
    gpu = resolve_layout(_cfg(target_gpus="0-4", drafter_gpus="5-7", rows_per_step=3), env={}, cuda_count=8)
    assert gpu.backend == "nccl" and [r.device for r in gpu.drafters] == ["cuda:5", "cuda:6", "cuda:7"]
    assert not resolve_layout(_cfg(), env={}, cuda_count=0).multiprocess
    cases = [(_cfg(target_gpus="0-1", drafter_gpus="1-2"), "both"),
             (_cfg(target_gpus="0"), "give both"),
             (_cfg(colocate=True, target_procs=1, drafter_procs=1), "colocate"),
             (_cfg(target_procs=1, drafter_procs=2, rows_per_step=3), "rows_per_step=4"),
             (_cfg(target_gpus="0", drafter_gpus="9"), "only 2 CUDA devices"),
             (_cfg(target_gpus="0", drafter_gpus="1", device="cpu"), "device=cpu")]
    for cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            resolve_layout(cfg, env={}, cuda_count=2)
    with pytest.raises(ValueError, match="torchrun"):
        resolve_layout(_cfg(), env=_torchrun(0, 4, 4))
    with pytest.raises(ValueError, match="nproc-per-node"):
        resolve_layout(_cfg(target_procs=1, drafter_procs=1), env=_torchrun(0, 6, 3))


@pytest.mark.parametrize("n,m,nodes", [(1, 2, 1), (2, 1, 1), (2, 3, 1), (3, 2, 1), (5, 3, 1), (1, 3, 2), (2, 2, 3)])
def test_schedule_assigns_every_micro_batch_once_in_order(n, m, nodes):
    """Prevents lost or duplicated micro-batches and deadlocks: every micro-batch has exactly one
    target, each target's micro-batches come in increasing order, targets stay on their node and
    share the work evenly."""
    env = _torchrun(0, nodes * (n + m), n + m) if nodes > 1 else {}
    lay = resolve_layout(_cfg(target_procs=n, drafter_procs=m, rows_per_step=m * nodes), env=env)
    total, first = 7, 2
    seen = {}
    for t in range(lay.num_targets):
        units = list(lay.units_of_target(t, first, total))
        assert units == sorted(units)
        assert lay.first_unit_of_target(t, first, total) == (units[0] if units else None)
        for u in units:
            assert u not in seen and lay.target_index_of(u) == t
            assert lay.targets[t].node == lay.rank_spec(lay.drafter_rank_of(u)).node
            seen[u] = t
    assert sorted(seen) == list(range(first * lay.num_drafters, total * lay.num_drafters))
    per_node = [len([u for u, t in seen.items() if lay.targets[t].node == k]) for k in range(nodes)]
    for t in range(lay.num_targets):
        share = per_node[lay.targets[t].node] / (lay.num_targets // nodes)
        assert abs(list(seen.values()).count(t) - share) <= 1


def test_row_schedule_covers_each_epoch_once():
    """Prevents skipped or repeated rows: the micro-batches of an epoch hold each row once, in the
    loader's (seed, epoch) order, padded with −1 only at the end."""
    sched = RowSchedule(num_rows=7, rows_per_step=4, num_drafters=2, seed=3)
    assert sched.steps_per_epoch == 2 and sched.valid_rows(1) == 3
    for epoch in (0, 1):
        rows = np.concatenate([sched.rows_of(u)[1] for u in range(epoch * 4, epoch * 4 + 4)])
        assert rows[:7].tolist() == epoch_order(7, 3, epoch).tolist() and rows[7:].tolist() == [-1]
        assert {sched.rows_of(u)[0] for u in range(epoch * 4, epoch * 4 + 4)} == {epoch}


@pytest.mark.parametrize("n,m,depth,stop_after,total", [(1, 2, 2, 3, 10), (2, 1, 2, 9, 10), (3, 2, 3, 4, 20),
                                                        (2, 3, 1, 0, 5), (5, 2, 2, 6, 8), (2, 2, 4, 1, 3)])
def test_credit_protocol_ends_with_no_unmatched_message(n, m, depth, stop_after, total):
    """Prevents a hang or a stray message at the end of a run: after the drafters stop at any step,
    every credit they sent is consumed, and every target either ran out of work or got a stop."""
    lay = resolve_layout(_cfg(target_procs=n, drafter_procs=m, rows_per_step=m), env={})
    granted = set()
    for d in range(m):
        steps = list(initial_grants(0, total, depth))
        for s in range(0, stop_after):  # a drafter grants step s + D after finishing s < stop_after
            g = grant_after(s, total, depth)
            if g is not None:
                steps.append(g)
        granted |= {s * m + d for s in steps}
    notices = set(stop_notices(stop_after, total, depth, n, lay.first_unit_of_target).values())
    trained = set(range((stop_after + 1) * m))
    drained = {s * m + d for s in drained_steps(stop_after, total, depth) for d in range(m)}
    assert granted == trained | drained and not granted & notices
    consumed = set()
    for t in range(n):
        for u in lay.units_of_target(t, 0, total):
            consumed.add(u)
            if u in notices:
                break
            assert u in granted, f"target {t} would wait forever for micro-batch {u}"
    assert granted | notices == consumed


def test_wire_header_round_trip_and_checks():
    spec = WireSpec(rows=2, seq_len=8, feature_width=6, hidden_size=3, feature_dtype=torch.float32,
                    need_argmax=True, need_last_hidden=False)
    rows = {"input_ids": torch.arange(16).view(2, 8), "position_ids": torch.arange(8).repeat(2, 1),
            "loss_mask": torch.ones(2, 8, dtype=torch.bool)}
    ids = pack_ids(rows, torch.full((2, 8), 5), spec)
    b = TransferBatch(unit=7, step=3, epoch=1, row_index=torch.tensor([4, -1]), ids=ids, features=torch.zeros(2, 8, 6))
    h = pack_header(b, spec)
    assert h.shape == (spec.header_numel,) and h.dtype == torch.int64
    epoch, row_index, zero = unpack_header(h, spec, unit=7, step=3, src=0)
    assert epoch == 1 and row_index.tolist() == [4, -1] and not zero
    with pytest.raises(ProtocolError, match="expected 8"):
        unpack_header(h, spec, unit=8, step=3, src=0)
    got = allocate(spec, torch.device("cpu"))
    got.ids.copy_(ids)
    assert torch.equal(got.rows()["input_ids"], rows["input_ids"]) and got.argmax().eq(5).all()
    assert spec.payload_bytes() == 4 * 2 * 8 * 4 + 2 * 8 * 6 * 4


def test_choose_original_prefers_own_error_then_death():
    mk = lambda kind, seq: FailureReport(rank=seq, role="drafter", device="cpu", kind=kind, type="X", message="m", seq=seq)  # noqa: E731
    assert choose_original([mk("peer", 1), mk("died", 2), mk("error", 3)]).seq == 3
    assert choose_original([mk("peer", 1), mk("died", 3), mk("died", 2)]).seq == 2
    assert choose_original([mk("stalled", 4), mk("peer", 1)]).seq == 1


def test_cli_dry_run_prints_the_layout():
    """`train --dry-run` prints ranks, roles, devices, feeds and queue depth as JSON, starts nothing."""
    res = CliRunner().invoke(app, ["train", "--target-procs", "2", "--drafter-procs", "1", "--queue-depth", "3",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert body["queue_depth"] == 3 and body["world_size"] == 3 and body["backend"] == "gloo"
    assert [r["role"] for r in body["ranks"]] == ["target", "target", "drafter"]
    assert body["feeds"] == [{"target_rank": 0, "drafter_ranks": [2]}, {"target_rank": 1, "drafter_ranks": [2]}]
    assert [u["target_rank"] for u in body["schedule"]["first_units"][:4]] == [0, 1, 0, 1]
    res = CliRunner().invoke(app, ["train", "--target-gpus", "0-4", "--drafter-gpus", "5-7", "--dry-run",
                                   "--set", "rows_per_step=3"])
    assert res.exit_code == 0, res.output
    assert [r["device"] for r in json.loads(res.output)["ranks"]][-3:] == ["cuda:5", "cuda:6", "cuda:7"]
    # the seed's own split with no other flag: the default batch becomes one row per drafter
    res = CliRunner().invoke(app, ["train", "--target-gpus", "0-4", "--drafter-gpus", "5-7", "--dry-run"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert (body["rows_per_step"], body["rows_per_drafter_step"], body["num_drafters"]) == (3, 1, 3)
    res = CliRunner().invoke(app, ["train", "--target-procs", "1", "--drafter-procs", "2", "--dry-run"])
    assert res.exit_code == 0 and json.loads(res.output)["rows_per_step"] == 2, res.output
    # a dry run plans for other machines: no device or path checks (a CPU login node, GPU-only paths)
    res = CliRunner().invoke(app, ["train", "--target-gpus", "0-4", "--drafter-gpus", "5-7", "--device", "cuda",
                                   "--target", "/models/only-on-gpu-nodes", "--dry-run"])
    assert res.exit_code == 0, res.output
    # a batch the user chose is never changed: not a multiple of the drafters is refused with the fix
    res = CliRunner().invoke(app, ["train", "--target-procs", "1", "--drafter-procs", "2", "--dry-run",
                                   "--set", "rows_per_step=3"])
    assert res.exit_code == 2 and "rows_per_step=4" in res.output
