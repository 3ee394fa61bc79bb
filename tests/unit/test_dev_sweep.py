"""dev/sweep_smollm2.yaml: every ablation variant's --set values are settings the train config accepts, and
dev/sweep_sets.py prints them as the flags dev/recipe_smollm2.sh passes to `dflash-train recipe`."""

import subprocess
import sys
from pathlib import Path

import yaml

from dflash_trainer.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "dev" / "sweep_smollm2.yaml"


def test_every_variant_is_a_valid_train_config():
    """Prevents a variant failing on a misspelled or out-of-range setting after the base run's GPU hours."""
    sweep = yaml.safe_load(SWEEP.read_text())
    assert {"lr-hi", "kl", "pard2", "long"} <= set(sweep)
    for name, sets in sweep.items():
        cfg = load_config(None, {"out": "runs/x"}, sets)  # raises ValueError naming the bad field
        assert cfg.out == "runs/x", name
    cfg = load_config(None, {"out": "runs/x"}, sweep["pard2"])
    assert (cfg.loss.kind, cfg.loss.position_weights, cfg.experimental.feature_dropout) == ("ce_kl", "cat", 0.1)


def test_sweep_sets_prints_flags_and_rejects_unknown_names():
    """Prevents an unknown variant name starting a run that trains the base settings under that name."""
    run = [sys.executable, str(ROOT / "dev" / "sweep_sets.py"), str(SWEEP)]
    out = subprocess.run([*run, "lr-hi"], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["--set", "optim.lr=1.5e-3"]
    bad = subprocess.run([*run, "lr-typo"], capture_output=True, text=True)
    assert bad.returncode == 2 and "variant 'lr-typo' is not in" in bad.stderr and "lr-hi" in bad.stderr
