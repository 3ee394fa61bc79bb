"""The same program under torchrun: two "nodes" on this host (static rendezvous on 127.0.0.1), each
running 1 target + 1 drafter process, train exactly what the spawned 2 + 2 layout trains."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from pipeline_helpers import tiny_config, write_cli_target
from safetensors.torch import load_file

from dflash_trainer.pipeline.launch import run_pipeline


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_two_torchrun_nodes_match_the_spawned_layout(tmp_path):
    """Prevents the multi-node path from drifting from the single-host one: per-node layout flags,
    global ranks node·(n_t + n_d) + local rank, targets feeding the drafters of their node."""
    cfg = tiny_config(tmp_path, rows_per_step=4, max_steps=6, log_every=1)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    target = write_cli_target(tmp_path / "target")
    cli = ["-m", "dflash_trainer.cli.main", "train", "--config", str(tmp_path / "cfg.yaml"), "--target", str(target)]

    # the spawned layout from this process (what `train --target-procs 2 --drafter-procs 2` runs; the
    # ranks load the target from the same folder)
    spawned = run_pipeline(cfg.updated({"target.path": str(target), "target_procs": 2, "drafter_procs": 2,
                                                  "out": str(tmp_path / "spawned")}))
    assert spawned is not None and spawned.steps == 6

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    nodes = [subprocess.Popen([*torchrun, "--node-rank", str(n), *cli, "--target-procs", "1", "--drafter-procs", "1",
                               "--out", str(tmp_path / "torchrun")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    layout = json.loads((tmp_path / "torchrun" / "layout.json").read_text())
    roles = [(r["rank"], r["role"], r["node"]) for r in layout["ranks"]]
    assert roles == [(0, "target", 0), (1, "drafter", 0), (2, "target", 1), (3, "drafter", 1)]

    assert _losses(tmp_path / "torchrun") == _losses(tmp_path / "spawned")
    a = load_file(str(tmp_path / "torchrun" / "checkpoint-final" / "model.safetensors"))
    b = load_file(str(tmp_path / "spawned" / "checkpoint-final" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() == 0 for k in a)
